"""The adapter interface: what tokenpatch needs to know about a model family.

Everything outside ``tokenpatch.arch`` reaches a model only through the methods declared on
``Adapter``; a family (a user's own, ``tokenpatch.arch.register``) implements those its callers
need, and a caller of one it lacks gets an ``UnsupportedModelError`` naming the method (``require``).

**The passes**, the model's own forward recorded by hooks at named sites (``recording``: per layer a
``LayerRecord`` of ``h``, ``m``, ``s``, ``hidden``, ``out`` and what the output kind needs; masks,
positions, caches and routing stay the model's), the same for every model and every method:

* ``trace``: the with-context pass at the queries; ``anchors``: the no-context pass's ``(m_0, s_0)``
  (``alone_anchor``: where each query alone needs no pass, from the with-context record) -- ``tp.token_patch``,
  ``tp.generate``, the head patches;
* ``prefixes``: every context prefix's query row, recorded and anchored (``arch.prefixes``) -- ``tp.trajectory``;
* ``prompted`` and ``layer_calls``: calibration queries read after a prompt, and each layer run alone as
  the forward calls it -- ``tp.thought_patch``;
* ``sites(model, i) -> Sites``: *where* layer ``i``'s patch goes, as parameter names -- the matrices that
  read ``s`` (or the module whose input ``s`` is) and the output kind (``arch.outputs``: a class per kind).

plus the model's inputs: ``check_inputs``, ``strip`` (the inputs of the no-context pass),
``prefix_inputs``, ``seq_len``, ``batch_size``, ``padding``, and ``run`` (the model's own forward, returning
its output and every layer's output hidden state).

**Adapters of earlier versions** implement ``embed``, ``mix`` and ``finish`` (a layer run on hidden states,
up to and after its MLP) instead of the passes: ``arch.layered`` builds ``trace`` and ``anchors`` from them
(deprecated, with a warning at registration), and ``mix_prefixes`` gives their trajectories. Our models
keep ``mix_prefixes`` as the fast path of ``prefixes`` (virtual query rows).

**The module map** (interpretability and the baselines): ``layers`` (the decoder layers),
``n_heads``, ``output_projections`` (the module whose input is the heads' outputs side by side),
``attention_outputs`` and ``attention_norms`` (what the attention adds to the residual stream),
``mlp_input_from_heads`` (the MLP input as a function of the heads) and ``attention_patterns``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import Tensor, nn

from tokenpatch import files
from tokenpatch.arch import layered, prefixes
from tokenpatch.arch.sites import OUTPUT_KINDS, WEIGHT_LAYOUTS, OutputSite, Sites, weight_layout
from tokenpatch.errors import UnsupportedModelError

__all__ = ["OutputSite", "OUTPUT_KINDS", "Sites", "Adapter", "WEIGHT_LAYOUTS", "weight_layout"]

# Who calls each declared method (named in the error of an adapter that lacks it).
NEEDED_BY = {
    "matches": "tokenpatch.arch.adapter_for",
    "n_layers": "tp.token_patch",
    "check_inputs": "tp.token_patch",
    "seq_len": "tp.token_patch",
    "batch_size": "tp.token_patch",
    "strip": "tp.token_patch",
    "embed": "tp.token_patch",
    "mix": "tp.token_patch",
    "finish": "tp.token_patch",
    "sites": "tp.token_patch",
    "run": "tp.verify",
    "mix_prefixes": "tp.trajectory",
    "prefix_inputs": "tp.trajectory",
    "prompted": "tp.thought_patch",
    "layer_calls": "tp.thought_patch",
    "recording": "tp.generate and tp.thought_patch on a language model",
    "trace": "tp.token_patch and tp.interp.head_patches",
    "anchors": "tp.token_patch, tp.generate and tp.interp.head_patches",
    "layers": "tp.thought_patch on a language model, tp.interp.head_patches and the steering baselines",
    "n_heads": "the head tools: tp.interp ablate_heads and head_patches, the head baselines",
    "output_projections": "the head tools: tp.interp ablate_heads and head_patches, the head baselines",
    "attention_outputs": "the steering baselines (tp.baselines)",
    "attention_norms": "the function-vector baseline (tp.baselines)",
    "mlp_input_from_heads": "tp.interp.head_patches",
    "attention_patterns": "tp.interp.induction (attention patterns, head scores)",
}


class Adapter:
    """Base class; see the module docstring. Subclasses are stateless and registered in
    ``tokenpatch.arch.ADAPTERS``. Every method here that a subclass does not override raises an
    ``UnsupportedModelError`` naming it and its callers (``mix_with_alone``, ``describe``,
    ``padding`` and ``check_positions`` have defaults)."""

    name: str = "base"
    # Does the embedding of a token depend on its position (absolute position embeddings)? Then
    # the first layer's anchor comes from the no-context embedding, not the with-context one.
    position_dependent_embedding: bool = True
    # Config fields that do not change the forward (names, versions, output flags, ...): left out of
    # the config record a patch keeps beside the weight fingerprint (``describe``, ``files.config_record``).
    config_ignored: tuple[str, ...] = ()

    # ------------------------------------------------------------------------- what is implemented
    def implements(self, method: str) -> bool:
        """Whether this adapter's class overrides the declared ``method`` (``trace`` and ``anchors`` too where
        its passes are its ``embed``/``mix``/``finish``: ``layer_by_layer``)."""
        if method in ("trace", "anchors") and self.layer_by_layer():
            return True
        return getattr(type(self), method) is not getattr(Adapter, method)

    def layer_by_layer(self) -> bool:
        """Whether this adapter's passes are its own ``embed``, ``mix`` and ``finish`` (``arch.layered``): an
        adapter written for them (earlier versions; deprecated), which implements them in a class below
        any class of it that implements ``trace``."""
        mro = type(self).__mro__

        def depth(method: str) -> int:
            return next(i for i, cls in enumerate(mro) if method in cls.__dict__)

        return all(self.implements(m) for m in ("embed", "mix", "finish")) and depth("mix") < depth("trace")

    def require(self, *methods: str, by: str) -> None:
        """Raise ``UnsupportedModelError`` naming the first of ``methods`` this adapter lacks (``by``:
        the caller, for the message)."""
        for method in methods:
            if not self.implements(method):
                self._missing(method, by)

    def _missing(self, method: str, by: str | None = None):
        raise UnsupportedModelError(
            f"the {self.name} adapter does not implement {method}() (needed by "
            f"{by or NEEDED_BY.get(method, 'tokenpatch')}); see tokenpatch.arch.Adapter"
        )

    # ------------------------------------------------------------------------- basics
    def matches(self, model: nn.Module) -> bool:
        """Whether this adapter handles ``model``."""
        self._missing("matches")

    def n_layers(self, model: nn.Module) -> int:
        self._missing("n_layers")

    def check_inputs(self, model: nn.Module, inputs: Any) -> Any:
        """Validate (shape, dtype, finiteness) and return the inputs."""
        self._missing("check_inputs")

    def check_model(self, model: nn.Module) -> None:
        """Raise ``UnsupportedModelError`` or ``InputError`` for a model this adapter cannot patch
        exactly as it stands (not a causal LM, layers sharing a module, training mode). ``check_inputs``
        calls it; methods that read no inputs through the adapter call it themselves. The default
        checks nothing."""

    def seq_len(self, inputs: Any) -> int:
        self._missing("seq_len")

    def batch_size(self, inputs: Any) -> int:
        self._missing("batch_size")

    def padding(self, inputs: Any) -> Tensor | None:
        """Where ``inputs`` (as ``check_inputs`` returns them) are padding: ``[batch, pos]`` bool, True at
        padding; ``None`` where every position is a token (the default). Every query mode refuses a
        query that is padding the same way (``plans.refuse_padded_queries``)."""
        return None

    def strip(self, inputs: Any, positions: Tensor, separate: bool) -> Any:
        """No-context inputs: the positions ``positions`` [K] of every sequence, either as one
        shorter sequence each (``separate=False``, [B, K, ...]) or each position as a sequence
        of its own (``separate=True``, [B*K, 1, ...], batch-major)."""
        self._missing("strip")

    def sites(self, model: nn.Module, i: int) -> Sites:
        """Where layer ``i``'s patch goes (``Sites``)."""
        self._missing("sites")

    def run(self, model: nn.Module, inputs: Any) -> tuple[Tensor, list[Tensor]]:
        """The model's own forward: ``(output [B, T, ...], [h^1 .. h^L] each [B, T, d])``."""
        self._missing("run")

    def describe(self, model: nn.Module) -> dict:
        """JSON-able description stored in patch metadata: the class, the adapter and, for a model
        with a ``config``, its fields but ``config_ignored`` (``Patch.check_model`` compares them)."""
        record = files.config_record(getattr(model, "config", None), self.config_ignored)
        return {"class": type(model).__name__, "adapter": self.name, **({"config": record} if record else {})}

    def check_positions(self, model: nn.Module, patch: Any, args: tuple, kwargs: dict) -> None:
        """Raise ``InputError`` if the forward arguments ``(args, kwargs)`` run ``patch`` at other
        positions than it was made for, where the adapter can tell (``functional_call``). The default
        checks nothing: a model without position ids (ours)."""

    def position_limit(self, model: nn.Module) -> int | None:
        """How many positions the model can address (a learned position table's size, GPT-2's
        ``n_positions``), or ``None`` where positions are unbounded (rotary, ours)."""
        return None

    def length_scaling(self, model: nn.Module) -> Any:
        """The model's rotary scaling that changes with the sequence length (``arch.rotary.LengthScaling``:
        a forward's rotation depends on its length's ``regime``), or ``None``: positions rotate alike
        in every forward (the default)."""
        return None

    # ------------------------------------------------------------------------- earlier adapters: a layer run on hidden states (deprecated)
    def embed(self, model: nn.Module, inputs: Any) -> Tensor:
        """The first layer's input ``h^0 [B, T, d]``."""
        self._missing("embed")

    def mix(self, model: nn.Module, i: int, h: Tensor) -> tuple[Tensor, Tensor]:
        """``(m, s)`` ``[N, T, d]`` each of layer ``i`` on ``h [N, T, d]`` (module docstring)."""
        self._missing("mix")

    def mix_with_alone(self, model: nn.Module, i: int, h: Tensor, positions: list[int]):
        """``((m, s), (m0, s0))``: ``mix`` on the whole sequence ``h [B, T, d]``, and on each of
        ``positions`` as a sequence of its own (the anchors, ``[B, P, .]``). The default runs
        ``mix`` twice; adapters override it to reuse the full pass's work (a lone token's
        attention output is ``W_o v`` of its own value vector, already computed)."""
        batch, _, d = h.shape
        m0, s0 = self.mix(model, i, h[:, positions].reshape(-1, 1, d))  # [B*P, 1, .]
        return self.mix(model, i, h), (m0.reshape(batch, len(positions), -1), s0.reshape(batch, len(positions), -1))

    def mix_prefixes(self, model: nn.Module, i: int, h: Tensor, hq: Tensor, lengths: Tensor, with_alone: bool = False):
        """``(m, s)`` of virtual query rows: row ``p`` of ``hq [B, P, d]`` placed right after the first
        ``lengths[p]`` positions of ``h [B, T, d]`` (``tp.trajectory``) -> ``[B, P, .]`` each; with
        ``with_alone`` also ``(m, s)`` of each row alone (the anchors): ``((m, s), (m0, s0))``."""
        self._missing("mix_prefixes")

    def finish(self, model: nn.Module, i: int, m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        """``(hidden, out)``: the input of layer ``i``'s MLP output matrix and the layer output."""
        self._missing("finish")

    # ------------------------------------------------------------------------- the passes
    @contextlib.contextmanager
    def recording(
        self, model: nn.Module, query: Tensor, every: bool = False, on_layer: Callable | None = None
    ) -> Iterator[list[dict[str, Tensor]]]:
        """Hooks that record, during any forward of ``model`` inside the block, per layer the states at
        positions ``query [Q]`` of the sequences run, each ``[B, Q, .]``: ``h`` (layer input), ``m``
        (the residual value the MLP output is added to), ``s`` (MLP input), ``hidden`` (input of the
        MLP output matrix), ``out`` (layer output), and where the output site needs them ``p`` (the MLP
        output before a norm after it) and ``gate`` (a gate logit). ``every``: the query is every
        position in order. The list (one dict per layer) is filled on exit; with ``on_layer(i,
        states)``, each layer's states are given to it as the layer finishes, then dropped."""
        self._missing("recording")
        yield []

    def trace(
        self, model: nn.Module, inputs: Any, query: list[int], on_layer: Callable | None = None
    ) -> list[dict[str, Tensor]]:
        """The with-context pass: per layer the ``recording`` states at the query positions ``[B, Q, .]``;
        with ``on_layer(i, states)``, each layer's states given to it as the layer finishes, then dropped.
        The default, for an adapter written for ``embed``/``mix``/``finish`` (deprecated), runs those
        layer by layer (``arch.layered``)."""
        if self.layer_by_layer():
            return layered.trace(self, model, inputs, query, on_layer)
        self._missing("trace")

    @contextlib.contextmanager
    def fixed(self, model: nn.Module) -> Iterator[None]:
        """While the block runs, ``model``'s module map (its layers, each layer's record and ``sites``) may be
        looked up once and kept: one method's passes read it once, not once per layer and pass. Nothing
        inside may restructure the model (replace a module the map names). The default keeps nothing."""
        yield

    def alone_anchor(self, model: nn.Module) -> Callable | None:
        """Where each query alone needs no pass of its own: ``(i, states) -> (m_0, s_0)``, its anchor at
        layer ``i`` from that layer's with-context states; else ``None`` (``anchors`` runs the pass)."""
        return None

    def anchors(
        self,
        model: nn.Module,
        inputs: Any,
        query: list[int],
        rec: list[dict[str, Tensor]],
        kept: list[int] | None = None,
    ) -> list[tuple[Tensor, Tensor]]:
        """The no-context pass: per layer ``(m_0, s_0)`` at the queries ``[B, Q, d]``, each query alone
        (``kept=None``) or the kept positions as one sequence (a chunk removed); the input of layer
        ``i > 0`` at a query is its with-context state ``rec[i].h``. The default, for an adapter written
        for ``embed``/``mix``/``finish`` (deprecated), runs ``mix`` layer by layer (``arch.layered``)."""
        if self.layer_by_layer():
            return layered.anchors(self, model, inputs, query, rec, kept)
        self._missing("anchors")

    def prefixes(self, model: nn.Module, inputs: Any, query: int, rows: range, steps: bool = False) -> Iterator:
        """The prefix rows ``rows`` of ``tp.trajectory`` (row ``i``: the query at position ``query`` read after
        the first ``i`` tokens), layer by layer: ``(i, prefixes, record, anchor, step anchor)``, each
        ``[B, len(prefixes), .]``: the with-context ``LayerRecord`` at the query, ``(m_0, s_0)`` of the query
        alone and, with ``steps``, of the row with the token before the query removed (``arch.prefixes``).
        Virtual query rows where the adapter runs them (``mix_prefixes``: our models), else rows of the
        adapter's own ``trace`` and ``anchors`` (``prefix_inputs``)."""
        if self.implements("mix_prefixes") or self.layer_by_layer():
            self.require("mix_prefixes", by="tp.trajectory")
            return prefixes.virtual(self, model, inputs, query, rows, steps)
        self.require("prefix_inputs", "trace", "anchors", by="tp.trajectory")
        return prefixes.padded(self, model, inputs, query, rows, steps)

    def forward_defaults(self, model: nn.Module) -> dict:
        """Keyword arguments ``tp.functional_call`` gives the model's forward unless the caller does:
        ``{"use_cache": False}`` for a model that keeps its decoding state in its modules (RecurrentGemma),
        whose one-token forward with a cache would continue from the last cached forward's state."""
        return {}

    def pads_exactly(self, model: nn.Module) -> bool:
        """Whether left padding leaves every real token's states as they are without it (attention masks
        the pads out; a recurrent layer may not: a bias makes a pad's state nonzero). ``False``: the
        prefix rows of ``tp.trajectory`` run unpadded, one prefix per pass."""
        return True

    def prefix_inputs(self, model: nn.Module, inputs: Any, query: int, prefixes: range, width: int) -> Any:
        """The inputs of ``prefixes`` as sequences of their own (``arch.prefixes.padded``): per row of
        ``inputs`` and prefix ``i``, the first ``i`` tokens and the one at ``query``, aligned on the right in
        ``width`` positions (padding before them), ``[B * len(prefixes), width, ...]`` batch-major, as
        ``check_inputs`` returns them."""
        self._missing("prefix_inputs")

    def prompted(self, model: nn.Module, prompt: Any, keys: tuple[str, ...]) -> Callable[[Any], list]:
        """The with-prompt pass of calibration queries (``tp.thought_patch``): a function of query inputs
        ``[b, T_q, ...]`` giving, per layer, the ``LayerRecord`` (its fields ``keys``) of every query position
        read after ``prompt [1, P, ...]``, each ``[b, T_q, .]``. The prompt's work is done once, here."""
        self._missing("prompted")

    def layer_calls(self, model: nn.Module, inputs: Any) -> tuple[Tensor, list[tuple[tuple, dict]]]:
        """The first layer's input ``h^0 [b, T, d]`` for ``inputs`` and, per layer, the other arguments the
        model's forward passes it ``(args, kwargs)``: ``layers(model)[i](h, *args, **kwargs)`` runs layer
        ``i`` alone as the forward would (``tp.thought_patch``'s no-prompt pass, a layer at a time)."""
        self._missing("layer_calls")

    # ------------------------------------------------------------------------- the module map
    def layers(self, model: nn.Module) -> Sequence[nn.Module]:
        """The ``n_layers`` layer modules in order; module ``i``'s input is ``h^i`` ``[B, T, d]`` and its
        output (or the first element of it) the residual stream after layer ``i``."""
        self._missing("layers")

    def n_heads(self, model: nn.Module) -> int:
        """Attention heads per layer ``H`` (query heads)."""
        self._missing("n_heads")

    def output_projections(self, model: nn.Module) -> list[nn.Module]:
        """Per layer, the attention's output projection: its input is the heads' outputs side by side
        ``z = [z_1 .. z_H]`` ``[B, T, H * dh]`` (head ``h``'s slice ``z_h``), its output ``W_O z (+ b)``."""
        self._missing("output_projections")

    def attention_outputs(self, model: nn.Module) -> list[nn.Module]:
        """Per layer, the module whose output ``[B, T, d]`` is the attention's contribution to the
        residual stream (after a norm that follows the output projection)."""
        self._missing("attention_outputs")

    def mlp_outputs(self, model: nn.Module) -> list[nn.Module]:
        """Per layer, the module whose output ``[B, T, d]`` is the MLP's contribution to the residual
        stream (after a norm that follows it: Gemma 2/3's post-MLP norm)."""
        self._missing("mlp_outputs")

    def attention_norms(self, model: nn.Module) -> list[nn.Module | None]:
        """Per layer, the norm between the output projection and the residual stream (Gemma 2/3's
        post-attention norm), or ``None`` where the projection's output is added as it is."""
        self._missing("attention_norms")

    def mlp_input_from_heads(self, model: nn.Module, i: int, h: Tensor) -> Callable[[Tensor], Tensor]:
        """``F``: layer ``i``'s MLP input ``s [..., d]`` as a function of the output projection's input
        ``z [..., H * dh]``, with the layer input fixed at ``h [N, d]`` (one row per query), in float64
        on copies of the weights whatever the model's dtype (``interp.head_patches`` takes its
        Jacobian; ``tokenpatch.arch.float64``)."""
        self._missing("mlp_input_from_heads")

    def attention_patterns(self, model: nn.Module, inputs: Any) -> list[Tensor]:
        """Every layer's attention probabilities ``[B, H, T, T]`` on ``inputs`` (one per query head)."""
        self._missing("attention_patterns")
