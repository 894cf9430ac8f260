"""``LowRank``: a batch of matrices ``delta = sum_k u_k v_k^T`` kept as factors.

``u [*lead, rank, rows]``, ``v [*lead, rank, cols]`` and ``delta[i] = sum_k outer(u[i, k], v[i, k])``
in the parameter's own layout (rows x cols as stored: ``[out, in]`` for ``nn.Linear``). A token
patch has rank 1; a sum of k patches has rank k and is stored as stacked factors. The matrix is
formed only by ``.dense()``; norms and products come from the factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tokenpatch.errors import InputError

__all__ = ["LowRank"]


@dataclass(frozen=True)
class LowRank:
    """``delta = sum_k outer(u[..., k, :], v[..., k, :])`` with ``u [*lead, r, rows]``, ``v [*lead, r, cols]``."""

    u: Tensor
    v: Tensor

    def __post_init__(self) -> None:
        u, v = self.u, self.v
        if u.ndim < 2 or v.ndim != u.ndim or u.shape[:-1] != v.shape[:-1]:
            raise InputError(
                f"LowRank factors must be [*lead, rank, rows] and [*lead, rank, cols], "
                f"got {tuple(u.shape)} and {tuple(v.shape)}"
            )
        if u.dtype != v.dtype or u.device != v.device:
            raise InputError(f"LowRank factors differ in dtype/device: {u.dtype}/{u.device} vs {v.dtype}/{v.device}")

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.u.shape[:-2])

    @property
    def rank(self) -> int:
        """Number of stored rank-1 terms (an upper bound of the true rank)."""
        return self.u.shape[-2]

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the matrix this delta adds to."""
        return (self.u.shape[-1], self.v.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.u.dtype

    def dense(self) -> Tensor:
        """The materialised delta ``[*lead, rows, cols]``."""
        return torch.einsum("...kr,...kc->...rc", self.u, self.v)

    def inner(self, other: LowRank) -> Tensor:
        """Frobenius inner product ``[*lead]`` from the factors:
        ``<U^T V, X^T Y>_F = sum((U X^T) * (V Y^T))`` (``U [r, rows]``, ``X [r', rows]``, ...)."""
        return ((self.u @ other.u.transpose(-1, -2)) * (self.v @ other.v.transpose(-1, -2))).sum((-1, -2))

    def norm(self) -> Tensor:
        """Frobenius norm ``[*lead]`` from the factors: ``sqrt(<delta, delta>_F)``."""
        return self.inner(self).clamp_min(0).sqrt()

    def matvec(self, x: Tensor) -> Tensor:
        """``delta @ x`` for ``x [*lead, cols]`` -> ``[*lead, rows]`` without forming ``delta``."""
        return ((self.v @ x[..., None]) * self.u).sum(-2)  # [*lead, r, 1] * [*lead, r, rows]

    def index(self, idx) -> LowRank:
        return LowRank(self.u[idx], self.v[idx])

    def to(self, *args, **kwargs) -> LowRank:
        return LowRank(self.u.to(*args, **kwargs), self.v.to(*args, **kwargs))

    def __add__(self, other: LowRank) -> LowRank:
        """Sum of deltas: the rank terms are stacked (rank adds up)."""
        if not isinstance(other, LowRank):
            return NotImplemented
        if self.shape != other.shape:
            raise InputError(f"cannot add LowRank deltas of shapes {self.shape} and {other.shape}")
        lead = torch.broadcast_shapes(self.lead, other.lead)
        expand = lambda t: t.expand(*lead, *t.shape[-2:])  # noqa: E731
        return LowRank(
            torch.cat([expand(self.u), expand(other.u)], -2), torch.cat([expand(self.v), expand(other.v)], -2)
        )

    def sum(self, dim: int) -> LowRank:
        """Sum over leading dim ``dim`` (kept with size 1): its terms join the rank dim."""
        dim = dim % len(self.lead)
        fold = lambda t: t.movedim(dim, -3).flatten(-3, -2).unsqueeze(dim)  # noqa: E731
        return LowRank(fold(self.u), fold(self.v))
