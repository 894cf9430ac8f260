"""Where a layer's patch goes, as data: ``Sites`` (the parameters reading the MLP input, the output
side's ``OutputSite``, one class per output kind in ``arch.outputs``). ``Adapter.sites`` returns a
``Sites`` per layer; ``tokenpatch.arch.base`` re-exports these names, and the weight layouts
(``arch.layouts``) that were kept here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenpatch.arch.layouts import WEIGHT_LAYOUTS, by_class, weight_layout
from tokenpatch.arch.outputs import KINDS, OUTPUT_KINDS, OutputSite
from tokenpatch.errors import UnsupportedModelError

__all__ = ["OutputSite", "OUTPUT_KINDS", "Sites", "WEIGHT_LAYOUTS", "by_class", "weight_layout"]


@dataclass(frozen=True)
class Sites:
    """Parameter names a layer's patch writes to.

    ``inputs``: weight matrices that read the MLP input ``s`` (each gets ``W (s_C - s_0) s_0^T/|s_0|^2``).
    ``output``: an ``OutputSite`` (a tuple ``(kind, name[, norm])`` of earlier versions is converted), or
    ``None`` -- no residual term. A parallel (NeoX) block has no input sites: its MLP input is the same
    in both passes.

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
            kind, *rest = self.output
            if kind not in KINDS:
                raise UnsupportedModelError(f"OutputSite kind {kind!r} is not one of {OUTPUT_KINDS}")
            object.__setattr__(self, "output", KINDS[kind](*rest))
        elif self.output is not None and not isinstance(self.output, OutputSite):
            raise UnsupportedModelError(f"Sites.output must be an OutputSite or None, got {type(self.output).__name__}")
