"""The online-gradient-descent view of a trajectory (``docs/dynamics.md``).

For one matrix ``W`` reading the MLP input, prefix ``i`` has the with-context input ``s_i``
(``s_C`` of prefix ``i``) and the anchor ``a_i`` (the query alone), and the trajectory's patch is
``dW_i = W (s_i - a_i) a_i^T / |a_i|^2``. Consuming token ``c_i`` is one step of normalised LMS:

    L_i(W') = 1/2 |W' a_i - W s_i|^2,    W_i = W_{i-1} - h_i grad L_i(W_{i-1}),    h_i = 1 / |a_i|^2,

equivalently a step on the linear loss ``tr(G_i^T W')`` with ``G_i = grad L_i(W_{i-1})``. When every
``a_i`` is the same vector ``a`` (a single block; the first layer of a deep model) the replay
is the trajectory exactly: ``W_{i-1} a = W s_{i-1}``, so the step adds ``W (s_i - s_{i-1}) a^T/|a|^2``.
At deeper layers the anchor moves with the prefix and the replayed NLMS steps drift from the
trajectory; ``Replay.deviation`` measures by how much.

Replay in factors: step ``i`` adds ``e_i a_i^T / |a_i|^2`` with the step's error
``e_i = W s_i - W_{i-1} a_i = r_i - sum_{k<i} e_k (v_k . a_i)`` (``r_i = W (s_i - a_i)``, ``v_k = a_k/|a_k|^2``),
a unit lower-triangular system ``(I + C) e = r`` with ``C[i, k] = v_k . a_i`` for ``k < i``: one
triangular solve for all steps. Norms come from Gram matrices of the factors, never dense matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tokenpatch import deltas as dl
from tokenpatch.dynamics.trajectories import Trajectory
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank

__all__ = ["Replay", "replay"]


@dataclass(frozen=True)
class Replay:
    """NLMS steps replayed from a trajectory, for one matrix. ``e [B, N, rows]``: each step's error
    (out-side factor); ``v [B, N, cols]``: ``a_i / |a_i|^2`` (in-side factor); step ``k`` (0-based)
    consumes context token ``k + 1``. ``deviation [B, N + 1]``: ``|W_i - W - dW_i|_F / |dW_i|_F``
    (0 where ``dW_i = 0``)."""

    e: Tensor
    v: Tensor
    deviation: Tensor

    def patch(self, i: int) -> LowRank:
        """``W_i - W`` after ``i`` steps, rank ``i`` (``LowRank`` with leading dim ``[B]``)."""
        return LowRank(self.e[:, :i], self.v[:, :i])

    def __repr__(self) -> str:
        batch, steps = self.e.shape[:2]
        return (
            f"Replay({batch} sequence{'s' * (batch != 1)} x {steps} steps, max deviation from the trajectory "
            f"{float(self.deviation.max()):.2e}; .patch(i), .e, .v, .deviation)"
        )


def replay(traj: Trajectory, name: str) -> Replay:
    """Replay the trajectory of matrix ``name`` (a key of ``traj.patches``, as the math ``[rows, cols]``
    factors ``u = r_i``, ``v = a_i / |a_i|^2``) as online NLMS steps; see the module docstring."""
    delta = traj.patches[name]
    if not dl.is_lowrank(delta) or delta.rank != 1:
        raise InputError(
            f"{name} is not a rank-1 matrix delta of the trajectory; replay one of "
            f"{[n for n, d in traj.patches.items() if dl.is_lowrank(d)]}"
        )
    r = delta.u[:, 1:, 0].double()  # [B, N, rows]  r_i = W (s_i - a_i), prefixes 1..N
    v = delta.v[:, 1:, 0].double()  # [B, N, cols]  a_i / |a_i|^2
    a = v / (v * v).sum(-1, keepdim=True)  # [B, N, cols]  a_i
    n = r.shape[1]
    coupling = (a @ v.transpose(-1, -2)).tril(-1)  # [B, N, N]  C[i, k] = v_k . a_i, k < i
    eye = torch.eye(n, dtype=r.dtype, device=r.device)
    e = torch.linalg.solve_triangular(eye + coupling, r, upper=False, unitriangular=True)  # [B, N, rows]
    dev = _deviation(e, v, a, r)
    dtype = delta.u.dtype
    return Replay(e.to(dtype), delta.v[:, 1:, 0], dev)


def _deviation(e: Tensor, v: Tensor, a: Tensor, r: Tensor) -> Tensor:
    """``|W_i - W - dW_i|_F / |dW_i|_F`` for every prefix, without cancellation.

    With ``r_i = e_i + sum_{k<i} e_k (v_k . a_i)`` the difference is
    ``sum_{k<i} e_k w_ik^T``, ``w_ik = v_k - (v_k . a_i) v_i``: the part of ``v_k`` off the anchor
    ``a_i`` (zero when every anchor is the same). Its norm is read from the Gram matrices of ``e`` and
    of the ``w_ik``, which are formed explicitly, so a zero difference measures as rounding.
    """
    batch, n, _ = e.shape
    gram_e = e @ e.transpose(-1, -2)  # [B, N, N]
    out = torch.zeros(batch, n + 1, dtype=e.dtype, device=e.device)
    for i in range(1, n):  # step i (0-based) = prefix i + 1; earlier steps k < i
        w = v[:, :i] - (v[:, :i] @ a[:, i, :, None]) * v[:, i, None, :]  # [B, i, cols]
        sq = (gram_e[:, :i, :i] * (w @ w.transpose(-1, -2))).sum((-1, -2)).clamp_min(0)  # [B]
        target = (r[:, i] * r[:, i]).sum(-1) * (v[:, i] * v[:, i]).sum(-1)  # [B]  |dW_i|_F^2
        out[:, i + 1] = torch.where(target > 0, (sq / target.clamp_min(torch.finfo(e.dtype).tiny)).sqrt(), sq.sqrt())
    return out  # [B, N+1]; prefixes 0 and 1: a single step is exact
