"""``Family``: a Hugging Face block design as a table of its modules by role and position, names
relative to a decoder layer, built by keyword. The records, one per design, are in ``arch.families``;
``arch.hf_modules`` and ``arch.hf`` read them.

A block, in the notation of ``docs/patch-theorem.md`` (``h`` the layer input, ``A`` the attention)::

    sequential   a = post_attn_norm(A(h)) * r,   m = h + a  (then post_add_norms[0](m)),
                 s = mlp_norm(m)  (s = m without one),
                 out = c m + post_mlp_norm(down(hidden)) * r  (then post_add_norms[1](out))
    parallel     s = mlp_norm(h),  out = h + A(h) + MLP(s)      (m = h + A(h))

``r`` is ``out_scale(config)``, ``c`` ``residual_scale(config)`` (1 without them). Every role a reader needs beyond the fields (the module
whose output is a sublayer's contribution, the module whose input is ``m``, whether ``s = m``, the
experts, the recorded sites) is derived here, in one place, from the fields: a design is its fields.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tokenpatch.arch.record import NamedSite
from tokenpatch.errors import caller_stacklevel

__all__ = ["Family", "Mixer", "MoE", "NamedSite", "SELF_ATTN_QK", "PARALLEL"]


SELF_ATTN_QK = ("self_attn.q_proj", "self_attn.k_proj")  # Llama's query and key projections (``lone_zero``)


def _always(config: Any) -> bool:
    return True


def _never(config: Any) -> bool:
    return False


# attention and MLP read one norm of the layer input (a parallel block: Phi, Cohere, Falcon's parallel form)
PARALLEL = dict(mlp_norm="input_layernorm", parallel=_always)


def _constant(factor: Callable[[Any], float] | str | None, config: Any) -> float:
    if isinstance(factor, str):
        raise TypeError(f"{factor} is a parameter of each layer (Family.per_channel), not a constant of the config")
    return 1.0 if factor is None else float(factor(config))


def _has(module: Any, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP. ``dense``: the family of its layers with a plain MLP (Qwen3-MoE's
    ``mlp_only_layers``). ``shared_gate``: a shared expert's gate module, whose sigmoid scales
    ``Family.down`` (the shared expert's output matrix); ``shared``: a shared expert added as it is
    (DeepSeek's, GLM-4-MoE's, ERNIE 4.5's), ``down`` its output matrix, which takes the whole output
    shift; neither: ``down`` is the stacked experts (``arch.experts``)."""

    dense: str | None = "llama"
    shared_gate: str | None = None
    shared: bool = False


@dataclass(frozen=True)
class Mixer:
    """A layer's mixer other than softmax attention, found in a layer in place of ``Family.attn``: a
    recurrent or convolutional layer (``docs/recurrent-layers.md``). ``module``: the mixer; ``out_proj``:
    its output matrix, the first dense map that reads its context-dependent output; ``kind``: what it
    computes, in words (descriptions and errors only). ``classes``: the class names the module must
    have (where every layer names its mixer alike, Nemotron-H's ``mixer``; empty: any); ``fields``: the
    family fields such a layer has otherwise (its MLP, norms), as ``(name, value)`` pairs; ``beside``:
    the mixer runs beside the layer's attention (Falcon-H1), whose record the layer keeps; ``reads_pads``:
    transformers does not mask its input at padding (RecurrentGemma's recurrent block), so a left-padded
    row's forward is not its prompt's, and padded inputs are refused; ``keeps_state``: transformers keeps
    its decoding state in the module rather than in a cache object (RecurrentGemma's), so a one-token
    forward with ``use_cache`` continues from the last cached forward: tokenpatch's run without a cache.

    Such a layer needs nothing new of a token patch: a token alone runs the mixer from a zero state
    (no earlier token, zero convolution history), which the no-context pass does, each query a
    sequence of its own; the MLP after it is patched as after attention."""

    module: str
    out_proj: str
    kind: str
    classes: tuple[str, ...] = ()
    fields: tuple[tuple[str, Any], ...] = ()
    beside: bool = False
    reads_pads: bool = False
    keeps_state: bool = False

    def found(self, layer: Any) -> bool:
        """Whether ``layer`` (an ``nn.Module``) has this mixer."""
        if not _has(layer, self.module):
            return False
        return not self.classes or type(layer.get_submodule(self.module)).__name__ in self.classes


@dataclass(frozen=True, kw_only=True)
class Family:
    """Where a block design keeps what a patch needs (module docstring), by role and position.

    Which models: ``model_types`` and ``when`` (which of their configs; the first record whose ``when``
    holds is the model's: Falcon and StableLM have several). ``parallel``: whether a config has a
    parallel block. ``layers``: the decoder layers' ``ModuleList`` under the base model.

    The attention: ``attn`` (its module), ``o_proj`` (its output matrix, whose input is the heads'
    outputs side by side), ``lone_zero`` (projections a token alone does not need: its own query and
    key, one attention weight, 1), ``value`` (its value projection, where a token alone's attention
    output is ``o_proj`` of its values; ``None``: fused projections, or an attention that does more
    than mix values, whose lone token runs the layers), ``attn_bias`` (a bias the layer adds to the
    attention's output outside its module, a parameter of the layer where it has one: GPT-NeoX Japanese's
    last layer's ``attention.dense_bias``).

    ``mixers``: what a layer of a hybrid model has in place of ``attn`` (``Mixer``: a recurrent or
    convolutional layer), the first one it has; ``at(layer)`` is that layer's record.

    The MLP: ``mlp`` (the module whose input is ``s``, the input change's site), ``inputs`` (the
    parameters reading ``s``), ``down`` (its output matrix, whose input is ``hidden``), ``moe`` (a
    mixture of experts, ``MoE``). A block without an MLP (Mamba's: ``out = h + mixer(norm(h))``) has
    ``down=None``: ``mlp`` is the first dense map reading the mixer's context-dependent output (its
    ``out_proj``), whose input change is the whole patch (``docs/recurrent-layers.md``).

    The norms, by where they sit: ``mlp_norm`` before the MLP (its input ``m``, its output ``s``;
    ``None``: the MLP reads the residual stream itself, ``s = m``); ``post_attn_norm`` and
    ``post_mlp_norm`` on a sublayer's output before its residual add (Gemma 2/3, OLMo 2/3, GLM-4; the
    one after the MLP is patched in its scale); ``post_add_norms``: norms after each residual add,
    (after the attention's, after the MLP's) (OPT-350m: ``m = N(h + a)``, the layer outputs
    ``N'(m + MLP(m))``; a token patch needs nothing of the second, a thought patch fits the sum).

    The output side: ``out_scale`` (a constant the block multiplies each sublayer's output by, from the
    config: Granite's ``residual_multiplier``), ``residual_scale`` (a constant it multiplies the residual
    value ``m`` by at the MLP's add: MiniMax's ``mlp_alpha_factor``); either may instead name a parameter
    under the layer, a factor per channel (``per_channel``: ZAYA's learned residual scaling);
    ``residual_weights`` (the layer's per-channel weights of the residual stream at each add, (at the
    attention's, at the MLP's): Doge's ``m = a * h + A(N(h))``, ``out = c * m + MLP(s)``; the second is ``c``),
    ``matrices_out`` (the sublayers' contributions are their output matrices' outputs, ``o_proj``'s and
    ``down``'s: the modules add the residual themselves, Bloom and MPT's MLP, or the MLP is no module, OPT),
    ``position_table`` (a learned position embedding under the base model, GPT-2's ``wpe``, whose size
    bounds the position ids), ``shortcut`` (a module whose output the layer adds to its output beside the
    MLP's, computed before the MLP: part of the residual value ``m``, LongCat-Flash's mixture of experts)."""

    name: str
    model_types: tuple[str, ...]
    when: Callable[[Any], bool] = _always
    parallel: Callable[[Any], bool] = _never
    layers: str = "layers"
    attn: str = "self_attn"
    o_proj: str = "self_attn.o_proj"
    lone_zero: tuple[str, ...] = ()
    value: str | None = None
    attn_bias: str | None = None
    mixers: tuple[Mixer, ...] = ()
    mlp: str = "mlp"
    inputs: tuple[str, ...]
    down: str | None
    moe: MoE | None = None
    mlp_norm: str | None
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    post_add_norms: tuple[str, str] | None = None
    out_scale: Callable[[Any], float] | str | None = None
    residual_scale: Callable[[Any], float] | str | None = None
    residual_weights: tuple[str, str] | None = None
    matrices_out: bool = False
    position_table: str | None = None
    shortcut: str | None = None

    # ----------------------------------------------------------------- derived roles (the one place)
    def at(self, layer: Any) -> Family:
        """The record of ``layer`` (an ``nn.Module``): the one of the first of ``mixers`` it has in place
        of attention (its ``attn`` and ``o_proj`` the mixer's, its ``fields``; no lone-token shortcut:
        ``lone_zero`` and ``value`` empty), else this one without the mixers other layers have in place of
        attention (an attention layer, or one with a mixer beside its attention: ``recurrent`` is ``None``)."""
        mixer = next((m for m in self.mixers if not m.beside and m.found(layer)), None)
        if mixer is None:  # an attention layer: the mixers in place of attention are other layers'
            beside = tuple(m for m in self.mixers if m.beside)
            return self if beside == self.mixers else replace(self, mixers=beside)
        return replace(
            self,
            attn=mixer.module,
            o_proj=mixer.out_proj,
            lone_zero=(),
            value=None,
            mixers=(mixer,),
            **dict(mixer.fields),
        )

    @property
    def recurrent(self) -> Mixer | None:
        """The layer's mixer where it is not attention (a record of ``at``), else ``None``."""
        return self.mixers[0] if self.mixers and self.attn == self.mixers[0].module else None

    @property
    def attention_output(self) -> str:
        """The module whose output is the attention's contribution to the residual stream."""
        return self.post_attn_norm or (self.o_proj if self.matrices_out else self.attn)

    @property
    def mlp_output(self) -> str:
        """The module whose output is the MLP's contribution to the residual stream."""
        return self.post_mlp_norm or (self.down if self.matrices_out else self.mlp)

    @property
    def m_reader(self) -> str:
        """The module whose input is ``m`` (sequential blocks): the norm before the MLP, else the MLP."""
        return self.mlp_norm or self.mlp

    @property
    def down_gate(self) -> str | None:
        """A module whose sigmoid scales ``down``'s output (a shared expert's gate)."""
        return None if self.moe is None else self.moe.shared_gate

    @property
    def experts(self) -> bool:
        """``down`` is the stacked experts (a mixture of experts without a shared expert)."""
        return self.moe is not None and self.moe.shared_gate is None and not self.moe.shared

    @property
    def add_norm(self) -> str | None:
        """A norm of the residual stream right after the attention's add (``m = N(h + a)``)."""
        return None if self.post_add_norms is None else self.post_add_norms[0]

    @property
    def sum_norm(self) -> str | None:
        """A norm of the residual stream after the MLP's add (the layer outputs ``N(m + MLP(s))``)."""
        return None if self.post_add_norms is None else self.post_add_norms[1]

    @property
    def owned(self) -> tuple[str, ...]:
        """The modules a layer's patch hooks or changes (each layer needs its own)."""
        names = (self.mlp, self.mlp_norm, self.attn, self.down, self.post_mlp_norm, self.down_gate, self.add_norm)
        return tuple(n for n in names if n)

    @property
    def per_channel(self) -> bool:
        """``out_scale`` or ``residual_scale`` names a parameter under the layer (a factor per channel), read
        with the layer's weights (``HFModules.sites``) rather than from the config."""
        return isinstance(self.out_scale, str) or isinstance(self.residual_scale, str)

    def scale(self, config: Any) -> float:
        """``r``: what the block multiplies each sublayer's output by (1 without ``out_scale``; a constant of
        the config: ``per_channel`` factors are the layer's parameters)."""
        return _constant(self.out_scale, config)

    def residual(self, config: Any) -> float:
        """``c``: what the block multiplies the residual value ``m`` by at the MLP's add (1 without
        ``residual_scale``)."""
        return _constant(self.residual_scale, config)

    def sites(self, parallel: bool) -> tuple[NamedSite, ...]:
        """The named sites a layer of this design records (``HFAdapter.recording``), in the order
        their hooks are registered: ``h`` the layer's input, ``out`` its output; ``m`` the input of the
        module reading it (before patches), or a parallel block's ``h`` plus the attention's output;
        ``s`` the MLP norm's output, or the MLP's input where it reads ``m`` itself; ``hidden`` the
        output matrix's input (the chosen experts' weighted hidden states); ``gate`` a shared
        expert's gate logit; ``p`` the input of a norm after the MLP (the output matrix's output, or the
        block's where experts add theirs: AFMoE; the routed and shared experts' sum where the norm follows
        the whole block: AXK1, Kolibri); ``sum`` the input of a norm after the MLP's add; ``v`` the values,
        at every position; a ``shortcut``'s output, added to ``m``."""
        s = (
            NamedSite("s", self.mlp_norm, output=True)
            if self.mlp_norm
            else NamedSite("s", self.mlp, output=False, first=True)
        )
        m = (
            NamedSite("m", self.attn, output=True, plus_h=True)
            if parallel
            else NamedSite("m", self.m_reader, output=False, first=True)
        )
        optional = (
            (self.down_gate, NamedSite("gate", self.down_gate or "", output=True)),
            (self.post_mlp_norm, NamedSite("p", self.post_mlp_norm or "", output=False)),
            (self.sum_norm, NamedSite("sum", self.sum_norm or "", output=False)),
            (self.value, NamedSite("v", self.value or "", output=True, every=True)),
            (self.shortcut, NamedSite("m", self.shortcut or "", output=True, adds=True)),
        )
        return (
            NamedSite("h", "", output=False),
            NamedSite("out", "", output=True),
            s,
            *(
                ()
                if self.down is None
                else (NamedSite("hidden", self.down, output=self.experts, experts=self.experts),)
            ),
            m,
            *(site for present, site in optional if present),
        )


# The spelling before issue 42, kept one release: positional arguments in the old order, and the
# fields since renamed (``attn_out``, ``out_norm``) or folded into one (``residual_inside`` and
# ``mlp_out`` into ``matrices_out``; ``add_norm`` and ``sum_norm`` into ``post_add_norms``;
# ``experts``, ``dense`` and ``down_gate`` into ``moe``).
_OLD_ORDER = ("name", "model_types", "layers", "mlp_norm", "attn", "inputs", "down")
_OLD_FIELDS = ("attn_out", "out_norm", "residual_inside", "mlp_out", "add_norm", "sum_norm", "experts", "dense")
_RENAMED = {"attn_out": "post_attn_norm", "out_norm": "post_mlp_norm", "dense": "moe.dense"}


def _old_spelling(init: Callable) -> Callable:
    @functools.wraps(init)
    def call(self, *args, **kwargs):
        if args or kwargs.keys() & {*_OLD_FIELDS, "down_gate"}:
            warnings.warn(
                "Family(...) by position or with the fields of 0.2 (attn_out, out_norm, residual_inside, "
                "mlp_out, add_norm, sum_norm, experts, dense, down_gate) is deprecated; build it by keyword "
                "(post_attn_norm, post_mlp_norm, matrices_out, post_add_norms, moe=MoE(...))",
                DeprecationWarning,
                stacklevel=caller_stacklevel(),
            )
            kw = {**dict(zip(_OLD_ORDER, args)), **kwargs}
            for old in ("attn_out", "out_norm"):
                if old in kw:
                    kw[_RENAMED[old]] = kw.pop(old)
            if kw.pop("residual_inside", False) | bool(kw.pop("mlp_out", None)):
                kw["matrices_out"] = True
            added = (kw.pop("add_norm", None), kw.pop("sum_norm", None))
            if any(added):
                kw["post_add_norms"] = added
            experts, dense, gate = kw.pop("experts", False), kw.pop("dense", None), kw.pop("down_gate", None)
            if experts or dense or gate:
                kw["moe"] = MoE(dense=dense, shared_gate=gate)
            args, kwargs = (), kw
        init(self, *args, **kwargs)

    return call


def _old_field(self: Family, name: str) -> Any:
    """``attn_out``, ``out_norm`` and ``dense`` read by their names before issue 42 (kept one release)."""
    if name not in _RENAMED:
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    warnings.warn(
        f"Family.{name} is deprecated; read Family.{_RENAMED[name]}", DeprecationWarning, stacklevel=caller_stacklevel()
    )
    return getattr(self.moe, "dense", None) if name == "dense" else getattr(self, _RENAMED[name])


Family.__init__ = _old_spelling(Family.__init__)
Family.__getattr__ = _old_field
