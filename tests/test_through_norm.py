"""The output side through a post-MLP norm (``tokenpatch.thought.through_norm``): each Gauss-Newton
step is the exact Gauss-Newton step of the stated objective (written out with autograd), and on a
tiny Gemma 3 the steps lower the error of the norm's output at every layer and bring the patched
model closer to the prompted one, on the calibration queries and on fresh ones."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp
from tokenpatch.thought import through_norm

pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import build, ids  # noqa: E402


def _problem(n: int, d: int, d_hidden: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    h, p, y = r(n, d_hidden), r(n, d), r(n, d)
    gain = 1 + 0.5 * r(d)
    return h, p, y, 0.1 * r(d, d_hidden), gain


def _objective(h, p, y, gain, eps, lam, g):
    """``F(dW) = 1/(n kappa) sum_n |g unit(p_n + dW h_n) - y_n|^2 + lambda |dW|^2`` as written in the module docstring."""
    s0 = p.square().mean(-1, keepdim=True).add(eps).sqrt()
    kappa = (gain.square()[None] / s0.square()).mean()

    def residual(dw):  # [n * d]  the error, scaled so that F = |residual|^2 + lambda |dW|^2
        x = p + h @ dw.T
        unit = x / x.square().mean(-1, keepdim=True).add(eps).sqrt()
        return ((g * unit - y) / (h.shape[0] * kappa).sqrt()).reshape(-1)

    return residual, lambda dw: residual(dw).square().sum() + lam * dw.square().sum()


@pytest.mark.parametrize(("n", "d_hidden"), [(6, 9), (12, 5)])  # fewer positions than features, and more
def test_a_step_is_the_gauss_newton_step_of_the_stated_objective(n, d_hidden):
    """One step from ``dW``: ``(J^T J + lambda) Delta = -(J^T r + lambda dW)``, with ``J`` the autograd
    Jacobian of the scaled error; the norm's scale is held during the step (float64, 1e-10)."""
    d, eps, lam = 4, 1e-6, 0.05
    h, p, y, dw, gain = _problem(n, d, d_hidden)
    g = gain * 1.3
    residual, loss = _objective(h, p, y, gain, eps, lam, g)
    jac = torch.autograd.functional.jacobian(residual, dw).reshape(n * d, -1)  # [n d, d d_hidden]
    lhs = jac.T @ jac + lam * torch.eye(jac.shape[1], dtype=torch.float64)
    step = torch.linalg.solve(lhs, -(jac.T @ residual(dw) + lam * dw.reshape(-1))).reshape(d, d_hidden)
    assert loss(dw + step) < loss(dw)  # the full step is taken: no halving
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(through_norm, "CG_TOL", 1e-15)
        got, errors = through_norm.refine(h, p, y, dw, g, gain, eps, lam, steps=1)
    assert float((got - (dw + step)).abs().max()) <= 1e-10 * float(step.abs().max())
    assert len(errors) == 2


def test_the_steps_lower_the_objective_and_stop_where_it_no_longer_falls():
    d, eps, lam = 5, 1e-6, 0.01
    h, p, y, dw, gain = _problem(30, d, 8, seed=3)
    u = p + h @ dw.T
    u = u / u.square().mean(-1, keepdim=True).add(eps).sqrt()
    g = through_norm.best_scale((u * y).sum(0), u.square().sum(0), gain)
    losses = []
    for steps in (0, 1, 2, 4):
        got, errors = through_norm.refine(h, p, y, dw, g, gain, eps, lam, steps=steps)
        losses.append(float(_objective(h, p, y, gain, eps, lam, g)[1](got)))
        assert len(errors) <= steps + 1
    assert losses[1] < losses[0] and losses[-1] <= losses[1] * (1 + 1e-12)


@torch.no_grad()
@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")
def test_gauss_newton_through_gemmas_norm_brings_the_patch_closer_to_the_prompt(float64_gemma_norms):
    """A tiny Gemma 3, 40 queries: with ``norm_steps`` the error of every post-MLP norm's output falls
    (``fits``' ``norm_error``), and the patched model's logits move closer to the prompted ones on the
    calibration queries and on fresh queries."""
    model = build("gemma3")
    prompt, cal, fresh = ids(1, 10, seed=20)[0], ids(40, 4, seed=21), ids(20, 4, seed=23)

    def error(patch, q):
        want = model(torch.cat([prompt.expand(q.shape[0], -1), q], 1)).logits[:, prompt.shape[0] :]
        return float((tp.functional_call(model, patch, q).logits - want).square().mean())

    closed = tp.thought_patch(model, prompt, cal, ridge=1e-3)
    refined = tp.thought_patch(model, prompt, cal, ridge=1e-3, norm_steps=2)
    assert all(f.norm_steps is None for f in closed.fits)
    for f in refined.fits:
        assert f.norm_steps >= 1 and f.norm_error[-1] < f.norm_error[0]
    assert refined.patch.meta["thought"]["norm_steps"] == 2
    for q in (cal, fresh):
        assert error(refined.patch, q) < 0.9 * error(closed.patch, q)


def test_norm_steps_are_checked():
    model = build("gemma3")
    with pytest.raises(tp.InputError, match="norm_steps must be an int >= 0"):
        tp.thought_patch(model, ids(1, 5)[0], ids(2, 2), norm_steps=-1)
    with pytest.raises(tp.InputError, match="norm_steps > 0 needs every calibration position in one process"):
        tp.thought_patch(model, ids(1, 5)[0], ids(2, 2), norm_steps=1, distributed=True)
    # a model without a norm after its MLP: the steps have nothing to refine, the fit is the same
    small = tp.ICLTransformer(tp.ICLConfig(d_in=3, d_model=4, n_layers=1, n_heads=1)).double().eval()
    prompt, queries = torch.randn(4, 3, dtype=torch.float64), torch.randn(2, 1, 3, dtype=torch.float64)
    plain, stepped = (tp.thought_patch(small, prompt, queries, norm_steps=k).patch for k in (0, 1))
    assert set(plain) == set(stepped)
    assert all(torch.equal(tp.deltas.dense(plain[k]), tp.deltas.dense(stepped[k])) for k in plain)
