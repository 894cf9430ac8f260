"""Convergence diagnostics of a trajectory, from the factors (``docs/dynamics.md``).

Every quantity is a Frobenius norm or inner product of low-rank matrices, read from the factors
(``LowRank.norm``, ``LowRank.inner``). No dense update is formed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenpatch.dynamics.trajectories import Trajectory
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank

__all__ = [
    "step_norms",
    "total_norms",
    "decay_exponent",
    "step_alignment",
    "layer_alignment",
    "effective_rank",
    "cosine",
    "rank1_ceiling",
]


def _matrix(traj: Trajectory, name: str) -> LowRank:
    d = traj.patches[name]
    if not isinstance(d, LowRank):
        raise InputError(
            f"{name} is a dense (vector) delta; the diagnostics take a matrix of "
            f"{[n for n, x in traj.patches.items() if isinstance(x, LowRank)]}"
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


def cosine(a: LowRank | Tensor, b: LowRank | Tensor) -> Tensor:
    """Normalised Frobenius inner product ``<A, B>_F / (|A|_F |B|_F)`` of two batches of matrices,
    each a ``LowRank`` or a dense ``[*lead, rows, cols]`` tensor, in one layout -> ``[*lead]`` (0 where
    either is zero). A ``LowRank`` against a dense ``D`` reads ``<U^T V, D>_F = sum_k u_k^T D v_k``
    from the factors, never forming the low-rank matrix: how the token patch is set beside a
    fine-tuning update (``tp.finetune``)."""
    if isinstance(a, Tensor) and isinstance(b, LowRank):
        a, b = b, a
    if isinstance(a, LowRank) and isinstance(b, LowRank):
        dt = a.dtype
        inner, na, nb = a.inner(b), a.norm(), b.norm()
    elif isinstance(a, LowRank):
        if tuple(b.shape[-2:]) != a.shape:
            raise InputError(f"cannot compare a {a.shape} low-rank matrix with dense {tuple(b.shape[-2:])} ones")
        dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float64)
        u, v = a.u.to(dt), a.v.to(dt)
        # D v_k in D's own dtype (one pass over the dense matrix, never copied wider), the rest in float64
        dv = (b @ a.v.to(b.dtype).transpose(-1, -2)).to(dt)  # [*lead, rows, k]
        inner = (u * dv.transpose(-1, -2)).sum((-1, -2))  # sum_k u_k^T D v_k
        na, nb = LowRank(u, v).norm(), b.flatten(-2).norm(dim=-1).to(dt)
    else:
        if a.shape[-2:] != b.shape[-2:]:
            raise InputError(f"cannot compare {tuple(a.shape[-2:])} and {tuple(b.shape[-2:])} matrices")
        dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float64)
        a, b = a.to(dt).flatten(-2), b.to(dt).flatten(-2)
        inner, na, nb = (a * b).sum(-1), a.norm(dim=-1), b.norm(dim=-1)
    den = na * nb
    return torch.where(den > 0, inner / den.clamp_min(torch.finfo(dt).tiny), torch.zeros_like(inner))


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
    if isinstance(d, LowRank) and d.rank < min(d.shape):
        _, ru = torch.linalg.qr(d.u.double().transpose(-1, -2))  # [*lead, k, k]
        _, rv = torch.linalg.qr(d.v.double().transpose(-1, -2))
        sv = torch.linalg.svdvals(ru @ rv.transpose(-1, -2))
        top, total = sv[..., 0], sv.norm(dim=-1)
    else:
        m = (d.dense() if isinstance(d, LowRank) else d).double()  # [*lead, rows, cols]
        gram = m.mT @ m if m.shape[-2] >= m.shape[-1] else m @ m.mT
        top = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()
        total = m.flatten(-2).norm(dim=-1)
    return torch.where(top > 0, top / total.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(top))
