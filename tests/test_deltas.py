"""The delta protocol (``tokenpatch/deltas.py``): a ``LowRank`` and its dense twin give the same numbers
for every operation; ``Patch``'s fields all combine through the one table (``patch_combine.FIELD_RULES``);
``finetuned`` runs through the one delta hook (``delta_hooks.DeltaHook``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenpatch as tp
from tokenpatch import deltas as dl
from tokenpatch.dynamics.finetuning import finetuned
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank
from tokenpatch.patch import Patch
from tokenpatch.patch_combine import CARRIED, FIELD_RULES
from tokenpatch.run import DeltaHook

TOL = {"atol": 1e-12, "rtol": 1e-12}


def _close(a, b):
    torch.testing.assert_close(dl.dense(a), dl.dense(b), **TOL)


@st.composite
def twins(draw, rank=None):
    """A float64 ``LowRank`` of lead ``[B, Q]`` and its dense twin, with a second pair of the same shape."""
    b, q = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pairs, r = [], rank or draw(st.integers(1, 3))  # one rank: joined deltas share (rank, shape)
    for _ in range(2):
        low = LowRank(
            torch.randn(b, q, r, rows, generator=g, dtype=torch.float64),
            torch.randn(b, q, r, cols, generator=g, dtype=torch.float64),
        )
        pairs.append((low, low.dense()))
    return pairs


@settings(max_examples=30)
@given(twins(), st.floats(-3, 3), st.sampled_from(["out_in", "in_out"]), st.integers(0, 1))
def test_lowrank_and_dense_give_the_same_numbers(pairs, c, layout, dim):
    (low, den), (low2, den2) = pairs
    assert dl.kind(low) == "lowrank" and dl.kind(den) == "dense" and dl.is_lowrank(low) and not dl.is_lowrank(den)
    assert dl.lead(low) == dl.lead(den) and dl.shape(low) == dl.shape(den)
    _close(dl.add(low, low2), dl.add(den, den2))
    _close(dl.add(low, dl.index(low2, (slice(0, 1), slice(0, 1)))), den + den2[:1, :1])  # broadcast
    _close(dl.scale(low, c), dl.scale(den, c))
    x = torch.randn(*dl.lead(den), 4, dl.shape(den)[1 if layout == "out_in" else 0], dtype=torch.float64)
    torch.testing.assert_close(dl.apply(low, x, layout), dl.apply(den, x, layout), **TOL)
    torch.testing.assert_close(dl.norm(low), dl.norm(den), **TOL)
    torch.testing.assert_close(dl.cosine(low, low2), dl.cosine(den, den2), **TOL)
    torch.testing.assert_close(dl.cosine(low, den2), dl.cosine(den, den2), **TOL)
    torch.testing.assert_close(dl.cosine(den, low2), dl.cosine(den, den2), **TOL)
    for key in [(0, 0), (slice(None), slice(0, 1)), (slice(-1, None),)]:
        _close(dl.index(low, key), dl.index(den, key))
    _close(dl.cat([low, low2], dim), dl.cat([den, den2], dim))
    _close(dl.sum_over(low, dim), dl.sum_over(den, dim))
    _close(dl.zeros(low), dl.zeros(den))
    assert not dl.dense(dl.zeroed_at(low, (slice(None), 0)))[:, 0].any()
    _close(dl.zeroed_at(low, (slice(None), 0)), dl.zeroed_at(den, (slice(None), 0)))
    moved = dl.map_tensors(low, lambda t: t.float())
    assert dl.dense(moved).dtype == dl.map_tensors(den, lambda t: t.float()).dtype == torch.float32
    _close(dl.map_tensors(dl.map_tensors(low, torch.neg), torch.neg), low)
    assert dl.as_weight(low, dl.shape(den)).shape == den.shape
    _close(dl.as_weight(low, dl.shape(den)), dl.as_weight(den, dl.shape(den)))
    assert dl.shape_for(low, dl.shape(den)) == dl.shape_for(den, dl.shape(den)) == dl.shape(den)
    assert dl.from_tensors(dl.kind(low), dl.tensors(low)) == low
    assert dl.from_tensors(dl.kind(den), dl.tensors(den)) is den


@given(twins(rank=2))
def test_bytes_are_the_stored_tensors(pairs):
    (low, den), _ = pairs
    (b, q), (rows, cols) = dl.lead(low), dl.shape(low)
    assert dl.nbytes(low) == b * q * 2 * (rows + cols) * 8
    assert dl.nbytes(den) == b * q * rows * cols * 8
    assert dl.signature(low) == (2, (rows, cols)) and dl.signature(den) == (rows, cols)
    assert dl.describe(low) == f"LowRank(rank=2, {rows}x{cols})" and dl.describe(den) == f"dense{(rows, cols)}"


def test_a_delta_is_a_tensor_or_a_lowrank_and_kinds_do_not_mix():
    low = LowRank(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    with pytest.raises(InputError, match="torch.Tensor or a tokenpatch.LowRank"):
        dl.kind([1.0])
    with pytest.raises(InputError, match="cannot add a lowrank delta to a dense one"):
        dl.add(low, low.dense())
    with pytest.raises(InputError, match="cannot join deltas"):
        dl.cat([low, low.dense()], 0)


@settings(max_examples=20)
@given(twins(), st.sampled_from(["batch", "query"]))
def test_a_patch_sums_stacks_and_indexes_alike_in_either_kind(pairs, dim):
    (low, den), (low2, den2) = pairs
    bias = torch.randn(*dl.lead(den), 3, dtype=torch.float64)
    pl, pd = Patch({"w": low, "b": bias}), Patch({"w": den, "b": bias})
    ql, qd = Patch({"w": low2, "b": bias}), Patch({"w": den2, "b": bias})
    for a, b in [
        (pl + ql, pd + qd),
        (pl.sum(dim), pd.sum(dim)),
        (Patch.stack([pl, ql], dim), Patch.stack([pd, qd], dim)),
        (pl[0, -1], pd[0, -1]),
        (pl.map(lambda t: t[:1]), pd.map(lambda t: t[:1])),
    ]:
        assert a.lead == b.lead and a.meta == b.meta
        for n in a:
            _close(a[n], b[n])
        torch.testing.assert_close(a.norms()["w"], b.norms()["w"], **TOL)
    assert pl.norms()["b"].shape == pl.lead


def test_every_patch_field_combines_by_the_table():
    """A field ``Patch`` sets and ``FIELD_RULES`` does not name would be dropped or mixed by ``+``, ``.sum``,
    ``stack`` or indexing."""
    p = Patch({"w": torch.zeros(1, 1, 2)})
    fields = set(vars(p)) - {"_deltas", "lead"}
    named = [f for rule in FIELD_RULES for f in rule.fields]
    assert sorted(named) == sorted(fields) and len(named) == len(set(named))
    assert set(CARRIED) == fields - {"positions", "meta"}


def test_finetuned_runs_through_the_one_delta_hook():
    lin = torch.nn.Sequential(torch.nn.Linear(3, 2).double())
    w = LowRank(torch.randn(2, 1, 2, dtype=torch.float64), torch.randn(2, 1, 3, dtype=torch.float64))  # lead [R=2]
    x = torch.randn(4, 5, 3, dtype=torch.float64)  # 2 runs x 2 sequences
    with finetuned(lin, {"0.weight": w, "0.bias": torch.ones(2, 2, dtype=torch.float64)}):
        hooks = list(lin[0]._forward_hooks.values())
        got = lin(x)
    assert [type(h.__self__) for h in hooks] == [DeltaHook]
    for r in range(2):
        dw = w.dense()[r]
        want = x[2 * r : 2 * r + 2] @ (lin[0].weight + dw).T + lin[0].bias + 1
        torch.testing.assert_close(got[2 * r : 2 * r + 2], want, **TOL)
    assert tp.LowRank is LowRank


@pytest.mark.parametrize("transposed", [False, True])
def test_stacked_matrices_are_written_back_in_either_storage_layout(transposed):
    """Stacked experts' output matrices, ``[E, out, in]`` or transposed ``[E, in, out]`` (gpt-oss, Aria):
    the patch of the one matrix ``[out, E * in]`` (kept as its transpose ``[E * in, out]`` for the
    transposed layout) is written back expert by expert, each block its expert's matrix."""
    n_experts, out, width = 3, 5, 4
    g = torch.Generator().manual_seed(0)
    u, v = (
        torch.randn(1, 1, 1, out, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 1, n_experts * width, generator=g, dtype=torch.float64),
    )
    one = u[0, 0, 0][:, None] * v[0, 0, 0][None, :]  # [out, E * in]: [D_1 ... D_E]
    per_expert = one.unflatten(1, (n_experts, width)).movedim(1, 0)  # [E, out, in]
    low, shape = (LowRank(v, u), (n_experts, width, out)) if transposed else (LowRank(u, v), (n_experts, out, width))
    want = per_expert.transpose(1, 2) if transposed else per_expert
    _close(dl.as_weight(low, shape)[0, 0], want)
    assert (
        dl.shape_for(low, shape) == low.shape == ((n_experts * width, out) if transposed else (out, n_experts * width))
    )
