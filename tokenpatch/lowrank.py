"""``LowRank``: a batch of matrices ``delta = sum_k u_k v_k^T`` kept as factors.

``u [*lead, rank, rows]``, ``v [*lead, rank, cols]`` and ``delta[i] = sum_k outer(u[i, k], v[i, k])``
in the parameter's own layout (rows x cols as stored: ``[out, in]`` for ``nn.Linear``). A token
patch has rank 1; a sum of k patches has rank k and is stored as stacked factors. The matrix is
formed only by ``.dense()``; norms and products come from the factors, rescaled by powers of two
first (``LowRank.scaled``): a tiny anchor gives a huge ``v`` whose square overflows (``|v|^2`` past
3e38 in float32) while every entry of ``u v^T`` is finite, and the norm must be too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tokenpatch.errors import InputError

__all__ = ["LowRank", "norm_of", "check_finite", "matrix_shape", "as_parameter"]


def matrix_shape(shape: tuple[int, ...], layout: str = "out_in") -> tuple[int, ...]:
    """The matrix a parameter of ``shape`` is patched as: itself, or for stacked matrices (a mixture of
    experts' output matrices, ``arch.experts``) the one matrix ``[out, E * in] = [D_1 ... D_E]``, stored
    as the parameter is: ``[out, E * in]`` for ``[E, out, in]`` (``layout`` ``"out_in"``), its transpose
    ``[E * in, out]`` (the rows of every expert's matrix) for ``[E, in, out]`` (``"in_out"``)."""
    if len(shape) != 3:
        return tuple(shape)
    return (shape[1], shape[0] * shape[2]) if layout == "out_in" else (shape[0] * shape[1], shape[2])


def as_parameter(dense: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A patched matrix ``[*lead, *matrix_shape(shape, layout)]`` laid out as its parameter ``[*lead, *shape]``.
    The two layouts of stacked matrices are told apart by the patched matrix's shape (with more than one
    expert ``[out, E * in]`` and ``[E * out, in]`` never agree; with one, both give the same parameter)."""
    if len(shape) != 3:
        return dense
    n_experts, rows, cols = shape
    if tuple(dense.shape[-2:]) == (n_experts * rows, cols):  # [E, in, out] stored as its rows
        return dense.unflatten(-2, (n_experts, rows))  # [*lead, E * in, out] -> [*lead, E, in, out]
    return dense.unflatten(-1, (n_experts, cols)).movedim(-2, -3)  # [*lead, out, E, in] -> [*lead, E, out, in]


def _exponent(t: Tensor) -> Tensor:
    """The power of two ``e`` with ``t / 2^e`` in ``[0.5, 1)`` (``t > 0``), as int32."""
    return torch.frexp(t.detach())[1]


def _times_pow2(x: Tensor, e: Tensor) -> Tensor:
    """``x * 2^e`` exactly, in two halves (``2^e`` alone may overflow the dtype where the product does not)."""
    half = torch.div(e, 2, rounding_mode="floor")
    return torch.ldexp(torch.ldexp(x, half.to(x.dtype)), (e - half).to(x.dtype))


def norm_of(delta: LowRank | Tensor) -> Tensor:
    """The Frobenius (or Euclidean) norm ``[batch, query]`` of a patch delta: ``LowRank.norm``, or a
    dense ``[batch, query, ...]`` tensor's, divided by a power of two near its largest entry first."""
    if isinstance(delta, LowRank):
        return delta.norm()
    flat = delta.flatten(2)
    top = flat.abs().amax(-1, keepdim=True)
    e = _exponent(torch.where((top > 0) & torch.isfinite(top), top, 1))
    return _times_pow2(_times_pow2(flat, -e).norm(dim=-1), e[..., 0])


def check_finite(deltas: dict[str, LowRank | Tensor]) -> None:
    """Raise ``InputError`` naming the first of ``deltas`` that holds NaN or inf (one device sync)."""
    parts = [(n, t) for n, d in deltas.items() for t in ((d.u, d.v) if isinstance(d, LowRank) else (d,))]
    where = parts[0][1].device
    if bool(torch.stack([torch.isfinite(t).all().to(where) for _, t in parts]).all()):
        return
    name = next(n for n, t in parts if not bool(torch.isfinite(t).all()))
    raise InputError(
        f"the patch's delta for {name} holds NaN or inf; a patch must be finite (an anchor too small for "
        "the dtype overflows: compute the patch in float64, model.double())"
    )


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

    def scaled(self) -> tuple[LowRank, Tensor]:
        """``(delta', c)`` with ``delta = c * delta'`` (``c [*lead]``), exactly: each term's factors
        balanced (``u_k 2^e, v_k 2^-e`` with about equal largest entries), then both factors divided by
        their largest entry, all by powers of two; the factors of ``delta'`` lie in ``[-1, 1]``."""
        u, v = self.u, self.v
        mu, mv = u.abs().amax(-1, keepdim=True), v.abs().amax(-1, keepdim=True)  # [*lead, r, 1]
        ok = (mu > 0) & (mv > 0) & torch.isfinite(mu) & torch.isfinite(mv)
        eu, ev = _exponent(torch.where(ok, mu, 1)), _exponent(torch.where(ok, mv, 1))
        shift = torch.div(ev - eu, 2, rounding_mode="floor")
        u, v = _times_pow2(u, shift), _times_pow2(v, -shift)
        cu = _exponent(u.abs().amax((-1, -2), keepdim=True).clamp_min(torch.finfo(u.dtype).tiny))
        cv = _exponent(v.abs().amax((-1, -2), keepdim=True).clamp_min(torch.finfo(v.dtype).tiny))
        one = torch.ones((), dtype=u.dtype, device=u.device)
        return LowRank(_times_pow2(u, -cu), _times_pow2(v, -cv)), _times_pow2(one, cu + cv)[..., 0, 0]

    def _raw_inner(self, other: LowRank) -> Tensor:
        return ((self.u @ other.u.transpose(-1, -2)) * (self.v @ other.v.transpose(-1, -2))).sum((-1, -2))

    def inner(self, other: LowRank) -> Tensor:
        """Frobenius inner product ``[*lead]`` from the (rescaled, ``scaled``) factors:
        ``<U^T V, X^T Y>_F = sum((U X^T) * (V Y^T))`` (``U [r, rows]``, ``X [r', rows]``, ...)."""
        (a, ca), (b, cb) = self.scaled(), other.scaled()
        return a._raw_inner(b) * ca * cb

    def norm(self) -> Tensor:
        """Frobenius norm ``[*lead]`` from the rescaled factors (``scaled``), finite wherever the norm is.

        Rank 1: ``c sqrt(<delta', delta'>_F) = c |u'| |v'|``. Rank ``k > 1``: ``c |R_u R_v^T|_F`` from the
        QR factorisations ``U'^T = Q_u R_u`` (``[rows, k]``) and ``V'^T = Q_v R_v`` (``[cols, k]``): the
        ``Q``s have orthonormal columns, so ``|U'^T V'|_F = |R_u R_v^T|_F``. The Gram form
        ``sqrt(sum((U U^T) * (V V^T)))`` loses half the digits where the terms cancel (a step
        ``dW_i - dW_{i-1}``; ``p + (-p)`` comes out near ``sqrt(eps) |p|``, not 0); this one keeps an
        absolute error of a few ulps of ``sum_k |u_k| |v_k|``."""
        d, c = self.scaled()
        if self.rank == 1:
            return d._raw_inner(d).clamp_min(0).sqrt() * c
        work = torch.promote_types(d.dtype, torch.float32)  # QR has no half-precision kernels
        ru = torch.linalg.qr(d.u.transpose(-1, -2).to(work), mode="r").R  # [*lead, min(rows, k), k]
        rv = torch.linalg.qr(d.v.transpose(-1, -2).to(work), mode="r").R  # [*lead, min(cols, k), k]
        return torch.linalg.matrix_norm(ru @ rv.transpose(-1, -2)).to(d.dtype) * c

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
