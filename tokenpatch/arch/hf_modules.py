"""Where a Hugging Face model keeps what tokenpatch reads: its decoder layers, each layer's sites
(``Sites``), its heads and attention outputs, as the ``Family`` records of ``arch.families`` say.

``HFModules`` is the module map half of ``HFAdapter`` (``arch.hf`` adds the two passes): the
methods of ``Adapter`` that name modules and parameters, not the ones that run the model, and
``alone_anchor``: a token alone's anchor from its recorded values, through the modules after them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import offload
from tokenpatch.arch.base import Adapter
from tokenpatch.arch.experts import output_matrix, stacked_experts
from tokenpatch.arch.families import FAMILIES
from tokenpatch.arch.family import Family
from tokenpatch.arch.float64 import linear64, norm64
from tokenpatch.arch.outputs import BiasOutput, ExpertsOutput, GatedOutput, MatrixOutput, ScaledMatrixOutput
from tokenpatch.arch.record import LayerRecord
from tokenpatch.arch.sites import Sites
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.per_model import PerModel

__all__ = ["HFModules"]

_PREFIXES: PerModel[tuple[nn.ModuleList, list[str]]] = PerModel()  # model -> (its layers, their names)
# inside ``HFModules.fixed``: (what, model id, layer) -> (the model, what was looked up)
_KEPT: ContextVar[dict | None] = ContextVar("tokenpatch_module_map", default=None)


def _kept(model: nn.Module, key: tuple, look_up: Callable[[], Any]) -> Any:
    """``look_up()``, once per ``fixed`` block and ``model`` (every time outside one)."""
    kept = _KEPT.get()
    if kept is None:
        return look_up()
    found = kept.get((id(model), *key))
    if found is None or found[0] is not model:
        found = kept[(id(model), *key)] = (model, look_up())
    return found[1]


def text_config(model: nn.Module) -> Any:
    """The configuration of ``model``'s text decoder: ``model.config`` itself, or, for a multimodal model
    (Gemma 3's ``Gemma3ForConditionalGeneration``), the ``text_config`` inside it (``None`` without a config)."""
    config = getattr(model, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class HFModules(Adapter):
    """The module map of a Hugging Face causal LM of the ``FAMILIES`` block designs."""

    @staticmethod
    def family(model: nn.Module) -> Family | None:
        """The model's ``Family`` record, from ``config.model_type`` and the first record whose ``when``
        holds for its text decoder's config (``None``: not a known design)."""
        mt = getattr(getattr(model, "config", None), "model_type", None)
        return _kept(
            model,
            ("family",),
            lambda: next((f for f in FAMILIES if mt in f.model_types and f.when(text_config(model))), None),
        )

    @contextlib.contextmanager
    def fixed(self, model: nn.Module) -> Iterator[None]:
        """The family, each layer's record and ``sites`` looked up once while the block runs (``_kept``);
        a block inside another keeps the outer one's."""
        if _KEPT.get() is not None:
            yield
            return
        token = _KEPT.set({})
        try:
            yield
        finally:
            _KEPT.reset(token)

    def matches(self, model: nn.Module) -> bool:
        return self.family(model) is not None

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers (``model.base_model.<Family.layers>``)."""
        return model.base_model.get_submodule(self.family(model).layers)

    def n_layers(self, model: nn.Module) -> int:
        return len(self.layers(model))

    def _prefix(self, model: nn.Module, i: int) -> str:
        """The qualified name of decoder layer ``i`` in ``model``, with a trailing dot (found once per
        model and layer list, then remembered)."""
        layers = self.layers(model)
        seen = _PREFIXES.get(model)
        if seen is None or seen[0] is not layers:
            where = {id(mod): name for name, mod in model.named_modules()}
            seen = (layers, [where[id(layer)] + "." for layer in layers])
            _PREFIXES[model] = seen
        return seen[1][i]

    def _layer_family(self, model: nn.Module, i: int) -> Family:
        """The family record of layer ``i``: the model's, or its ``MoE.dense`` one where the layer has a
        plain MLP (a mixture-of-experts model's dense layers), as the layer's mixer has it (``Family.at``:
        a hybrid model's recurrent layers)."""
        return _kept(model, ("layer", i), lambda: self._look_up_layer(model, i))

    def _look_up_layer(self, model: nn.Module, i: int) -> Family:
        layer = self.layers(model)[i]
        fam = self.family(model).at(layer)
        try:
            layer.get_submodule(fam.down or fam.mlp)
        except AttributeError:
            if fam.moe is None or fam.moe.dense is None:
                raise
            fam = next(f for f in FAMILIES if f.name == fam.moe.dense).at(layer)
        return fam

    def _layer(self, model: nn.Module, i: int) -> tuple[Family, nn.Module]:
        """Layer ``i``'s family record (``_layer_family``) and the layer, whose submodules its names name."""
        return self._layer_family(model, i), self.layers(model)[i]

    def forward_defaults(self, model: nn.Module) -> dict:
        return {"use_cache": False} if any(m.keeps_state for m in self.family(model).mixers) else {}

    def pads_exactly(self, model: nn.Module) -> bool:
        """Attention-only models: the pads are masked out. A recurrent layer (``Family.mixers``) reads what
        transformers gives it at a pad (zeroed inputs, then biases): taken as not exact."""
        return not self.family(model).mixers

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model that is not a causal LM (a base model, a sequence or token classifier: no LM
        head), or whose layers share a module tokenpatch hooks or patches (one ``nn.Module`` object in
        two layers: its hooks would fire once per layer and mix their records), or that is in training
        mode (dropout would make the passes differ)."""
        if model.get_output_embeddings() is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a causal language model (it has no LM head): tokenpatch "
                "patches causal LMs; load the model with AutoModelForCausalLM"
            )
        owner: dict[int, int] = {}
        for i, layer in enumerate(self.layers(model)):
            owned = self._layer_family(model, i).owned
            for name, module in [("the layer", layer), *((n, layer.get_submodule(n)) for n in owned)]:
                j = owner.setdefault(id(module), i)
                if j != i:
                    raise UnsupportedModelError(
                        f"layers {j} and {i} share one module ({name}: the same nn.Module object): each layer's "
                        "patch needs its own modules; give every layer its own copy (copy.deepcopy)"
                    )
        if model.training:
            raise InputError(
                "the model is in training mode (dropout would make the two passes differ): call model.eval()"
            )

    def sites(self, model: nn.Module, i: int) -> Sites:
        return _kept(model, ("sites", i), lambda: self._look_up_sites(model, i))

    @staticmethod
    def _scaling(model: nn.Module, fam: Family, prefix: str) -> dict:
        """``r`` and ``c`` of layer ``prefix``: constants of the config, or where a design names a parameter of
        the layer (``Family.per_channel``), its values ``[d]`` (read through ``offload.value``)."""

        def factor(f, constant):
            return offload.value(model, f"{prefix}{f}").detach() if isinstance(f, str) else constant(text_config(model))

        return dict(scale=factor(fam.out_scale, fam.scale), residual=factor(fam.residual_scale, fam.residual))

    def _look_up_sites(self, model: nn.Module, i: int) -> Sites:
        (fam, layer), p = self._layer(model, i), self._prefix(model, i)
        parallel = fam.parallel(text_config(model))
        inputs = () if parallel else tuple(f"{p}{name}" for name in fam.inputs)
        down = None if fam.down is None else layer.get_submodule(fam.down)
        scaling = self._scaling(model, fam, p)  # out = c m + r MLP(s)
        if fam.residual_weights is not None:  # c a [d] weight of the layer (Doge's)
            scaling["residual"] = offload.value(model, f"{p}{fam.residual_weights[1]}").detach()
        if down is None:  # a block without an MLP: the input change of its mixer's out_proj is the patch
            output = None
        elif fam.experts:
            if not stacked_experts(down, f"{p}{fam.down}"):
                raise UnsupportedModelError(
                    f"{p}{fam.down} ({type(down).__name__}) is not a stacked-experts module of transformers "
                    "(use_experts_implementation): its output matrices are unknown"
                )
            output = ExpertsOutput(f"{p}{fam.down}.{output_matrix(down)}", **scaling)
        elif fam.down_gate is not None:
            output = GatedOutput(f"{p}{fam.down}.weight", **scaling)
        elif fam.post_mlp_norm is not None:
            output = ScaledMatrixOutput(f"{p}{fam.down}.weight", f"{p}{fam.post_mlp_norm}.weight", **scaling)
        elif getattr(down, "bias", None) is not None:
            output = BiasOutput(f"{p}{fam.down}.bias", **scaling)
        else:
            output = MatrixOutput(f"{p}{fam.down}.weight", **scaling)
        sum_norm = None if fam.sum_norm is None else f"{p}{fam.sum_norm}"
        return Sites(inputs, output, None if parallel else f"{p}{fam.mlp}", sum_norm)

    # ------------------------------------------------------------------------- heads and attention
    def _attention_only(self, model: nn.Module) -> Family:
        """The model's family, where every layer mixes tokens by attention heads (the head tools read
        them in every layer); a hybrid model's recurrent layer refused by name."""
        for i in range(self.n_layers(model)):
            fam = self._layer_family(model, i)
            if fam.mixers:
                mixer, where = fam.mixers[0], "in place of" if fam.recurrent else "beside"
                raise UnsupportedModelError(
                    f"layer {i} of this {model.config.model_type} model mixes tokens by a {mixer.kind} "
                    f"({mixer.module}) {where} attention heads: the head tools need attention alone in every layer"
                )
        return self.family(model)

    def n_heads(self, model: nn.Module) -> int:
        self._attention_only(model)
        c = text_config(model)
        return int(getattr(c, "num_attention_heads", None) or c.n_head)

    def output_projections(self, model: nn.Module) -> list[nn.Module]:
        fam = self._attention_only(model)
        return [layer.get_submodule(fam.o_proj) for layer in self.layers(model)]

    def attention_outputs(self, model: nn.Module) -> list[nn.Module]:
        fam = self._attention_only(model)
        return [layer.get_submodule(fam.attention_output) for layer in self.layers(model)]

    def mlp_outputs(self, model: nn.Module) -> list[nn.Module]:
        layers = (self._layer(model, i) for i in range(self.n_layers(model)))
        return [layer.get_submodule(fam.mlp_output) for fam, layer in layers]

    def attention_norms(self, model: nn.Module) -> list[nn.Module | None]:
        name = self._attention_only(model).post_attn_norm
        return [None if name is None else layer.get_submodule(name) for layer in self.layers(model)]

    def mlp_input_from_heads(self, model: nn.Module, i: int, h: Tensor) -> Callable[[Tensor], Tensor]:
        fam = self._attention_only(model)
        if fam.parallel(text_config(model)):
            raise UnsupportedModelError(
                f"{fam.name} with a parallel block: its MLP reads the layer input, which the "
                "context does not change, so the heads carry none of the input patch"
            )
        layer = self.layers(model)[i]
        heads = linear64(layer.get_submodule(fam.o_proj))
        bias = None if fam.attn_bias is None else _parameter(layer, fam.attn_bias)  # added outside the attention
        if bias is not None:
            bias = offload.value(layer, fam.attn_bias, bias).detach().double()
        o_proj = heads if bias is None else (lambda z: heads(z) + bias)

        def norm(name: str | None) -> Callable[[Tensor], Tensor]:  # the norm there, or none
            return (lambda a: a) if name is None else norm64(layer.get_submodule(name), name)

        if fam.per_channel:
            raise UnsupportedModelError(
                f"{fam.name}: its sublayers are added with learned factors per channel; the head tools do not model them"
            )
        post, mlp_norm, added = norm(fam.post_attn_norm), norm(fam.mlp_norm), norm(fam.add_norm)
        scale = fam.scale(text_config(model))  # Granite's residual multiplier
        kept = _kept_input(fam, layer, h)  # Doge's a * h, else h
        return lambda z: mlp_norm(added(kept + scale * post(o_proj(z))))

    def attention_patterns(self, model: nn.Module, inputs: Any) -> list[Tensor]:
        """One forward with ``output_attentions=True`` under eager attention (fused kernels return no
        probabilities), the model's own implementation restored afterwards, errors included."""
        before = getattr(model.config, "_attn_implementation", None)
        if before is None:
            raise InputError(f"{type(model).__name__} exposes no attention implementation to switch to eager")
        try:
            if before != "eager":
                model.set_attn_implementation("eager")
            with torch.no_grad():
                out = model(inputs, output_attentions=True)
        finally:
            if before != "eager":
                model.set_attn_implementation(before)
        return [a.detach() for a in out.attentions]

    def describe(self, model: nn.Module) -> dict:
        c = text_config(model)
        return {
            **super().describe(model),
            "family": self.family(model).name,
            "model_type": model.config.model_type,
            "n_layers": self.n_layers(model),
            "hidden_size": c.hidden_size,
            "name_or_path": getattr(c, "name_or_path", "") or getattr(c, "_name_or_path", ""),
        }

    def alone_anchor(self, model: nn.Module) -> Callable | None:
        """``(i, states) -> (m_0, s_0)`` of each query alone at layer ``i`` from its with-context states
        (``_alone_from_values``) where every layer's family names its values; else ``None``."""
        layers = [self._layer(model, i) for i in range(self.n_layers(model))]
        if all(fam.value is not None and hasattr(layer.get_submodule(fam.attn), "head_dim") for fam, layer in layers):
            return functools.partial(self._alone_from_values, model)
        return None

    def _alone_from_values(self, model: nn.Module, i: int, r: LayerRecord) -> tuple[Tensor, Tensor]:
        """Each query alone at layer ``i``, from the values ``v`` the with-context pass recorded there.

        A token alone attends to itself only (one attention weight, 1), so its attention output is
        ``a_0 = W_o [v; ...; v]``, each key-value head repeated for the query heads sharing it; the
        layer then applies what follows the attention (``Family.post_attn_norm``, ``out_scale``) and adds
        ``m_0 = h + a_0`` (through ``Family.add_norm`` where the block has one), the layer input ``h``
        being the with-context one (the patched layers below reproduce it). ``s_0``: the MLP's norm of
        ``m_0``; ``m_0`` where the MLP reads the residual stream; a parallel block's MLP reads the layer
        input's norm, the same in both passes. ``(m_0, s_0)`` ``[B, Q, .]``: the layer's other work
        (the query and key projections, the attention itself, the MLP) is never run for them.

        The repeat is folded into ``W_o`` (``[W_1 .. W_G] [v; ..; v] = (W_1 + .. + W_G) v`` per key-value
        head: a product ``G`` times smaller). A query with nothing before it (``r.first``, from
        ``trace``) has the same ``(m, s)`` with and without the context: it keeps its recorded ones,
        the same to the bit (a post-MLP norm's patch is then exactly zero, ``solve.output_patch_scaled``)."""
        fam, layer = self._layer(model, i)
        o_proj, v = layer.get_submodule(fam.o_proj), r.v  # v [B, Q, kv_heads * head_dim]
        a = _lone_attention(o_proj, v, layer.get_submodule(fam.attn).head_dim)  # [B, Q, d]
        if fam.post_attn_norm is not None:
            a = layer.get_submodule(fam.post_attn_norm)(a)
        if fam.out_scale is not None:
            a = a * fam.out_scale(text_config(model))
        m = _kept_input(fam, layer, r.h) + a
        if fam.add_norm is not None:  # a norm after the add (OPT-350m): m = N(h + a)
            m = layer.get_submodule(fam.add_norm)(m)
        first = r.first  # [B, Q]  queries with no context: their recorded rows, written in place
        rows = first.to(m.device).nonzero(as_tuple=True) if first is not None and bool(first.any()) else None
        if rows is not None:  # m: a new tensor (the sum above)
            m[rows] = r.m[rows]
        if self.family(model).parallel(text_config(model)):
            return m, r.s
        if fam.mlp_norm is None:
            return m, m
        s = layer.get_submodule(fam.mlp_norm)(m)
        if rows is not None:
            s[rows] = r.s[rows]
        return m, s


def _parameter(layer: nn.Module, name: str) -> Tensor | None:
    """The layer's parameter ``name``, or ``None`` where this layer has none (GPT-NeoX Japanese's
    attention bias, in its last layer only)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(layer.get_submodule(owner) if owner else layer, leaf, None)


def _kept_input(fam: Family, layer: nn.Module, h: Tensor) -> Tensor:
    """What the attention's add keeps of the layer input ``h``: ``a * h`` where the layer weights it per
    channel (``Family.residual_weights``, Doge's), else ``h`` itself."""
    if fam.residual_weights is None:
        return h
    return h * offload.value(layer, fam.residual_weights[0]).detach().to(h.device, h.dtype)


def _lone_attention(o_proj: nn.Module, v: Tensor, head_dim: int) -> Tensor:
    """``W_o [v; ...; v] (+ b)``: the attention output of tokens alone from their values ``v`` ``[..., K * hd]``,
    each of the ``K`` key-value heads repeated for the ``G`` query heads sharing it. A plain
    ``nn.Linear`` on ``v``'s device: ``G`` column blocks per key-value head summed first (``[d, K * hd]``),
    then one product. A module with hooks (a head ablation, a recording, accelerate's) or of another
    type (an adapter) runs as itself on the repeated heads, so whatever it does to its input applies."""
    groups = o_proj.in_features // v.shape[-1]  # query heads per key-value head
    w = getattr(o_proj, "weight", None)
    plain = type(o_proj) is nn.Linear and not (o_proj._forward_pre_hooks or o_proj._forward_hooks)
    if plain and getattr(o_proj, "_hf_hook", None) is None and w.device == v.device:
        if groups > 1:  # [d, K * G * hd] -> [d, K * hd]
            w = w.unflatten(-1, (-1, groups, head_dim)).sum(-2).flatten(-2)
        return nn.functional.linear(v, w, o_proj.bias)
    heads = v.unflatten(-1, (-1, head_dim)).repeat_interleave(groups, -2).flatten(-2)
    return o_proj(heads)
