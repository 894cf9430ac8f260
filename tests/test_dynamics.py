"""tp.trajectory: the patches of every context prefix, from one pass, equal tp.token_patch on the
truncated inputs (float64, 1e-10) for every layer kind, norm placement and residual setting."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import random_block, random_model, sweep
from hypothesis import given
from hypothesis import strategies as st

import tokenpatch as tp

COMBOS = list(itertools.product(sorted(tp.LAYERS), ["none", "pre", "post"], [True, False]))


def _dense(d):
    return d.dense() if isinstance(d, tp.LowRank) else d


def _max_diff(a: tp.Patch, b: tp.Patch) -> float:
    assert list(a) == list(b) and a.lead == b.lead and a.positions == b.positions
    return max(float((_dense(a[n]) - _dense(b[n])).abs().max()) for n in a)


@st.composite
def sizes(draw):
    n_heads = draw(st.sampled_from([1, 2]))
    seq_len = draw(st.integers(2, 9))
    return dict(
        n_heads=n_heads,
        d_model=n_heads * draw(st.integers(1, 3)),
        d_in=draw(st.integers(1, 4)),
        d_mlp=draw(st.integers(1, 10)),
        batch=draw(st.integers(1, 2)),
        seq_len=seq_len,
        query=draw(st.integers(1, seq_len - 1)),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("layer,norm,residual", COMBOS)
@sweep
@given(s=sizes())
def test_every_prefix_equals_token_patch_on_the_truncated_inputs(layer, norm, residual, s):
    config = tp.ICLConfig(
        d_in=s["d_in"],
        d_model=s["d_model"],
        n_layers=3,
        n_heads=s["n_heads"],
        d_mlp=s["d_mlp"],
        layer=layer,
        norm=norm,
        residual=residual,
    )
    model = random_model(config, s["seed"])
    x = torch.randn(
        s["batch"], s["seq_len"], s["d_in"], generator=torch.Generator().manual_seed(s["seed"]), dtype=torch.float64
    )
    traj = tp.trajectory(model, x, query=s["query"], steps=True)
    for i in range(s["query"] + 1):
        xi = traj.prefix_inputs(x, i)  # [c_1..c_i, x]
        assert _max_diff(traj.patch(i), tp.token_patch(model, xi)) <= 1e-10
        if i >= 1:  # the increment: prefix i with c_i removed, anchored at the prefix-(i-1) state
            removed = torch.arange(i + 1) == i - 1
            assert _max_diff(traj.step(i), tp.token_patch(model, xi, remove=removed)) <= 1e-10
    last = traj.prefix_inputs(x, s["query"])  # and they verify like any patch
    assert tp.verify(model, traj.patch(s["query"]), last).max_abs <= 1e-10
    assert tp.verify(model, traj.step(s["query"]), last).max_abs <= 1e-10


@pytest.mark.parametrize("layer", sorted(tp.LAYERS))
def test_a_bare_block_and_the_zero_prefix(layer):
    block = random_block(
        tp.ICLConfig(d_in=4, d_model=4, n_layers=1, n_heads=2, layer=layer, norm="none", residual=False), seed=3
    )
    h = torch.randn(2, 6, 4, dtype=torch.float64)
    traj = tp.trajectory(block, h)
    assert traj.patches.lead == (2, 6) and traj.n_context == 5
    assert all(float(v.abs().max()) == 0.0 for v in traj.patch(0).norms().values())  # i = 0: exactly zero
    assert all(float(v.min()) > 0 for v in traj.patch(5).norms().values())
    assert _max_diff(traj.patch(5), tp.token_patch(block, h)) <= 1e-10


def test_trajectory_patches_save_and_apply(small_model, small_inputs, tmp_path):
    traj = tp.trajectory(small_model, small_inputs, steps=True)
    p = traj.patch(3)
    tp.save_patch(p, tmp_path / "p3.safetensors")
    back = tp.load_patch(tmp_path / "p3.safetensors", model=small_model)
    x3 = traj.prefix_inputs(small_inputs, 3)
    assert tp.verify(small_model, back, x3).max_abs <= 1e-10
    with tp.apply(small_model, p[1, 0]):
        alone = small_model(x3[1:2, -1:])
    torch.testing.assert_close(alone[0, 0], small_model(x3[1:2])[0, -1], rtol=0, atol=1e-12)


def test_bad_trajectory_requests(small_model, small_inputs):
    with pytest.raises(tp.InputError, match="first token"):
        tp.trajectory(small_model, small_inputs, query=0)
    with pytest.raises(tp.InputError, match="one query position"):
        tp.trajectory(small_model, small_inputs, query="all")
    with pytest.raises(tp.InputError, match="outside the sequence"):
        tp.trajectory(small_model, small_inputs, query=9)
    traj = tp.trajectory(small_model, small_inputs, query=4)
    with pytest.raises(tp.InputError, match="prefix 5 does not exist"):
        traj.patch(5)
    with pytest.raises(tp.InputError, match="steps=True"):
        traj.step(2)
