"""Convergence diagnostics of a trajectory, from the factors (``docs/dynamics.md``).

Every quantity is a Frobenius norm or inner product of low-rank matrices, read from the factors
(``LowRank.norm``, ``LowRank.inner``). No dense update is formed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenpatch import deltas as dl
from tokenpatch.deltas import cosine
from tokenpatch.dynamics.trajectories import Trajectory
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank

__all__ = [
    "step_norms",
    "total_norms",
    "decay_exponent",
    "limit_distance",
    "step_alignment",
    "layer_alignment",
    "effective_rank",
    "cosine",
    "rank1_ceiling",
]


def _matrix(traj: Trajectory, name: str) -> LowRank:
    d = traj.patches[name]
    if not dl.is_lowrank(d):
        raise InputError(
            f"{name} is a dense (vector) delta; the diagnostics take a matrix of "
            f"{[n for n, x in traj.patches.items() if dl.is_lowrank(x)]}"
        )
    return d.to(torch.promote_types(d.dtype, torch.float64))


def total_norms(traj: Trajectory, name: str) -> Tensor:
    """``|dW_i|_F`` for every prefix ``i = 0..N`` -> ``[B, N + 1]``."""
    return _matrix(traj, name).norm()


def step_norms(traj: Trajectory, name: str) -> Tensor:
    """``|dW_i - dW_{i-1}|_F`` for ``i = 1..N`` -> ``[B, N]``: the size of the update token ``c_i`` makes.
    The difference is kept as factors (``[U_i, -U_{i-1}]``, ``[V_i, V_{i-1}]``) and its norm taken by
    ``LowRank.norm``, which does not cancel: ``|a|^2 - 2<a, b> + |b|^2`` lost half the digits of a
    small step after a large update."""
    d = _matrix(traj, name)
    now, before = d.index((slice(None), slice(1, None))), d.index((slice(None), slice(None, -1)))
    return (now + LowRank(-before.u, before.v)).norm()


def limit_distance(traj: Trajectory, name: str) -> Tensor:
    """``|dW_i - dW_N|_F / |dW_N|_F`` for every prefix ``i = 0..N`` -> ``[B, N + 1]``: how far the update
    after ``i`` context tokens is from the one after all ``N`` (1 at ``i = 0``, 0 at ``i = N``). Where the
    updates converge it falls like the step norms' tail sum; where each token rewrites the update, it stays
    near 1 until the end."""
    d = _matrix(traj, name)  # u [B, N + 1, r, rows]
    last = d.index((slice(None), slice(-1, None)))  # [B, 1, ...]
    gap = d + LowRank(-last.u.expand_as(d.u), last.v.expand_as(d.v))  # dW_i - dW_N, kept as factors
    return gap.norm() / last.norm()


def decay_exponent(norms: Tensor, start: int = 2) -> Tensor:
    """Least-squares slope of ``log norm_i`` against ``log i`` over ``i >= start`` (1-based steps),
    per row of ``norms [B, N]`` -> ``[B]``. Negative: the updates shrink as ``i^slope``."""
    n = norms.shape[-1]
    if n - start + 1 < 2:
        raise InputError(f"a slope needs two steps at i >= {start}; there are {n} steps")
    i = torch.arange(start, n + 1, dtype=torch.float64)
    x = i.log() - i.log().mean()  # [M]
    y = norms[..., start - 1 :].double().clamp_min(torch.finfo(torch.float64).tiny).log()  # [B, M]
    return ((y - y.mean(-1, keepdim=True)) * x).sum(-1) / (x * x).sum()


def step_alignment(traj: Trajectory, name: str) -> Tensor:
    """Cosine (normalised Frobenius inner product) of consecutive steps ``i - 1 -> i`` and
    ``i -> i + 1`` for ``i = 1..N-1`` -> ``[B, N - 1]``."""
    d = _matrix(traj, name)
    u, v = d.u, d.v  # [B, N+1, 1, .]
    steps = LowRank(torch.cat([u[:, 1:], -u[:, :-1]], -2), torch.cat([v[:, 1:], v[:, :-1]], -2))  # [B, N], rank 2
    return cosine(steps.index((slice(None), slice(1, None))), steps.index((slice(None), slice(None, -1))))


def layer_alignment(traj: Trajectory, names: list[str], prefix: int = -1) -> Tensor:
    """Cosine between the patches of matrices ``names`` (same shape, e.g. every layer's ``fc_in``)
    at one prefix (default: all the context) -> ``[B, L, L]``."""
    ds = [_matrix(traj, n) for n in names]
    if len({d.shape for d in ds}) != 1:
        raise InputError(f"layer_alignment needs matrices of one shape, got {[d.shape for d in ds]}")
    at = [d.index((slice(None), prefix)) for d in ds]  # [B] each, rank 1
    return torch.stack([torch.stack([cosine(a, b) for b in at], -1) for a in at], -2)


def effective_rank(delta: LowRank) -> Tensor:
    """``exp(H(p))`` with ``p`` the normalised singular values of ``U^T V`` (Roy & Vetterli, 2007),
    from the factors: ``U = Q_u R_u``, ``V = Q_v R_v`` so the singular values are those of
    ``R_u R_v^T`` (``rank x rank``) -> ``[*lead]``. 1 for a rank-1 update."""
    u, v = delta.u.double(), delta.v.double()  # [*lead, r, rows], [*lead, r, cols]
    r_u = torch.linalg.qr(u.transpose(-1, -2)).R  # [*lead, r, r]
    r_v = torch.linalg.qr(v.transpose(-1, -2)).R
    sv = torch.linalg.svdvals(r_u @ r_v.transpose(-1, -2))  # [*lead, r]  those of U^T V = Q_u (R_u R_v^T) Q_v^T
    p = sv / sv.sum(-1, keepdim=True).clamp_min(torch.finfo(sv.dtype).tiny)
    return torch.exp(-(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1))


def rank1_ceiling(d: LowRank | Tensor) -> Tensor:
    """The largest cosine any rank-1 matrix can have with ``D``: ``s_1(D) / |D|_F`` -> ``[*lead]`` (0 where
    ``D = 0``). ``D`` dense ``[*lead, rows, cols]``, or a ``LowRank`` of rank ``k`` read from its factors
    (``D = U^T V = Q_u R_u R_v^T Q_v^T``: the singular values of the ``k x k`` matrix ``R_u R_v^T``)
    while ``k`` is below both sides, densely beyond: ``s_1(D)^2`` the top eigenvalue of the smaller Gram
    matrix (``D^T D`` or ``D D^T``), a fraction of a full SVD's work."""
    if dl.is_lowrank(d) and d.rank < min(d.shape):
        _, ru = torch.linalg.qr(d.u.double().transpose(-1, -2))  # [*lead, k, k]
        _, rv = torch.linalg.qr(d.v.double().transpose(-1, -2))
        sv = torch.linalg.svdvals(ru @ rv.transpose(-1, -2))
        top, total = sv[..., 0], sv.norm(dim=-1)
    else:
        m = dl.dense(d).double()  # [*lead, rows, cols]
        gram = m.mT @ m if m.shape[-2] >= m.shape[-1] else m @ m.mT
        top = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()
        total = m.flatten(-2).norm(dim=-1)
    return torch.where(top > 0, top / total.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(top))
