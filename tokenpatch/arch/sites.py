"""Where a layer's patch goes, as data: ``Sites`` (the parameters reading the MLP input, the output
side's ``OutputSite``) and how a module applies its weight (``weight_layout``). ``Adapter.sites``
returns a ``Sites`` per layer; ``tokenpatch.arch.base`` re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenpatch.arch.layouts import WEIGHT_LAYOUTS, by_class, weight_layout
from tokenpatch.errors import UnsupportedModelError

__all__ = ["OutputSite", "OUTPUT_KINDS", "Sites", "WEIGHT_LAYOUTS", "by_class", "weight_layout"]

OUTPUT_KINDS = ("bias", "matrix", "matrix+scale", "gated", "experts")


@dataclass(frozen=True)
class OutputSite:
    """How a layer's patch absorbs the output side, ``m_C - m_0`` (``Sites.output``).

    * ``"bias"``: add ``m_C - m_0`` to the MLP output bias ``name``;
    * ``"matrix"``: the rank-1 ``(m_C - m_0) h_C^T / |h_C|^2`` on the output weight ``name``;
    * ``"matrix+scale"``: a rank-1 patch of the output matrix ``name`` plus a dense delta of the scale
      ``norm`` of the post-MLP norm (Gemma 2/3, ``solve.output_patch_scaled``);
    * ``"gated"``: a rank-1 patch of the output matrix ``name`` whose output is scaled by a sigmoid gate
      (a shared expert), the shift divided by the gate;
    * ``"experts"``: the stacked output matrices ``name`` ``[E, out, in]`` of a mixture of experts, read
      as the one matrix ``[D_1 ... D_E]`` on the chosen experts' weighted hidden states
      (``arch.experts``): the rank-1 ``(m_C - m_0) z_C^T / |z_C|^2``, split over the chosen experts.

    ``scale``: a constant the block multiplies the MLP output by before the residual add (Granite's
    ``residual_multiplier``); the shift each kind absorbs is ``(m_C - m_0) / scale``.

    ``names``: the parameters it writes. Indexing (``site[0]``, ``site[1:]``) reads it as the tuple
    ``(kind, name)`` or ``(kind, name, norm)`` of earlier versions; read the fields instead.
    """

    kind: Literal["bias", "matrix", "matrix+scale", "gated", "experts"]
    name: str
    norm: str | None = None
    scale: float = 1.0

    def __post_init__(self):
        if self.kind not in OUTPUT_KINDS:
            raise UnsupportedModelError(f"OutputSite kind {self.kind!r} is not one of {OUTPUT_KINDS}")
        if (self.norm is not None) != (self.kind == "matrix+scale"):
            raise UnsupportedModelError(
                f"OutputSite({self.kind!r}, {self.name!r}): a norm is given exactly with kind 'matrix+scale'"
            )
        if self.kind == "matrix+scale" and self.scale != 1.0:
            raise UnsupportedModelError(f"OutputSite({self.kind!r}, {self.name!r}): a norm after the MLP with a scale")

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names the output side writes: ``(name,)`` or ``(name, norm)``."""
        return (self.name,) if self.norm is None else (self.name, self.norm)

    def __getitem__(self, index):
        return (self.kind, *self.names)[index]

    def __len__(self) -> int:
        return 1 + len(self.names)


@dataclass(frozen=True)
class Sites:
    """Parameter names a layer's patch writes to.

    ``inputs``: weight matrices that read the MLP input ``s`` (each gets ``W (s_C - s_0) s_0^T/|s_0|^2``).
    ``output``: an ``OutputSite`` (a tuple ``(kind, name[, norm])`` is converted), or ``None`` -- no
    residual term. A parallel (NeoX) block has no input sites: its MLP input is the same in both passes.

    ``input_site``: a module whose input is ``s`` (the MLP). Then the input side is one delta
    ``"<input_site>:input"``, the change of that input ``s -> s + (s_C - s_0) (s_0 . s) / |s_0|^2``,
    which equals the rank-1 patch ``W (s_C - s_0) s_0^T / |s_0|^2`` of every matrix in ``inputs``
    (``W (I + D) = W + W D``) without forming ``W (s_C - s_0)``: it costs O(d) per query, and it
    covers matrices that are not ``nn.Linear`` modules (a router, experts stored as one 3-D tensor).

    ``sum_norm``: a norm (module name) the layer applies to the residual stream after the MLP's add
    (OPT-350m): its output is ``N(m + MLP(s))``, not the sum itself. A token patch is exact without
    it (the output side makes the sum the with-context one); a thought patch fits that sum.
    """

    inputs: tuple[str, ...]
    output: OutputSite | None
    input_site: str | None = None
    sum_norm: str | None = None

    def __post_init__(self):
        if isinstance(self.output, tuple):
            object.__setattr__(self, "output", OutputSite(*self.output))
        elif self.output is not None and not isinstance(self.output, OutputSite):
            raise UnsupportedModelError(f"Sites.output must be an OutputSite or None, got {type(self.output).__name__}")
