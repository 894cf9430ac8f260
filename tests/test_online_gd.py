"""The online-GD view and the diagnostics: replay is the trajectory where the anchor is fixed,
every factor-side quantity equals its dense definition (float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_block, random_model

import tokenpatch as tp
from tokenpatch.dynamics import diagnostics as dg
from tokenpatch.dynamics.online_gd import replay


def _dense(traj, name, i):
    return traj.patch(i)[name].dense()[:, 0]  # [B, rows, cols]


@pytest.mark.parametrize("layer", sorted(tp.LAYERS))
def test_replay_is_the_trajectory_where_the_anchor_is_fixed(layer):
    """A single block, and the first layer of a deep model: W_i = W_{i-1} - grad L_i / |a|^2."""
    block = random_block(tp.ICLConfig(d_in=5, d_model=5, n_layers=1, n_heads=1, layer=layer, norm="pre"), seed=2)
    model = random_model(tp.ICLConfig(d_in=3, d_model=6, n_layers=3, n_heads=2, layer=layer, norm="pre"), seed=2)
    for net, x, name in [
        (block, torch.randn(2, 8, 5, dtype=torch.float64), "mlp.fc_in.weight"),
        (model, torch.randn(2, 8, 3, dtype=torch.float64), "blocks.0.mlp.fc_in.weight"),
    ]:
        traj = tp.trajectory(net, x)
        rp = replay(traj, name)
        for i in range(8):
            torch.testing.assert_close(rp.patch(i).dense(), _dense(traj, name, i), rtol=0, atol=1e-10)
        assert float(rp.deviation.max()) <= 1e-10


def test_deeper_layers_are_not_nlms_and_the_deviation_says_how_far():
    model = random_model(tp.ICLConfig(d_in=3, d_model=6, n_layers=3, n_heads=2, norm="pre"), seed=1)
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    traj = tp.trajectory(model, x)
    name = "blocks.2.mlp.fc_in.weight"
    rp = replay(traj, name)
    for i in range(1, 9):  # the deviation is the dense relative distance
        gap = (rp.patch(i).dense() - _dense(traj, name, i)).flatten(1).norm(dim=1)
        torch.testing.assert_close(
            rp.deviation[:, i], gap / _dense(traj, name, i).flatten(1).norm(dim=1), rtol=1e-9, atol=1e-12
        )
    assert float(rp.deviation.max()) > 1e-3  # the anchor moves: the identity does not hold here


def test_diagnostics_equal_their_dense_definitions(small_model, small_inputs):
    traj = tp.trajectory(small_model, small_inputs)
    name = "blocks.1.mlp.fc_in.weight"
    dense = torch.stack([_dense(traj, name, i) for i in range(7)], 1)  # [B, N+1, rows, cols]
    fro = lambda t: t.flatten(-2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(dg.total_norms(traj, name), fro(dense), rtol=1e-10, atol=1e-13)
    steps = dense[:, 1:] - dense[:, :-1]  # [B, N, rows, cols]
    torch.testing.assert_close(dg.step_norms(traj, name), fro(steps), rtol=1e-8, atol=1e-12)
    cos = (steps[:, 1:] * steps[:, :-1]).sum((-1, -2)) / (fro(steps[:, 1:]) * fro(steps[:, :-1]))
    torch.testing.assert_close(dg.step_alignment(traj, name), cos, rtol=1e-8, atol=1e-10)
    names = [f"blocks.{i}.mlp.fc_in.weight" for i in range(3)]
    last = torch.stack([_dense(traj, n, 6) for n in names], 1)  # [B, L, rows, cols]
    ref = torch.einsum("blrc,bmrc->blm", last, last) / (fro(last)[:, :, None] * fro(last)[:, None, :])
    torch.testing.assert_close(dg.layer_alignment(traj, names), ref, rtol=1e-10, atol=1e-12)


def test_decay_exponent_and_effective_rank():
    i = torch.arange(1, 65, dtype=torch.float64)
    norms = torch.stack([3 * i**-0.5, 0.2 * i**0.0, i**-1.5])  # [3, 64]
    torch.testing.assert_close(dg.decay_exponent(norms), torch.tensor([-0.5, 0.0, -1.5], dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    u, v = (
        torch.randn(2, 4, 7, generator=g, dtype=torch.float64),
        torch.randn(2, 4, 5, generator=g, dtype=torch.float64),
    )
    delta = tp.LowRank(u, v)  # [2] matrices 7x5 of rank 4
    sv = torch.linalg.svdvals(delta.dense())
    p = sv / sv.sum(-1, keepdim=True)
    ref = torch.exp(-(p * p.clamp_min(1e-300).log()).sum(-1))
    torch.testing.assert_close(dg.effective_rank(delta), ref, rtol=1e-10, atol=1e-12)
    one = tp.LowRank(u[:, :1], v[:, :1])
    torch.testing.assert_close(dg.effective_rank(one), torch.ones(2, dtype=torch.float64))
