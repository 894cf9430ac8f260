"""Streamed ridge least squares in float64, for the thought-patch fits (``icl.py``, ``hf.py``).

A problem ``A x_j ~ y_j`` (``n`` samples, ``p`` features, ``q`` outputs) keeps what its solve needs and
no more (``Sums``): the samples themselves while there are at most ``p / 2`` of them, then only the sums
``sum x x^T``, ``sum y x^T``, ``sum |y|^2`` and the count, so memory never exceeds ``p (p + q)`` numbers,
and sums from several processes add up (``accumulate(..., distributed=True)``: one all-reduce).

``solve`` returns the ridge solution of the per-sample mean objective

    min_A  (1/n) sum_j |A x_j - y_j|^2 + lambda |A P^(1/2)|_F^2        (P = I, or I but the intercept)

With an intercept (a last feature of ones, not penalised) the problem is centred first: ``b = ybar -
A xbar`` and ``A`` solves the same ridge on ``x - xbar``, ``y - ybar`` (the same minimiser). Then:

* **sample space** (``n <= p / 2``: the samples kept): ``K = X X^T = U E U^T`` (``n x n``) and, by the
  push-through identity ``(X^T X + n lambda I)^-1 X^T = X^T (X X^T + n lambda I)^-1``,

      A = Y^T U (E + n lambda)^-1 U^T X

  exact, and cheap where calibration positions are fewer than features;
* **feature space** (sums): Cholesky of ``X^T X / n + lambda I``; a rank-deficient or
  ill-conditioned system takes the minimum-norm solution from an eigendecomposition, with a
  ``ThoughtWarning`` naming the condition number; never NaN.

``ridge="gcv"`` chooses ``lambda`` per problem by generalised cross-validation, from the same
eigendecomposition (no dev data): with ``e_k`` the eigenvalues of the centred ``X^T X`` and ``c_k =
|Y^T X v_k|^2``,

    RSS(lambda) = |Y|^2 - sum_k c_k (e_k + 2 n lambda) / (e_k + n lambda)^2,   df = sum_k e_k / (e_k + n lambda)
    GCV(lambda) = n RSS(lambda) / (n - df - [intercept])^2

minimised over ``GCV_GRID`` (Golub, Heath and Wahba 1979).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from tokenpatch.errors import InputError, user_stacklevel
from tokenpatch.lowrank import LowRank

__all__ = ["ThoughtWarning", "COND_WARN", "GCV_GRID"]

COND_WARN = 1e10  # condition numbers above this warn and take the eigendecomposition path
GCV_GRID = tuple(10.0 ** (k / 4) for k in range(-20, 13))  # 1e-5 .. 1e3, four per decade
# The samples are kept while n <= SAMPLE_SPACE * p: beyond, the n x n eigendecomposition costs more
# than the p x p sums and their Cholesky factor (2 threads: eigh of 2000 x 2000 0.79 s; the sums of
# 2000 x 2048 samples and their Cholesky factor 0.24 s).
SAMPLE_SPACE = 0.5


class ThoughtWarning(UserWarning):
    """A calibration system was rank-deficient or ill-conditioned."""


class Solved(NamedTuple):
    """``a [q, p]`` (the intercept, if any, its last column), the system's rank and condition number
    (of the centred normal equations with their ridge), and the ``lambda`` used."""

    a: Tensor
    rank: int
    cond: float
    ridge: float
    parts: tuple[Tensor, Tensor] | None = None  # (left [q, k], right [k, p']): a's matrix columns = left @ right


class Sums:
    """What the solve needs of ``A x_j ~ y_j``, in float64: the samples ``x [n, p]``, ``y [n, q]`` while
    ``n <= SAMPLE_SPACE * p``, then ``xx = sum x x^T``, ``yx = sum y x^T``, ``yy = sum |y|^2`` (a scalar) and ``n``."""

    def __init__(self, p: int, q: int, device):
        self.p, self.q, self.n, self.device = p, q, 0, device
        self.rows: list[tuple[Tensor, Tensor]] | None = []
        self.xx: Tensor | None = None
        self.yx: Tensor | None = None
        self.yy: Tensor | None = None

    def add(self, x: Tensor, y: Tensor) -> None:
        """``x [N, p]``, ``y [N, q]``."""
        x, y = x.double(), y.double()
        self.n += x.shape[0]
        if self.rows is not None and self.n <= SAMPLE_SPACE * self.p:
            self.rows.append((x, y))
            return
        self.gram()
        self.xx.addmm_(x.T, x)  # in place: no [p, p] temporary per batch
        self.yx.addmm_(y.T, x)
        self.yy += (y * y).sum()

    def samples(self) -> tuple[Tensor, Tensor] | None:
        """``(X [n, p], Y [n, q])`` while they are kept, else None."""
        if self.rows is None:
            return None
        return torch.cat([x for x, _ in self.rows]), torch.cat([y for _, y in self.rows])

    def gram(self) -> Sums:
        """Switch to the sums (they then grow in place); returns ``self``."""
        if self.rows is not None:
            kw = dict(dtype=torch.float64, device=self.device)
            self.xx, self.yx, self.yy = (
                torch.zeros(self.p, self.p, **kw),
                torch.zeros(self.q, self.p, **kw),
                torch.zeros(1, **kw),
            )
            for x, y in self.rows:
                self.xx.addmm_(x.T, x)
                self.yx.addmm_(y.T, x)
                self.yy += (y * y).sum()
            self.rows = None
        return self


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


def _cutoff(e: Tensor, size: int) -> float:
    """Eigenvalues at or below this are rounding: ``e_max * size * eps``."""
    return float(e.max().clamp_min(0)) * size * torch.finfo(torch.float64).eps if e.numel() else 0.0


def _gcv(e: Tensor, b2: Tensor, total: Tensor, n: int, extra: int) -> float:
    """The ``lambda`` of ``GCV_GRID`` with the least ``GCV`` (module docstring): ``e [k]`` the centred
    Gram's eigenvalues above rounding, ``b2 [k]`` the squared norms of ``Y``'s projections on their
    sample-space directions (``c_k / e_k``), ``total = |Y|^2``, ``extra`` the unpenalised intercept."""
    grid = torch.tensor(GCV_GRID, dtype=torch.float64, device=e.device)[:, None] * n  # [G, 1]  n lambda
    shrink = grid / (e[None] + grid)  # [G, k]  what the ridge leaves of each direction's fit
    rss = (total - (b2[None] * (1 - shrink.square())).sum(1)).clamp_min(0)  # [G]
    left = n - (1 - shrink).sum(1) - extra  # [G]  n - degrees of freedom
    score = torch.where(left > 0, n * rss / left.clamp_min(1e-300).square(), math.inf)
    return float(GCV_GRID[int(score.argmin())])


def _condition(span: Tensor, rest: int, lam: float) -> float:
    """The condition number of normal equations whose eigenvalues are ``span`` and ``rest`` times ``lam``
    (the directions no sample reaches): 1 for an empty system, inf for a singular one."""
    values = [*span.tolist(), *([lam] * rest)]
    if not values:
        return 1.0
    return max(values) / min(values) if min(values) > 0 else math.inf


def _estimated_condition(m: Tensor, chol: Tensor, block: int = 8, steps: int = 24) -> float:
    """``lambda_max / lambda_min`` of the positive definite ``m`` (``chol`` its Cholesky factor) by block
    power iteration on ``m`` and on ``m^-1`` (a Cholesky solve per step), Rayleigh-Ritz on the block:
    ``O(p^2)`` per step where an eigendecomposition costs ``O(p^3)``. A lower bound, within a few
    percent of the exact value on the fits' spectra (``tests/test_lstsq.py``); seeded."""
    if m.shape[0] <= 4 * block:  # small: the exact spectrum costs nothing
        e = torch.linalg.eigvalsh(m)
        return float(e[-1] / e[0]) if e.numel() else 1.0
    g = torch.Generator(device=m.device).manual_seed(0)
    start = torch.randn(m.shape[0], block, generator=g, dtype=m.dtype, device=m.device)
    extremes = []
    for step in (lambda x: m @ x, lambda x: torch.cholesky_solve(x, chol)):
        x = torch.linalg.qr(start).Q
        for _ in range(steps):
            x = torch.linalg.qr(step(x)).Q
        extremes.append(float(torch.linalg.eigvalsh(x.T @ step(x))[-1]))  # the block's largest Ritz value
    return extremes[0] * extremes[1]  # lambda_max * (1 / lambda_min)


def _checked(where: str, rank: int, p: int, cond: float) -> None:
    if rank < p or cond > COND_WARN:
        _warn(where, rank, p, cond)


def _solve_samples(x: Tensor, y: Tensor, lam, free_last: bool, where: str) -> Solved:
    """The sample-space solve (module docstring) of ``x [n, p]``, ``y [n, q]``, ``n <= SAMPLE_SPACE * p``."""
    n, p = x.shape
    extra = int(free_last)
    xm, ym = (x[:, :-1].mean(0), y.mean(0)) if free_last else (None, None)
    xc, yc = (x[:, :-1] - xm, y - ym) if free_last else (x, y)  # [n, p - extra], [n, q]
    e, u = torch.linalg.eigh(xc @ xc.T)  # [n], [n, n]  ascending
    kept = e > _cutoff(e, max(n, p))
    proj = u.T @ yc  # [n, q]
    if lam == "gcv":
        lam = _gcv(e[kept], proj[kept].square().sum(1), yc.square().sum(), n, extra)
    inv = torch.where(kept, 1 / (e.clamp_min(0) + n * lam).where(kept, 1), 0)  # [n]
    left = ((u * inv) @ proj).T  # [q, n]  Y^T U (E + n lambda)^-1 U^T
    a = left @ xc  # [q, p - extra]  Y^T U (E + n lambda)^-1 U^T X
    r = int(kept.sum())
    rank = (p - extra if lam > 0 else r) + extra
    cond = _condition(e[kept] / n + lam, p - extra - r, lam)
    _checked(where, rank, p, cond)
    if free_last:
        a = torch.cat([a, (ym - a @ xm)[:, None]], 1)  # the intercept b = ybar - A xbar
    return Solved(a, rank, cond, float(lam), (left, xc))


def _solve_sums(s: Sums, lam, free_last: bool, where: str) -> Solved:
    """The feature-space solve (module docstring) from the sums."""
    p, n, extra = s.p, s.n, int(free_last)
    xx, yx, yy = s.xx, s.yx, s.yy[0]
    if free_last:  # centre: the last feature is the ones column, so its sums are those of x and y
        sx, sy = xx[:-1, -1], yx[:, -1]
        xx, yx, yy = xx[:-1, :-1] - torch.outer(sx, sx) / n, yx[:, :-1] - torch.outer(sy, sx) / n, yy - sy @ sy / n
    spectrum = None  # the normal equations' eigenvalues, where known
    if lam == "gcv":
        e, v = torch.linalg.eigh(xx)
        kept = e > _cutoff(e, max(n, p))
        lam = _gcv(e[kept], (yx @ v[:, kept]).square().sum(0) / e[kept], yy, n, extra)
        spectrum = e.clamp_min(0) / n + lam
    m = xx / n + lam * torch.eye(p - extra, dtype=xx.dtype, device=xx.device)  # [p', p']
    b = yx / n  # [q, p']
    chol, info = torch.linalg.cholesky_ex(m)
    if int(info) == 0:  # positive definite: the condition number from the spectrum, else estimated
        cond = _condition(spectrum, 0, 0.0) if spectrum is not None else _estimated_condition(m, chol)
        if cond <= COND_WARN:
            a = torch.cholesky_solve(b.T, chol).T
            if free_last:
                a = torch.cat([a, ((sy - a @ sx) / n)[:, None]], 1)  # the intercept b = ybar - A xbar
            return Solved(a, p, cond, float(lam))
    e, vecs = torch.linalg.eigh(m)  # singular or ill-conditioned: exact rank and condition, minimum norm
    cutoff = _cutoff(e, p)
    r = int((e > cutoff).sum())
    cond = _condition(e[e > cutoff], p - extra - r, 0.0)
    _warn(where, r + extra, p, cond)
    inv = torch.where(e > cutoff, 1 / e.clamp_min(cutoff or 1.0), torch.zeros_like(e))  # [p']
    a = (b @ vecs) * inv @ vecs.T
    if free_last:
        a = torch.cat([a, ((sy - a @ sx) / n)[:, None]], 1)  # the intercept b = ybar - A xbar
    return Solved(a, r + extra, cond, float(lam))


def solve(acc: Sums | QR, lam: float | str, free_last: bool, where: str) -> Solved:
    """The ridge solution (module docstring) with ``lambda = lam``, or chosen by ``"gcv"``; ``free_last``:
    the last feature is an unpenalised intercept (ones). Sample space while the samples are kept,
    else the sums; a ``QR`` accumulator solves by ``_solve_qr``."""
    if isinstance(acc, QR):
        if lam == "gcv":
            r_xx, r_xy, r_yy = acc.blocks()
            sums = Sums(acc.p, acc.q, r_xx.device).gram()
            sums.xx, sums.yx, sums.n = r_xx.T @ r_xx, r_xy.T @ r_xx, acc.n
            sums.yy[0] = r_xy.square().sum() + r_yy.square().sum()
            lam = _solve_sums(sums, "gcv", free_last, where).ridge
        return Solved(*_solve_qr(acc, lam, free_last, where), float(lam))
    kept = acc.samples()
    return _solve_samples(*kept, lam, free_last, where) if kept is not None else _solve_sums(acc, lam, free_last, where)


def residual(acc: Sums | QR, a: Tensor, ridge: float | None = None, free_last: bool = False) -> float:
    """``|A X - Y|_F / |Y|_F``: exact from the samples or a ``QR`` factor, else from the sums
    ``tr(A xx A^T) - 2 tr(A yx^T) + sum |y|^2`` (cancels: see ``LayerFit``). With the ``ridge`` that
    ``A`` solves (``solve``'s, ``free_last`` as given there), ``A (xx + n ridge P) = yx`` turns the first
    term into ``tr(A yx^T) - n ridge |A P^1/2|^2``: ``O(q p)`` instead of ``O(q p^2)``."""
    if isinstance(acc, QR):
        r_xx, r_xy, r_yy = acc.blocks()
        num = (r_xx @ a.T - r_xy).square().sum() + r_yy.square().sum()
        den = r_xy.square().sum() + r_yy.square().sum()
        return float(num.sqrt() / den.sqrt()) if float(den) > 0 else 0.0
    kept = acc.samples()
    if kept is not None:
        x, y = kept
        den = y.square().sum()
        return float((x @ a.T - y).norm() / den.sqrt()) if float(den) > 0 else 0.0
    if ridge is None:
        num = (a @ acc.xx * a).sum() - 2 * (a * acc.yx).sum() + acc.yy[0]
    else:
        penalised = a[:, :-1] if free_last else a
        num = acc.yy[0] - (a * acc.yx).sum() - acc.n * ridge * penalised.square().sum()
    den = acc.yy[0]
    return float(num.clamp_min(0).sqrt() / den.sqrt()) if float(den) > 0 else 0.0


def factor(dense: Tensor, parts: tuple[Tensor, Tensor] | None = None) -> LowRank:
    """``[rows, cols]`` -> ``LowRank`` lead ``[1, 1]`` in SVD order, exact zero directions dropped.
    ``parts``: ``(left [rows, k], right [k, cols])`` with ``dense = left @ right`` and ``k`` small (a
    sample-space solve): the SVD then costs that of ``[rows, k]`` (``right^T = Q R``, the SVD of
    ``left R^T``), not of ``dense``."""
    if parts is not None and parts[0].shape[1] < min(dense.shape):
        q, r = torch.linalg.qr(parts[1].T)  # [cols, k], [k, k]
        u, s, vh = torch.linalg.svd(parts[0] @ r.T, full_matrices=False)  # [rows, k'], [k'], [k', k]
        vh = vh @ q.T  # [k', cols]  orthonormal rows
    else:
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
        acc.gram()
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
