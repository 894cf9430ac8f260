"""Streamed ridge least squares in float64, for the thought-patch fits (``thought.py``).

A problem ``A x_j ~ y_j`` keeps only its sums ``sum x x^T``, ``sum y x^T``, ``sum y y^T`` and the count
(``_Sums``), so memory does not depend on the number of samples, and sums from several processes
add up (``_accumulate(..., distributed=True)``: one all-reduce). ``_solve`` returns the ridge
solution by Cholesky, or, for a rank-deficient or ill-conditioned system, the minimum-norm one
from an eigendecomposition with a ``ThoughtWarning`` naming the condition number; never NaN.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from .errors import InputError
from .lowrank import LowRank

__all__ = ["ThoughtWarning", "COND_WARN"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
COND_WARN = 1e10  # condition numbers above this warn and take the eigendecomposition path


class ThoughtWarning(UserWarning):
    """A calibration system was rank-deficient or ill-conditioned."""


class _Sums:
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


def _solve(sums: _Sums, lam: float, free_last: bool, where: str) -> tuple[Tensor, int, float]:
    """``A = (yx/n) (xx/n + lam P)^-1`` (``P = I``, its last diagonal entry 0 with ``free_last``):
    Cholesky when well conditioned, else the minimum-norm solution from ``eigh`` with a warning.
    Returns ``(A [q, p], rank, condition number)``."""
    p = sums.xx.shape[0]
    pen = torch.ones(p, dtype=torch.float64, device=sums.xx.device)
    if free_last:
        pen[-1] = 0
    m = sums.xx / sums.n + lam * torch.diag(pen)  # [p, p]
    b = sums.yx / sums.n  # [q, p]
    e, vecs = torch.linalg.eigh(m)  # ascending
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
    what = (f"rank-deficient (the calibration positions span {rank} of {p} dimensions" if rank < p
            else f"ill-conditioned (rank {p} of {p}") + f", condition number {cond:.2e})"
    warnings.warn(f"thought_patch: {where}: the least-squares system is {what}; taking the minimum-norm solution "
                  "(ridge > 0 regularises it; more calibration queries help if they add directions)", ThoughtWarning,
                  stacklevel=_caller())
    inv = torch.where(e > cutoff, 1 / e.clamp_min(cutoff or 1.0), torch.zeros_like(e))  # [p]
    return (b @ vecs) * inv @ vecs.T, rank, cond


def _caller() -> int:
    """The ``stacklevel`` of the first frame outside tokenpatch and torch: warnings point at the user's call."""
    import inspect

    level, frame = 1, inspect.currentframe().f_back
    while frame is not None and any(part in frame.f_code.co_filename for part in (_PACKAGE, f"{os.sep}torch{os.sep}")):
        level, frame = level + 1, frame.f_back
    return level


def _residual(sums: _Sums, a: Tensor) -> float:
    """``|A X - Y|_F / |Y|_F`` from the sums: ``tr(A xx A^T) - 2 tr(A yx^T) + sum |y|^2`` (cancels: see ``LayerFit``)."""
    num = (a @ sums.xx * a).sum() - 2 * (a * sums.yx).sum() + sums.yy[0]
    den = sums.yy[0]
    return float(num.clamp_min(0).sqrt() / den.sqrt()) if float(den) > 0 else 0.0


def _factor(dense: Tensor) -> LowRank:
    """``[rows, cols]`` -> ``LowRank`` lead ``[1, 1]`` in SVD order, exact zero directions dropped."""
    u, s, vh = torch.linalg.svd(dense, full_matrices=False)
    keep = max(1, int((s > s[0] * max(dense.shape) * torch.finfo(dense.dtype).eps).sum())) if s.numel() else 1
    return LowRank((u[:, :keep] * s[:keep]).T[None, None], vh[:keep][None, None])


def _accumulate(pairs, distributed: bool = False) -> _Sums:
    """The sums over every ``(x [N, p], y [N, q])`` pair; with ``distributed``, over every process's pairs."""
    acc = None
    for x, y in pairs:
        acc = acc or _Sums(x.shape[1], y.shape[1], x.device)
        acc.add(x, y)
    if acc is None:
        raise InputError("queries hold no calibration batches")
    if distributed:  # one all-reduce of the packed sums: the fit of all shards together
        packed = torch.cat([acc.xx.flatten(), acc.yx.flatten(), acc.yy.flatten(),
                            torch.tensor([float(acc.n)], dtype=torch.float64, device=acc.xx.device)])
        torch.distributed.all_reduce(packed)
        sizes = [acc.xx.numel(), acc.yx.numel(), acc.yy.numel()]
        xx, yx, yy, n = packed.split([*sizes, 1])
        acc.xx, acc.yx, acc.yy, acc.n = xx.view_as(acc.xx), yx.view_as(acc.yx), yy.view_as(acc.yy), int(n.item())
    return acc
