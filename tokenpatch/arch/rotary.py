"""Rotary scaling that changes with the sequence length, read from a Hugging Face config.

Most rotary embeddings rotate position ``p`` by the same angles whatever the sequence. Two of
``transformers``' scalings (``config.rope_parameters``, formerly ``rope_scaling``) do not: each
forward picks its frequencies from ``n = max(position_ids) + 1`` over the whole batch,

* ``rope_type = "longrope"`` (Phi-3-128k): ``short_factor`` while ``n <= original_max_position_embeddings``,
  ``long_factor`` beyond, for every position of that forward;
* ``rope_type = "dynamic"`` (NTK): the base ``theta`` for ``n <= max_position_embeddings``, and
  ``theta * (factor n / M - factor + 1) ** (d / (d - 2))`` beyond (``M = max_position_embeddings``).
  ``transformers`` keeps these frequencies after the forward: a later forward of ``M <= n' < n``
  still uses ``n``'s, until a forward shorter than ``M`` restores the base (``forget_longest``).

So two forwards rotate a position alike exactly when their lengths have the same ``regime``: a key
rotated in one and read in the other is exact only then. ``length_scaling(config)`` finds such a
scaling (``None`` if there is none), the only place tokenpatch reads these config fields.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Scaling", "LengthScaling", "length_scaling", "forget_longest"]


@dataclass(frozen=True)
class Scaling:
    """One length-dependent rotary scaling: ``kind`` (``"longrope"`` or ``"dynamic"``), the length
    where it starts to change (``threshold``) and the config field that says so (``field``)."""

    kind: str
    threshold: int
    field: str

    def regime(self, length: int) -> Hashable:
        """Equal for two forward lengths (``max(position_ids) + 1``) exactly when they rotate every
        position alike and, for ``"dynamic"``, when a forward of each, in increasing order after a
        shorter one, computes the frequencies of a fresh model: every length from the threshold on
        is its own, the shorter ones share the base rotation (and restore it)."""
        if self.kind == "longrope":
            return length > self.threshold
        return length if length >= self.threshold else 0


@dataclass(frozen=True)
class LengthScaling:
    """The length-dependent scalings of a model (one, or one per attention type)."""

    parts: tuple[Scaling, ...]

    def regime(self, length: int) -> Hashable:
        """The rotation a forward of ``length`` positions uses (``Scaling.regime`` of each part)."""
        return tuple(p.regime(length) for p in self.parts)

    @property
    def stateful(self) -> bool:
        """Whether ``transformers`` keeps a forward's frequencies for the next one (``"dynamic"``)."""
        return any(p.kind == "dynamic" for p in self.parts)

    def describe(self) -> str:
        """``rope_parameters['rope_type'] = 'longrope' (...)``: for one-line errors."""
        return "; ".join(
            f"{p.field} = {p.kind!r} (its rotation changes past {p.threshold} positions)" for p in self.parts
        )


def _one(config: Any, params: Mapping, field: str) -> Scaling | None:
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind == "longrope":
        threshold = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        return Scaling("longrope", int(threshold or config.max_position_embeddings), field)
    if "dynamic" in kind:  # transformers' test: any rope type naming it updates its frequencies per forward
        return Scaling("dynamic", int(config.max_position_embeddings), field)
    return None


def length_scaling(config: Any) -> LengthScaling | None:
    """The rotary scaling of ``config`` that depends on the sequence length, or ``None``. Reads
    ``rope_parameters`` (``transformers`` 5; one dict, or one per attention type) or ``rope_scaling``."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, Mapping) or not params:
            continue
        if all(isinstance(v, Mapping) for v in params.values()):  # per attention type (Gemma 3's layer types)
            found = [_one(config, v, f"{name}[{k!r}]['rope_type']") for k, v in params.items()]
            parts = tuple(f for f in found if f is not None)
            return LengthScaling(parts) if parts else None
        one = _one(config, params, f"{name}['rope_type']")
        return None if one is None else LengthScaling((one,))
    return None


@torch.no_grad()
def forget_longest(model: nn.Module, scaling: LengthScaling | None, device: torch.device) -> None:
    """Restore a ``"dynamic"`` rotation to a fresh model's (the base frequencies, growing again from
    there) by the way ``transformers`` itself does: one forward of one token, shorter than
    ``max_position_embeddings``, its token on ``device`` (where the input ids go). Nothing for other
    scalings (they keep no state)."""
    if scaling is None or not scaling.stateful:
        return
    model.base_model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
