"""Streamed ridge least squares in float64, for the thought-patch fits (``icl.py``, ``hf.py``).

A problem ``A x_j ~ y_j`` keeps only its sums ``sum x x^T``, ``sum y x^T``, the scalar ``sum |y|^2`` and the count
(``Sums``), so memory does not depend on the number of samples, and sums from several processes
add up (``accumulate(..., distributed=True)``: one all-reduce). ``solve`` returns the ridge
solution by Cholesky, or, for a rank-deficient or ill-conditioned system, the minimum-norm one
from an eigendecomposition with a ``ThoughtWarning`` naming the condition number; never NaN.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from tokenpatch.errors import InputError, user_stacklevel
from tokenpatch.lowrank import LowRank

__all__ = ["ThoughtWarning", "COND_WARN"]

COND_WARN = 1e10  # condition numbers above this warn and take the eigendecomposition path


class ThoughtWarning(UserWarning):
    """A calibration system was rank-deficient or ill-conditioned."""


class Sums:
    """Streaming sums of a least-squares problem ``A x_j ~ y_j``: ``xx = sum x x^T``, ``yx = sum y x^T``,
    ``yy = sum |y|^2`` (a scalar: only the residual needs it), ``n``, in float64."""

    def __init__(self, p: int, q: int, device):
        kw = dict(dtype=torch.float64, device=device)
        self.xx, self.yx, self.yy, self.n = torch.zeros(p, p, **kw), torch.zeros(q, p, **kw), torch.zeros(1, **kw), 0

    def add(self, x: Tensor, y: Tensor) -> None:
        """``x [N, p]``, ``y [N, q]``."""
        x, y = x.double(), y.double()
        self.xx.addmm_(x.T, x)  # in place: no [p, p] temporary per batch
        self.yx.addmm_(y.T, x)
        self.yy += (y * y).sum()
        self.n += x.shape[0]


class QR:
    """Streaming triangular factor of the data (TSQR): ``[X | Y] = Q R`` with ``R`` upper triangular,
    ``[p + q, p + q]``, updated per batch by the QR of ``[R; [x | y]]``. Its solve works on ``R_xx``,
    whose condition number is the square root of that of ``X^T X``: rounding is amplified that much
    less, and the training residual is exact (``|R_xx A^T - R_xy|^2 + |R_yy|^2``). About 3x the work of
    the sums per batch; in float64."""

    def __init__(self, p: int, q: int, device):
        self.p, self.q, self.n = p, q, 0
        self.r = torch.zeros(0, p + q, dtype=torch.float64, device=device)

    def add(self, x: Tensor, y: Tensor) -> None:
        """``x [N, p]``, ``y [N, q]``."""
        z = torch.cat([x.double(), y.double()], 1)  # [N, p + q]
        self.r = torch.linalg.qr(torch.cat([self.r, z]), mode="r").R  # [<= p + q, p + q]
        self.n += x.shape[0]

    def blocks(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(R_xx [p, p], R_xy [p, q], R_yy [q, q])``."""
        r, k = self.r, self.p + self.q
        if r.shape[0] < k:  # fewer samples than columns so far
            r = torch.cat([r, r.new_zeros(k - r.shape[0], k)])
        return r[: self.p, : self.p], r[: self.p, self.p :], r[self.p :, self.p :]


def _warn(where: str, rank: int, p: int, cond: float) -> None:
    what = (
        f"rank-deficient (the calibration positions span {rank} of {p} dimensions"
        if rank < p
        else f"ill-conditioned (rank {p} of {p}"
    ) + f", condition number {cond:.2e})"
    warnings.warn(
        f"thought_patch: {where}: the least-squares system is {what}; taking the minimum-norm solution "
        "(ridge > 0 regularises it; more calibration inputs help if they add directions)",
        ThoughtWarning,
        stacklevel=user_stacklevel(),
    )


def _solve_qr(acc: QR, lam: float, free_last: bool, where: str) -> tuple[Tensor, int, float]:
    """``min |R_xx A^T - R_xy|^2 + n lam |P^(1/2) A^T|^2`` by SVD of ``[R_xx; sqrt(n lam) P^(1/2)]``: the
    same problem as ``solve``, minimum-norm where rank-deficient. The condition number reported is
    that of the normal equations (the square of the SVD's), as ``solve`` reports it."""
    r_xx, r_xy, _ = acc.blocks()
    p = acc.p
    pen = torch.ones(p, dtype=torch.float64, device=r_xx.device)
    if free_last:
        pen[-1] = 0
    m, b = r_xx, r_xy  # [p, p], [p, q]
    if lam > 0:
        m = torch.cat([m, (acc.n * lam) ** 0.5 * torch.diag(pen.sqrt())])  # [2p, p]
        b = torch.cat([b, torch.zeros_like(b)])
    u, s, vh = torch.linalg.svd(m, full_matrices=False)  # s descending
    top = float(s[0])
    if top == 0:
        return r_xy.new_zeros(acc.q, p), 0, float("inf")
    cutoff = top * max(acc.n, p) * torch.finfo(torch.float64).eps
    rank = int((s > cutoff).sum())
    cond = (top / float(s[-1])) ** 2 if float(s[-1]) > cutoff else float("inf")
    if rank < p or cond > COND_WARN:
        _warn(where, rank, p, cond)
    inv = torch.where(s > cutoff, 1 / s.clamp_min(cutoff), torch.zeros_like(s))  # [p]
    return ((vh.T * inv) @ (u.T @ b)).T, rank, cond  # [q, p]


def solve(sums: Sums | QR, lam: float, free_last: bool, where: str) -> tuple[Tensor, int, float]:
    """``A = (yx/n) (xx/n + lam P)^-1`` (``P = I``, its last diagonal entry 0 with ``free_last``):
    Cholesky when well conditioned, else the minimum-norm solution from ``eigh`` with a warning.
    Returns ``(A [q, p], rank, condition number)``. A ``QR`` accumulator solves by ``_solve_qr``."""
    if isinstance(sums, QR):
        return _solve_qr(sums, lam, free_last, where)
    p = sums.xx.shape[0]
    pen = torch.ones(p, dtype=torch.float64, device=sums.xx.device)
    if free_last:
        pen[-1] = 0
    m = sums.xx / sums.n + lam * torch.diag(pen)  # [p, p]
    b = sums.yx / sums.n  # [q, p]
    e = torch.linalg.eigvalsh(m)  # ascending; the eigenvectors only where the minimum-norm solution needs them
    top = float(e[-1].clamp_min(0))
    cutoff = top * p * torch.finfo(torch.float64).eps
    rank = int((e > cutoff).sum())
    cond = top / float(e[0]) if float(e[0]) > cutoff else float("inf")
    if top == 0:
        return torch.zeros_like(b), 0, float("inf")
    if cond <= COND_WARN:
        chol, info = torch.linalg.cholesky_ex(m)
        if int(info) == 0:
            return torch.cholesky_solve(b.T, chol).T, rank, cond
    _warn(where, rank, p, cond)
    e, vecs = torch.linalg.eigh(m)
    inv = torch.where(e > cutoff, 1 / e.clamp_min(cutoff or 1.0), torch.zeros_like(e))  # [p]
    return (b @ vecs) * inv @ vecs.T, rank, cond


def residual(sums: Sums | QR, a: Tensor) -> float:
    """``|A X - Y|_F / |Y|_F``: from the sums ``tr(A xx A^T) - 2 tr(A yx^T) + sum |y|^2`` (cancels: see
    ``LayerFit``), or exactly from a ``QR`` factor."""
    if isinstance(sums, QR):
        r_xx, r_xy, r_yy = sums.blocks()
        num = (r_xx @ a.T - r_xy).square().sum() + r_yy.square().sum()
        den = r_xy.square().sum() + r_yy.square().sum()
        return float(num.sqrt() / den.sqrt()) if float(den) > 0 else 0.0
    num = (a @ sums.xx * a).sum() - 2 * (a * sums.yx).sum() + sums.yy[0]
    den = sums.yy[0]
    return float(num.clamp_min(0).sqrt() / den.sqrt()) if float(den) > 0 else 0.0


def factor(dense: Tensor) -> LowRank:
    """``[rows, cols]`` -> ``LowRank`` lead ``[1, 1]`` in SVD order, exact zero directions dropped."""
    u, s, vh = torch.linalg.svd(dense, full_matrices=False)
    keep = max(1, int((s > s[0] * max(dense.shape) * torch.finfo(dense.dtype).eps).sum())) if s.numel() else 1
    return LowRank((u[:, :keep] * s[:keep]).T[None, None], vh[:keep][None, None])


def accumulate(pairs, distributed: bool = False, solver: str = "normal") -> Sums | QR:
    """The sums (``solver="normal"``) or the triangular factor (``"qr"``) of every ``(x [N, p], y [N, q])``
    pair; with ``distributed``, of every process's pairs."""
    acc = None
    for x, y in pairs:
        acc = acc or (QR if solver == "qr" else Sums)(x.shape[1], y.shape[1], x.device)
        acc.add(x, y)
    if acc is None:
        raise InputError("calibration holds no batches")
    if distributed and isinstance(acc, QR):  # stack every process's R, factor again
        n = torch.tensor([float(acc.n)], dtype=torch.float64, device=acc.r.device)
        torch.distributed.all_reduce(n)
        r = torch.cat(acc.blocks()[:2], 1)  # [p, p + q]: the rows of R that carry x, then R_yy's rows
        full = torch.cat([r, torch.cat([acc.r.new_zeros(acc.q, acc.p), acc.blocks()[2]], 1)])  # [p + q, p + q]
        parts = [torch.empty_like(full) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(parts, full)
        acc.r, acc.n = torch.linalg.qr(torch.cat(parts), mode="r").R, int(n.item())
    elif distributed:  # one all-reduce of the packed sums: the fit of all shards together
        packed = torch.cat(
            [
                acc.xx.flatten(),
                acc.yx.flatten(),
                acc.yy.flatten(),
                torch.tensor([float(acc.n)], dtype=torch.float64, device=acc.xx.device),
            ]
        )
        torch.distributed.all_reduce(packed)
        sizes = [acc.xx.numel(), acc.yx.numel(), acc.yy.numel()]
        xx, yx, yy, n = packed.split([*sizes, 1])
        acc.xx, acc.yx, acc.yy, acc.n = xx.view_as(acc.xx), yx.view_as(acc.yx), yy.view_as(acc.yy), int(n.item())
    return acc
