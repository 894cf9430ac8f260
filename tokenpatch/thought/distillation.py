"""Context distillation: the gradient baseline of the thought patch (``docs/thought-patches.md``).

The same parameters the thought patch updates are trained by Adam so that the model *without*
the prompt reproduces the model's outputs *with* it on the calibration inputs:

    min_dW  mean_j |f(q_j; W + dW) - f([prompt, q_j]; W)|^2

optionally starting from a closed-form thought patch (``init``) and optionally with every matrix
delta kept at rank ``k`` (factors trained, ``dW = U V^T``). What the closed form gets in one
streamed pass, this gets by iterating; ``tokenpatch reproduce`` sets the two side by side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch import files
from tokenpatch.arch import adapter_for
from tokenpatch.deprecation import renamed_keywords
from tokenpatch.dynamics.finetuning import finetuned
from tokenpatch.errors import InputError
from tokenpatch.patch import Patch
from tokenpatch.progress import progress_bar
from tokenpatch.thought.front import ThoughtPatch
from tokenpatch.thought.lstsq import factor

__all__ = ["Distilled", "distill"]


@dataclass(frozen=True)
class Distilled:
    """``patch``: the trained static patch (lead ``[1, 1]``); ``losses [steps + 1]``: the calibration
    MSE to the with-prompt outputs before each step and after the last; ``seconds``: wall time."""

    patch: Patch
    losses: Tensor
    seconds: float


@renamed_keywords(queries="calibration")
def distill(
    model: nn.Module,
    prompt: Tensor,
    calibration: Tensor,
    names: list[str],
    *,
    steps: int = 200,
    lr: float = 1e-3,
    rank: int | None = None,
    init: ThoughtPatch | Patch | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> Distilled:
    """Train deltas of parameters ``names`` (e.g. ``list(fit.patch)`` of a thought patch) by full-batch
    Adam so the no-prompt model on ``calibration [m, T_q, ...]`` (inputs each read after the prompt;
    ``queries=`` is the 0.2 name) matches the with-prompt outputs.
    ``rank``: train rank-``rank`` factors of every matrix delta instead of full matrices (random
    small init, seeded). ``init``: start from this patch (its matrices are used in full)."""
    t0 = time.perf_counter()
    adapter = adapter_for(model)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be an int >= 1, got {steps!r}")
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing or not names:
        raise InputError(f"names must be parameters of the model, got unknown {missing or names}")
    prompt = adapter.check_inputs(model, prompt if prompt.ndim == 3 else prompt[None])
    calibration = adapter.check_inputs(model, calibration)
    with torch.no_grad():
        target = adapter.run(model, torch.cat([prompt.expand(calibration.shape[0], -1, -1), calibration], 1))[0][
            :, prompt.shape[1] :
        ]
    init = init.patch if isinstance(init, ThoughtPatch) else init
    g = torch.Generator().manual_seed(seed)
    leaves: dict[str, tuple[Tensor, ...]] = {}
    for n in names:
        p = params[n].detach()
        start = torch.zeros_like(p) if init is None or n not in init else _dense(init[n]).reshape(p.shape).to(p)
        if rank is not None and p.ndim == 2:  # dW = start + U V^T, U small random, V zero: starts at `start`
            u = (torch.randn(p.shape[0], rank, generator=g, dtype=p.dtype) / p.shape[1] ** 0.5).requires_grad_(True)
            leaves[n] = (start, u, torch.zeros(rank, p.shape[1], dtype=p.dtype, requires_grad=True))
        else:
            leaves[n] = (start.clone().requires_grad_(True),)
    trained = [t for ts in leaves.values() for t in ts if t.requires_grad]
    opt = torch.optim.Adam(trained, lr=lr)

    def deltas() -> dict[str, Tensor]:
        return {n: (ts[0] + ts[1] @ ts[2] if len(ts) == 3 else ts[0])[None] for n, ts in leaves.items()}

    losses = []
    for _ in progress_bar(range(steps + 1), progress, desc="distill", unit="step"):
        with finetuned(model, deltas()):
            loss = ((adapter.run(model, calibration)[0] - target) ** 2).mean()
        losses.append(loss.detach())
        if len(losses) > steps:
            break
        for t, grad in zip(trained, torch.autograd.grad(loss, trained)):  # the model's own .grad untouched
            t.grad = grad
        opt.step()
    with torch.no_grad():
        patch = Patch(
            {n: factor(d[0].double()).to(params[n].dtype) if d.ndim == 3 else d[None] for n, d in deltas().items()},
            None,
            {
                "model": {**adapter.describe(model), "fingerprint": files.fingerprint(model)},
                "distill": {"steps": steps, "lr": lr, "rank": rank},
            },
            static=True,
        )
    return Distilled(patch, torch.stack(losses), time.perf_counter() - t0)


def _dense(d) -> Tensor:
    return dl.dense(d)[0, 0]
