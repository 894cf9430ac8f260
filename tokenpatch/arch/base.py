"""The adapter interface: what the patch algorithm needs to know about a model family.

``patching.py`` reaches a model only through an ``Adapter``. The algorithm (``docs/deep-models.md``)
needs, per layer ``i``:

* ``mix(model, i, h) -> (m, s)``: run the layer up to its MLP on hidden states ``h [N, T, d]``
  (any sequence: the full context, the query alone as a length-1 sequence, or the context with a
  chunk removed), returning the MLP input ``s`` and the residual value ``m`` the MLP output is
  added to, at every position;
* ``finish(model, i, m, s) -> (hidden, out)``: the rest of the layer, returning the input of the
  MLP's output matrix and the layer output;
* ``sites(model, i) -> Sites``: *where* the patch goes, as parameter names -- the matrices that
  read ``s`` (rank-1 input patches with a shared right factor: ``fc_in``; ``gate_proj`` and
  ``up_proj`` of a gated MLP) and how the output side is absorbed (an output ``bias``, a rank-1
  patch of the output ``matrix``, or nothing for a residual-free layer).

plus the model's ends: ``embed`` (inputs -> h^0), ``run`` (the model's own forward, returning its
output and every layer's output hidden state), ``strip`` (the inputs of the no-context pass),
``check_inputs``.

An adapter with ``traced = True`` (Hugging Face models, ``hf.py``) runs both passes as the model's
own forward instead, with hooks: ``trace`` records every layer's states at the queries in one
with-context pass, ``anchors`` the no-context states; masks, positions, caches and routing stay
the model's. Its block designs are data (``families.FAMILIES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from tokenpatch.errors import UnsupportedModelError

__all__ = ["Sites", "Adapter", "WEIGHT_LAYOUTS", "weight_layout"]


@dataclass(frozen=True)
class Sites:
    """Parameter names a layer's patch writes to.

    ``inputs``: weight matrices that read the MLP input ``s`` (each gets ``W (s_C - s_0) s_0^T/|s_0|^2``).
    ``output``: ``("bias", name)`` -- add ``m_C - m_0`` to the MLP output bias; ``("matrix", name)``
    -- rank-1 ``(m_C - m_0) h_C^T / |h_C|^2`` on the output weight; ``None`` -- no residual term.

    ``("matrix+scale", down, norm)`` -- a rank-1 patch of the output matrix ``down`` plus a dense
    delta of the scale of the post-MLP ``norm`` (Gemma 2/3, ``solve.output_patch_scaled``).
    A parallel (NeoX) block has no input sites: its MLP input is the same in both passes.

    ``input_site``: a module whose input is ``s`` (the MLP). Then the input side is one delta
    ``"<input_site>:input"``, the change of that input ``s -> s + (s_C - s_0) (s_0 . s) / |s_0|^2``,
    which equals the rank-1 patch ``W (s_C - s_0) s_0^T / |s_0|^2`` of every matrix in ``inputs``
    (``W (I + D) = W + W D``) without forming ``W (s_C - s_0)``: it costs O(d) per query, and it
    covers matrices that are not ``nn.Linear`` modules (a router, experts stored as one 3-D tensor).
    """

    inputs: tuple[str, ...]
    output: tuple[str, ...] | None
    input_site: str | None = None


# How a module applies its ``weight`` to an input: "out_in" means ``y = x @ W.T`` (W stored
# [out, in], torch's nn.Linear); "in_out" means ``y = x @ W`` (W stored [in, out], GPT-2's Conv1D).
# Keyed by class name so optional libraries need not be imported.
WEIGHT_LAYOUTS: dict[str, str] = {"Linear": "out_in", "Conv1D": "in_out",
                                  # mixture-of-experts routers: a weight [experts, d] applied with F.linear
                                  "Qwen2MoeTopKRouter": "out_in", "MixtralTopKRouter": "out_in"}


def weight_layout(module: nn.Module, name: str = "") -> str:
    """``"out_in"`` or ``"in_out"`` for ``module``'s weight, from its type (never its shape)."""
    for cls in type(module).__mro__:
        if cls.__name__ in WEIGHT_LAYOUTS:
            return WEIGHT_LAYOUTS[cls.__name__]
    raise UnsupportedModelError(
        f"cannot patch {name or 'module'} of type {type(module).__name__}: its weight layout is unknown "
        f"(known: {sorted(WEIGHT_LAYOUTS)}); add it to tokenpatch.arch.WEIGHT_LAYOUTS"
    )


class Adapter:
    """Base class; see the module docstring. Subclasses are stateless and registered in
    ``tokenpatch.arch.ADAPTERS``."""

    name: str = "base"
    # Are the two passes the model's own forward, recorded by hooks (``trace`` and ``anchors``,
    # Hugging Face models), rather than run layer by layer with ``mix`` and ``finish``?
    traced: bool = False
    # Does the embedding of a token depend on its position (absolute position embeddings)? Then
    # the first layer's anchor comes from the no-context embedding, not the with-context one.
    position_dependent_embedding: bool = True

    def matches(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def n_layers(self, model: nn.Module) -> int:
        raise NotImplementedError

    def check_inputs(self, model: nn.Module, inputs: Any) -> Any:
        """Validate (shape, dtype, finiteness) and return the inputs."""
        raise NotImplementedError

    def seq_len(self, inputs: Any) -> int:
        raise NotImplementedError

    def batch_size(self, inputs: Any) -> int:
        raise NotImplementedError

    def strip(self, inputs: Any, positions: Tensor, separate: bool) -> Any:
        """No-context inputs: the positions ``positions`` [K] of every sequence, either as one
        shorter sequence each (``separate=False``, [B, K, ...]) or each position as a sequence
        of its own (``separate=True``, [B*K, 1, ...], batch-major)."""
        raise NotImplementedError

    def embed(self, model: nn.Module, inputs: Any) -> Tensor:
        raise NotImplementedError

    def mix(self, model: nn.Module, i: int, h: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

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
        raise UnsupportedModelError(f"the {self.name} adapter cannot run virtual query rows (tp.trajectory)")

    def finish(self, model: nn.Module, i: int, m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def sites(self, model: nn.Module, i: int) -> Sites:
        raise NotImplementedError

    def run(self, model: nn.Module, inputs: Any) -> tuple[Tensor, list[Tensor]]:
        """The model's own forward: ``(output [B, T, ...], [h^1 .. h^L] each [B, T, d])``."""
        raise NotImplementedError

    def describe(self, model: nn.Module) -> dict:
        """JSON-able description stored in patch metadata."""
        return {"class": type(model).__name__, "adapter": self.name}
