"""solve.py: the minimal rank-1 patch and its minimal-norm property, on synthetic tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tokenpatch as tp
from tokenpatch import solve


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


dims = st.integers(1, 9)
seeds = st.integers(0, 2**16)


@given(rows=dims, cols=dims, seed=seeds)
def test_input_patch_reproduces_with_context_preactivation(rows, cols, seed):
    w = _randn(rows, cols, seed=seed)
    s_c, s_0 = _randn(4, 2, cols, seed=seed + 1), _randn(4, 2, cols, seed=seed + 2)
    patch = solve.input_patch(w, s_c, s_0)
    assert patch.u.shape == (4, 2, 1, rows) and patch.v.shape == (4, 2, 1, cols)
    got = (w + patch.dense()) @ s_0[..., None]  # (W + dW) s_0
    torch.testing.assert_close(got[..., 0], s_c @ w.T, rtol=0, atol=1e-12)


@given(rows=dims, cols=st.integers(2, 9), seed=seeds)
def test_minimal_norm_property(rows, cols, seed):
    """|dW*|_F = |r| / |a|; every other solution dW* + M (I - a a^T/|a|^2) is larger."""
    r, a = _randn(rows, seed=seed), _randn(cols, seed=seed + 1)
    best = solve.minimal_patch(r, a)
    dense = best.dense()[0] if best.dense().ndim == 3 else best.dense()
    torch.testing.assert_close(dense @ a, r, rtol=0, atol=1e-12)
    torch.testing.assert_close(best.norm(), r.norm() / a.norm(), rtol=1e-12, atol=0)
    torch.testing.assert_close(dense, r[:, None] @ torch.linalg.pinv(a[:, None]), rtol=0, atol=1e-12)  # r a^+
    for k in range(3):
        m = _randn(rows, cols, seed=seed + 10 + k)
        other = solve.patch_family(r, a, m)
        torch.testing.assert_close(other @ a, r, rtol=0, atol=1e-10)  # also a valid patch
        extra = (m @ (torch.eye(cols, dtype=torch.float64) - torch.outer(a, a) / (a @ a))).norm()
        assert torch.linalg.matrix_norm(other) >= best.norm() - 1e-12
        # Pythagoras: the two parts are Frobenius-orthogonal
        torch.testing.assert_close(
            torch.linalg.matrix_norm(other) ** 2, best.norm() ** 2 + extra**2, rtol=1e-10, atol=1e-12
        )
    torch.testing.assert_close(
        solve.patch_family(r, a, torch.zeros(rows, cols, dtype=torch.float64)), dense, rtol=0, atol=1e-14
    )


def test_output_patch_and_shift():
    m_c, m_0, hid = _randn(3, 5, seed=1), _randn(3, 5, seed=2), _randn(3, 7, seed=3)
    torch.testing.assert_close(solve.output_shift(m_c, m_0), m_c - m_0)
    p = solve.output_patch(m_c, m_0, hid)
    torch.testing.assert_close(p.matvec(hid), m_c - m_0, rtol=0, atol=1e-13)
    assert p.rank == 1


def test_zero_anchor_raises_with_index():
    r = torch.ones(2, 3, 4, dtype=torch.float64)
    a = _randn(2, 3, 5, seed=0)
    a[1, 2] = 0
    with pytest.raises(tp.ZeroAnchorError, match="anchor vector is zero") as info:
        solve.minimal_patch(r, a)
    assert info.value.index == [(1, 2)]


def test_zero_anchor_with_zero_change_is_a_zero_patch():
    r, a = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64)
    r[0] = 1.0
    a[0] = 1.0
    p = solve.minimal_patch(r, a)
    assert torch.all(p.dense()[1] == 0)


def test_nonfinite_inputs_raise():
    a = _randn(3, seed=0)
    with pytest.raises(tp.InputError, match="NaN or inf"):
        solve.minimal_patch(torch.tensor([1.0, float("nan")]), a[:2])
    with pytest.raises(tp.InputError, match="share leading dims"):
        solve.minimal_patch(torch.ones(2, 3), torch.ones(3, 3))


def test_math_runs_in_at_least_float32():
    w = torch.randn(4, 3).half()
    p = solve.input_patch(w, torch.randn(2, 3).half(), torch.randn(2, 3).half())
    assert p.u.dtype == torch.float32 and p.v.dtype == torch.float32
    assert solve.work_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_half_weights_are_read_block_by_block(layout, monkeypatch):
    """``W (s_C - s_0)`` of a float16 weight runs in float32 one block of rows at a time (never a
    float32 copy of the whole matrix) and equals the product with the whole weight cast."""
    w = torch.randn(37, 11).half()  # [rows, cols] as math
    stored = w if layout == "out_in" else w.T.contiguous()  # Conv1D stores [in, out]
    x = torch.randn(3, 11)
    monkeypatch.setattr(solve, "_BLOCK", 50)  # 4 rows per block: 10 blocks
    got = solve.apply_weight(stored, x, layout)
    torch.testing.assert_close(got, x @ w.float().T, rtol=0, atol=1e-5)
    p = solve.input_patch(stored, x, torch.randn(3, 11), layout=layout)
    assert p.u.dtype == torch.float32 and p.shape == (37, 11)
