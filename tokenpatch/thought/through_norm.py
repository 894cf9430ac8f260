"""The output side through a post-MLP norm (Gemma 2/3), refined by Gauss-Newton on the output itself.

A layer with a norm after its MLP adds ``g * unit(p)`` to the stream, ``p = W h'`` the output
matrix's output (``h'``: the MLP's hidden features under the input change) and ``unit(x) = x /
sqrt(mean x^2 + eps)``. The closed form (``arch.outputs.norm_target``, ``fit_scale``) aims ``p`` at the
direction the norm must output, in the norm's *input* space, then fits the scale per channel. It
weighs every channel of that direction alike, whatever its scale ``g_c``, and cannot use the
freedom of ``p``'s length. Here ``dW`` and then ``g'`` are refined on the error the layer actually
makes, in the norm's *output* space:

    F(dW) = 1/(n kappa) sum_n |g' * unit(p_n + dW h_n) - y_n|^2 + lambda |dW|_F^2

``y_n = out_C - m_0`` (what the MLP must add at position ``n``) and ``kappa = mean_{n,c} (g_c /
s_n)^2``, ``s_n = sqrt(mean p_n^2 + eps)``: near ``p``, a change ``delta`` of the norm's input
moves its output by ``g * J_n delta``, ``J_n = (I - u_n u_n^T / d) / s_n`` (``u_n = unit(p_n)``, so
``|u_n|^2 = d`` up to ``eps``), about ``kappa`` times ``|delta|^2`` in square, so ``lambda`` keeps
the meaning it has in the closed form's input-space objective (the same ridge serves both).

Each step linearises ``unit`` at the current ``p~_n = p_n + dW h_n`` (Gauss-Newton) and solves

    (L^T L / (n kappa) + lambda I) Delta = -(L^T r / (n kappa) + lambda dW)       L Delta = [g' * J~_n Delta h_n]_n

by conjugate gradients, preconditioned by the same system without the projections (one
eigendecomposition, a per-channel ridge), then halves the step until ``F`` decreases (at most
``HALVINGS`` times; no decrease: stop), then refits ``g'`` per channel on the new directions (the
exact minimiser over ``g'``, ``fit_scale``'s formula): every step lowers ``F``. ``dW`` lives in the
row space of the hidden features, which the ridge solution of the closed form already does, so the
unknowns are ``d x min(n, d_hidden)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

HALVINGS = 6  # step halvings tried before a Gauss-Newton step is given up
CG_STEPS = 30  # conjugate-gradient iterations per step, at most
CG_TOL = 1e-6  # relative residual at which the conjugate gradients stop


def refine(
    h: Tensor, p: Tensor, y: Tensor, dw: Tensor, g: Tensor, gain: Tensor, eps: float, lam: float, steps: int
) -> tuple[Tensor, list[float]]:
    """``steps`` Gauss-Newton steps from the closed form (module docstring), all float64.

    ``h [n, d_hidden]`` the hidden features, ``p [n, d]`` the norm's input before the output change,
    ``y [n, d]`` its wanted output, ``dw [d, d_hidden]`` the closed form's output-matrix change, ``g
    [d]`` the scale fitted on it, ``gain [d]`` the model's own scale (``kappa`` is taken with it).
    Returns ``(dW, [the relative output error |g' unit(p~) - y|_F / |y|_F at the closed form and
    after each step])``; the caller fits the final scale on the returned ``dW``."""
    n = h.shape[0]
    q = torch.linalg.qr(h.T).Q if n < h.shape[1] else None  # [d_hidden, n]  the hidden features' row space
    z = h @ q if q is not None else h  # [n, k]
    a = dw @ q if q is not None else dw.clone()  # [d, k]
    scale = 1.0 / (n * float((gain.square()[None] / _rms(p, eps).square()).mean()))  # 1 / (n kappa)
    y_norm = float(y.norm()) or 1.0
    u, s = _unit(p + z @ a.T, eps)
    errors = [float((g * u - y).norm()) / y_norm]
    for _ in range(steps):
        loss = scale * (g * u - y).square().sum() + lam * a.square().sum()
        step = _gauss_newton(z, u, s, g * u - y, g, a, scale, lam)
        for _ in range(HALVINGS):
            trial = a + step
            u_t, s_t = _unit(p + z @ trial.T, eps)
            if scale * (g * u_t - y).square().sum() + lam * trial.square().sum() < loss:
                break
            step = step / 2
        else:
            break
        a, u, s = trial, u_t, s_t
        g = best_scale((u * y).sum(0), u.square().sum(0), g)  # the exact minimiser over g' on the new directions
        errors.append(float((g * u - y).norm()) / y_norm)
    return (a @ q.T if q is not None else a), errors


def best_scale(uy: Tensor, uu: Tensor, g: Tensor) -> Tensor:
    """Per channel ``argmin_g' sum_n (g' u_nc - y_nc)^2 = sum_n u_nc y_nc / sum_n u_nc^2`` from those
    two sums ``[d]``; a channel no row reaches keeps ``g``."""
    return torch.where(uu > 0, uy / uu.where(uu > 0, 1), g)


def _gauss_newton(z: Tensor, u: Tensor, s: Tensor, r: Tensor, g: Tensor, a: Tensor, scale: float, lam: float) -> Tensor:
    """The Gauss-Newton step ``Delta [d, k]`` by preconditioned conjugate gradients."""
    d = u.shape[1]

    def jac(v: Tensor) -> Tensor:  # J_n v_n for every row, J symmetric: [n, d]
        return (v - u * (u * v).sum(1, keepdim=True) / d) / s

    def normal(delta: Tensor) -> Tensor:  # (L^T L / (n kappa) + lambda) delta
        return scale * jac(g.square() * jac(z @ delta.T)).T @ z + lam * delta

    e, v = torch.linalg.eigh(z.T @ (z / s.square()))  # [k], [k, k]  the preconditioner's Gram, no projections
    denom = scale * g.square()[:, None] * e.clamp_min(0)[None] + lam  # [d, k]  per channel and eigendirection

    def precondition(res: Tensor) -> Tensor:
        return ((res @ v) / denom.clamp_min(1e-300)) @ v.T

    b = -(scale * jac(g * r).T @ z + lam * a)  # [d, k]  minus the gradient of F / 2
    x = torch.zeros_like(b)
    res = b.clone()
    w = precondition(res)
    direction, rho = w, (res * w).sum()
    b_norm = float(b.norm())
    for _ in range(CG_STEPS):
        if float(res.norm()) <= CG_TOL * b_norm:  # (at once where F is already stationary: no step)
            break
        ad = normal(direction)
        curvature = (direction * ad).sum()
        if not curvature > 0:  # a direction the objective is flat along (ridge 0): stop there
            break
        alpha = rho / curvature
        x, res = x + alpha * direction, res - alpha * ad
        w = precondition(res)
        rho, rho_old = (res * w).sum(), rho
        direction = w + (rho / rho_old) * direction
    return x


def _rms(x: Tensor, eps: float) -> Tensor:
    return x.square().mean(-1, keepdim=True).add(eps).sqrt()


def _unit(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = _rms(x, eps)
    return x / s, s
