"""The thought patch's least squares (tokenpatch/thought/lstsq.py): the sample-space solve equals
the feature-space one and the explicit formula, the intercept is the unpenalised one, and
``ridge="gcv"`` picks the grid's minimiser of the generalised cross-validation score."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenpatch.thought.lstsq import GCV_GRID, SAMPLE_SPACE, Sums, accumulate, factor, residual, solve


def _problem(seed: int, n: int, p: int, q: int, intercept: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, p, dtype=torch.float64)
    x = x + torch.randn(p, generator=g, dtype=torch.float64)  # a mean the intercept must absorb
    if intercept:
        x = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    y = x @ torch.randn(x.shape[1], q, generator=g, dtype=torch.float64) + 0.3 * torch.randn(
        n, q, generator=g, dtype=torch.float64
    )
    return x, y


def _explicit(x: torch.Tensor, y: torch.Tensor, lam: float, intercept: bool) -> torch.Tensor:
    """``min (1/n)|X A^T - Y|^2 + lam |A P^1/2|^2`` in closed form (pinv where singular)."""
    n, p = x.shape
    pen = torch.eye(p, dtype=x.dtype)
    if intercept:
        pen[-1, -1] = 0
    return (torch.linalg.pinv(x.T @ x / n + lam * pen, hermitian=True) @ x.T @ y / n).T


def _sums(x, y, batch: int) -> Sums:
    return accumulate(zip(x.split(batch), y.split(batch)))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(3, 40),
    intercept=st.booleans(),
    lam=st.sampled_from([1e-3, 0.1, 2.0]),
)
def test_sample_and_feature_space_solves_equal_the_ridge_formula(seed, n, intercept, lam):
    """``n <= p / 2`` keeps the samples (solved in sample space), more switches to the sums; both are the
    closed form to float64 rounding, whatever the batching."""
    p = 30
    x, y = _problem(seed, n, p, 4, intercept)
    want = _explicit(x, y, lam, intercept)
    kept = _sums(x, y, 7)
    gram = _sums(x, y, 7).gram()
    assert (kept.samples() is not None) == (n <= SAMPLE_SPACE * x.shape[1]) and gram.samples() is None
    for acc in (kept, gram):
        a, rank, cond, used, _ = solve(acc, lam, intercept, "test")
        assert used == lam and rank == x.shape[1] and 1 <= cond < 1e8
        assert float((a - want).abs().max()) <= 1e-10 * float(want.abs().max())
        fit = ((x @ a.T - y).square().sum() / y.square().sum()).sqrt()
        assert abs(residual(acc, a) - float(fit)) <= 1e-6


def test_fewer_samples_than_features_without_ridge_is_the_minimum_norm_interpolant():
    """The ``lambda -> 0+`` limit: rank-deficient (warned), every sample met, the least ``|A|`` of
    those that do (the intercept unpenalised: the least ``|A|`` among ``A, b`` meeting them)."""
    x, y = _problem(3, 6, 10, 3, intercept=True)
    with pytest.warns(UserWarning, match="rank-deficient"):
        a, rank, cond, _, _ = solve(_sums(x, y, 4), 0.0, True, "test")
    assert rank == 6 and cond == math.inf
    assert float((x @ a.T - y).abs().max()) <= 1e-10
    xc = x[:, :-1] - x[:, :-1].mean(0)
    want = torch.linalg.pinv(xc) @ (y - y.mean(0))  # [p-1, q]  the least-norm A of the centred problem
    assert float((a[:, :-1] - want.T).abs().max()) <= 1e-10


def _gcv_by_hand(x, y, lam, intercept):
    """``n |Y - H Y|^2 / (n - tr H)^2`` with the hat matrix ``H`` written out."""
    n, p = x.shape
    pen = torch.eye(p, dtype=x.dtype)
    if intercept:
        pen[-1, -1] = 0
    h = x @ torch.linalg.solve(x.T @ x + n * lam * pen, x.T)  # [n, n]
    return float(n * (y - h @ y).square().sum() / (n - torch.trace(h)) ** 2)


@pytest.mark.parametrize("n", [10, 60])  # sample space (n <= p / 2), feature space
@pytest.mark.parametrize("intercept", [False, True])
def test_gcv_picks_the_grid_minimiser_of_the_written_out_score(n, intercept):
    x, y = _problem(5, n, 20, 3, intercept)
    scores = {lam: _gcv_by_hand(x, y, lam, intercept) for lam in GCV_GRID}
    best = min(scores, key=scores.get)
    assert scores[best] < 0.99 * max(scores.values())  # the score varies: the choice means something
    a, _, cond, used, _ = solve(_sums(x, y, 5), "gcv", intercept, "test")
    assert used == best
    # the solution at the chosen lambda, to rounding amplified by the system's condition number
    assert float((a - _explicit(x, y, best, intercept)).abs().max()) <= 1e-13 * cond * float(a.abs().max())


def test_a_factor_from_the_solve_s_parts_is_the_svd_of_their_product():
    """``factor(dense, (left, right))``: the same singular directions, in the same order, as the SVD
    of ``dense`` itself, at the cost of the thin side."""
    g = torch.Generator().manual_seed(7)
    left, right = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((9, 4), (4, 13)))
    dense = left @ right
    whole, thin = factor(dense), factor(dense, (left, right))
    assert thin.u.shape == whole.u.shape == (1, 1, 4, 9) and thin.v.shape == (1, 1, 4, 13)
    assert float((thin.dense()[0, 0] - dense).abs().max()) <= 1e-12 * float(dense.abs().max())
    s_whole, s_thin = whole.u.norm(dim=-1), thin.u.norm(dim=-1)  # the singular values, descending
    assert float((s_thin - s_whole).abs().max()) <= 1e-12 * float(s_whole.max())
    cos = (thin.v[0, 0] * whole.v[0, 0]).sum(-1).abs()  # the same right singular vectors, up to sign
    assert float((cos - 1).abs().max()) <= 1e-10


@pytest.mark.parametrize("shape", [(9, 13), (13, 9), (12, 12)])
def test_a_factor_is_the_svd_with_exact_zero_directions_dropped(shape):
    """Tall, wide and square: the singular values of ``torch.linalg.svdvals``, orthonormal ``v``
    rows, the product ``dense`` to rounding with repeated singular values, and a rank-5 matrix (one
    of its singular values 1e-6) kept at rank 5: a Gram-matrix shortcut fails this."""
    g = torch.Generator().manual_seed(sum(shape))
    q1 = torch.linalg.qr(torch.randn(shape[0], 5, generator=g, dtype=torch.float64)).Q
    q2 = torch.linalg.qr(torch.randn(shape[1], 5, generator=g, dtype=torch.float64)).Q
    dense = q1 @ torch.diag(torch.tensor([3.0, 2.0, 2.0, 2.0, 1e-6], dtype=torch.float64)) @ q2.T  # rank 5
    got = factor(dense)
    assert got.u.shape == (1, 1, 5, shape[0]) and got.v.shape == (1, 1, 5, shape[1])
    assert float((got.dense()[0, 0] - dense).abs().max()) <= 1e-14 * 3
    s = torch.linalg.svdvals(dense)[:5]
    assert float((got.u[0, 0].norm(dim=-1) - s).abs().max()) <= 1e-13 * 3
    v = got.v[0, 0]
    assert float((v @ v.T - torch.eye(5, dtype=torch.float64)).abs().max()) <= 1e-9


@pytest.mark.parametrize(("p", "decay"), [(200, 1), (200, 3), (600, 2)])
def test_the_estimated_condition_number_is_a_close_lower_bound(p, decay):
    """The feature-space solve reports the condition number from power iterations (no eigendecomposition
    on the fast path): within 2% of the exact one, never above it."""
    g = torch.Generator().manual_seed(p)
    x = torch.randn(3000, p, generator=g, dtype=torch.float64) * torch.logspace(0, -decay, p, dtype=torch.float64)
    x = x @ torch.linalg.qr(torch.randn(p, p, generator=g, dtype=torch.float64)).Q  # no axis-aligned spectrum
    y = x[:, :3] + 0.1
    exact = torch.linalg.eigvalsh(x.T @ x / 3000 + 1e-4 * torch.eye(p, dtype=torch.float64))
    _, rank, cond, _, _ = solve(_sums(x, y, 1000), 1e-4, False, "test")
    assert rank == p and 0.98 <= cond / float(exact[-1] / exact[0]) <= 1 + 1e-9


@pytest.mark.parametrize("intercept", [False, True])
def test_the_residual_from_the_solved_system_equals_the_written_out_one(intercept):
    x, y = _problem(11, 80, 12, 3, intercept)
    acc = _sums(x, y, 30).gram()
    a, _, _, lam, _ = solve(acc, 0.05, intercept, "test")
    want = float((x @ a.T - y).norm() / y.norm())
    assert abs(residual(acc, a, lam, intercept) - want) <= 1e-7 and abs(residual(acc, a) - want) <= 1e-7
    assert abs(residual(acc, a, lam, not intercept) - want) > 1e-4  # the penalty term is there
