"""Implicit against explicit gradients, step by step: the protocol of *Learning without training*.

A context of examples ``c_1..c_N`` before a query ``x``; prefix ``i`` reads ``c_1..c_i``. The
implicit weights after ``i`` examples are ``W + dW_i`` (the token patch of prefix ``i``, anchored at
the query; ``dW_0 = 0``), so consuming example ``i`` is the implicit step

    S_i = dW_i - dW_{i-1}                                   (rank <= 2, from the factors)

The explicit counterparts train the same matrices on the same examples without a context, each
example a no-context training sequence with its own loss ``L_i`` (the caller's ``loss(i)``: for
linear regression ``(y_hat([x_i; 0]) - y_i)^2``, for a word pair the answer tokens' cross-entropy):

* (a) the online gradient ``g_i = grad_W L_i(W + dW_{i-1})``: example ``i``'s gradient at the
  implicit weights before it (the whole patch of prefix ``i - 1`` applied, every layer);
* (b) online SGD, batch 1, one pass in context order: ``D_i = D_{i-1} - lr grad_W L_i(W + D_{i-1})``,
  ``D_0 = 0``, its step ``D_i - D_{i-1}`` and its weights ``W + D_i``.

Per matrix, step and sequence: ``cos(S_i, -g_i)``, ``cos(S_i, D_i - D_{i-1})`` (the paper's "implicit
and explicit gradients") and ``cos(dW_i, D_i)`` (the whole trajectory) with its ceiling
``s_1(D_i) / |D_i|_F``, the largest cosine a rank-1 matrix can have with ``D_i``. Controls: a random
Gaussian matrix (``~ +-1/sqrt(rows cols)``); another sequence's gradient of its own example ``i``
(run ``b - 1``); the gradient of another example of the same context (a fixed permutation ``pi``
of ``1..N`` without fixed points: ``-grad L_pi(i)`` at the same weights); online SGD over the
examples in the order ``pi``. ``cos`` is the normalised Frobenius inner product
(``diagnostics.cosine``).

Runs: ``R`` sequences at once, run ``r`` with its own patches and its own SGD weights; ``loss(i)``
runs example ``i`` of every run as ``R`` sequences (run-major) and returns ``[R]``. Extra weights
ride on hooks (``finetuned``, the patch's own): the model is never written to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenpatch.dynamics.diagnostics import cosine
from tokenpatch.dynamics.finetuning import finetuned
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank
from tokenpatch.patch import INPUT_SUFFIX, Patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import hooked

__all__ = ["OnlineAlignment", "online_alignment", "online_sgd", "gradient_at", "matrix_deltas", "derangement"]

Loss = Callable[[int], Tensor]  # example index (0-based) -> each run's loss [R], run under the active hooks


def matrix_deltas(model: nn.Module, patch: Patch) -> dict[str, LowRank]:
    """Every weight matrix the patch changes, as a ``LowRank`` in the parameter's stored layout (lead as
    the patch's): low-rank weight deltas as they are; a change of a module's input ``s -> s + D s``
    becomes ``W D`` on each matrix reading it (``D = sum_k d_k v_k^T``: factors ``W d_k``, ``v_k``)."""
    params = dict(model.named_parameters())
    out: dict[str, LowRank] = {}
    for key, delta in patch.items():
        if key.endswith(INPUT_SUFFIX):
            for reader, layout in patch.readers.get(key, ()):
                w = params[reader].detach().to(delta.dtype)
                wd = delta.u @ (w.T if layout == "out_in" else w)  # [*lead, k, out]: W d_k
                out[reader] = LowRank(wd, delta.v) if layout == "out_in" else LowRank(delta.v, wd)
        elif isinstance(delta, LowRank):
            out[key] = delta
    return out


def _contexts(model: nn.Module, patch: Patch | None, deltas: dict[str, Tensor]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    if patch is not None:
        patch.check_model(model)
        stack.enter_context(hooked(model, patch, broadcast=False, any_length=True))
    stack.enter_context(finetuned(model, deltas))
    return stack


def gradient_at(
    model: nn.Module,
    loss: Loss,
    i: int,
    names: Sequence[str],
    *,
    patch: Patch | None = None,
    deltas: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """``grad_W L_i`` at ``W + patch + deltas`` for each matrix of ``names``, per run: ``[R, *W.shape]``.

    ``patch`` (lead ``[R, 1]``): run ``r`` under its own patch, every delta of it; ``deltas``:
    ``name -> [R, *W.shape]`` dense changes. The gradient is taken on zero leaves added by hooks
    (``finetuned``), so it is the gradient at the shifted weights; runs do not mix (the loss is a
    sum of per-run losses)."""
    params = dict(model.named_parameters())
    deltas = dict(deltas or {})
    runs = {t.shape[0] for t in deltas.values()} | ({patch.lead[0]} if patch is not None else set())
    if len(runs) != 1:
        raise InputError(f"gradient_at needs the number of runs from a patch or deltas that agree, got {sorted(runs)}")
    r = runs.pop()
    leaves = {n: torch.zeros(r, *params[n].shape, dtype=params[n].dtype, device=params[n].device) for n in names}
    for n, leaf in leaves.items():
        if n in deltas:
            leaf += deltas.pop(n).detach()
        leaf.requires_grad_(True)
    with _contexts(model, patch, {**leaves, **deltas}), torch.enable_grad():
        value = loss(i)
        if value.shape != (r,):
            raise InputError(f"loss({i}) must return one loss per run, [{r}]; got {tuple(value.shape)}")
        grads = torch.autograd.grad(value.sum(), list(leaves.values()), allow_unused=True)
    return {n: torch.zeros_like(leaf) if g is None else g for (n, leaf), g in zip(leaves.items(), grads)}


def online_sgd(
    model: nn.Module, loss: Loss, n: int, names: Sequence[str], runs: int, lr: float, order: Sequence[int] | None = None
) -> Iterator[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """Online SGD, batch 1, one pass: yields ``(g_i, D_i)`` for ``i = 1..n`` with ``g_i = grad L_k(W + D_{i-1})``
    (``k = order[i - 1]``, default ``i - 1``: context order) and ``D_i = D_{i-1} - lr g_i``, each
    ``name -> [runs, *W.shape]``. Plain ``torch.optim.SGD`` (no momentum, no decay) on the ``runs``
    copies of those matrices, one example per step."""
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0):
        raise InputError(f"lr must be a positive number, got {lr!r}")
    order = list(range(n)) if order is None else list(order)
    params = dict(model.named_parameters())
    d = {nm: torch.zeros(runs, *params[nm].shape, dtype=params[nm].dtype, device=params[nm].device) for nm in names}
    for k in order:
        g = gradient_at(model, loss, k, names, deltas=d)
        d = {nm: d[nm] - lr * g[nm] for nm in names}
        yield g, d


def derangement(n: int, generator: torch.Generator | None = None) -> list[int]:
    """A random permutation of ``0..n-1`` without fixed points (``n >= 2``): a random shift of a random
    order, so every example is paired with another one."""
    if n < 2:
        raise InputError(f"the shuffled control needs at least 2 examples, got {n}")
    perm = torch.randperm(n, generator=generator).tolist()
    shift = 1 + int(torch.randint(n - 1, (1,), generator=generator))
    out = [0] * n
    for j in range(n):
        out[perm[j]] = perm[(j + shift) % n]
    return out


@dataclass(frozen=True)
class OnlineAlignment:
    """The cosines of ``online_alignment`` (module docstring), ``[R, N, M]`` over runs, steps ``i = 1..N``
    and the matrices ``names``; the SGD ones ``[L, R, N, M]`` over the learning rates ``lrs``.

    ``gradient``: ``cos(S_i, -g_i)``; ``gradient_shuffled``: against ``-grad L_pi(i)`` at the same
    weights; ``gradient_other_run``: against run ``b - 1``'s ``-g_i``; ``random``: against a Gaussian
    matrix. ``sgd_step`` / ``sgd_weights`` / ``sgd_ceiling``: ``cos(S_i, D_i - D_{i-1})``,
    ``cos(dW_i, D_i)``, ``s_1(D_i) / |D_i|_F``; ``shuffled_sgd_*``: the same for SGD in the order ``pi``.
    ``heldout [L, R, N + 1]``: the caller's held-out loss under ``W + D_i`` (``None`` without one).
    ``order``: ``pi`` (0-based)."""

    names: list[str]
    lrs: list[float]
    order: list[int]
    gradient: Tensor
    gradient_shuffled: Tensor
    gradient_other_run: Tensor
    random: Tensor
    sgd_step: Tensor
    sgd_weights: Tensor
    sgd_ceiling: Tensor
    shuffled_sgd_step: Tensor
    shuffled_sgd_weights: Tensor
    heldout: Tensor | None

    def __repr__(self) -> str:
        r, n, m = self.gradient.shape
        return (
            f"OnlineAlignment({r} runs x {n} steps x {m} matrices, lrs {self.lrs}; mean cos(S_i, -g_i) "
            f"{float(self.gradient.mean()):.3f}, random {float(self.random.abs().mean()):.3f})"
        )


def _ceiling(d: Tensor) -> Tensor:
    sv = torch.linalg.svdvals(d.double())  # [R, min(rows, cols)]
    return torch.where(sv[:, 0] > 0, sv[:, 0] / sv.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny), 0.0)


def online_alignment(
    model: nn.Module,
    patches: Sequence[Patch],
    loss: Loss,
    *,
    lrs: Sequence[float],
    names: Sequence[str] | None = None,
    heldout: Callable[[], Tensor] | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> OnlineAlignment:
    """Implicit steps against explicit gradients and online SGD (module docstring).

    ``patches``: the implicit weights ``dW_0 .. dW_N``, each a ``Patch`` with lead ``[R, 1]``
    (``[traj.patch(i) for i in range(N + 1)]``; ``dW_0`` zero); ``loss(i)``: example ``i``'s
    (0-based, ``i < N``) loss for every run, ``[R]``; ``lrs``: the online-SGD learning rates;
    ``names``: the matrices compared (default: every one the patches change, ``matrix_deltas``);
    ``heldout()``: a loss ``[R]`` on held-out data, read under ``W + D_i`` for every ``i`` and rate;
    ``generator``: for the permutation and the random matrices."""
    n = len(patches) - 1
    if n < 2:
        raise InputError(f"online_alignment needs dW_0 .. dW_N with N >= 2 examples, got {len(patches)} patches")
    runs = patches[0].lead[0]
    if runs < 2 or any(p.lead != (runs, 1) for p in patches):
        raise InputError(f"every patch must have lead [R, 1] with the same R >= 2, got {[p.lead for p in patches]}")
    if not lrs:
        raise InputError("lrs lists no learning rate")
    implicit = [matrix_deltas(model, p) for p in patches]
    names = list(names) if names is not None else sorted(implicit[-1])
    missing = [nm for nm in names if nm not in implicit[-1]]
    if missing:
        raise InputError(f"the patches change no matrix {missing}; they change {sorted(implicit[-1])}")
    dw = {nm: [implicit[i][nm].index((slice(None), 0)) for i in range(n + 1)] for nm in names}  # lead [R]
    step = {nm: [dw[nm][i] + LowRank(-dw[nm][i - 1].u, dw[nm][i - 1].v) for i in range(1, n + 1)] for nm in names}
    order = derangement(n, generator)

    def stacked(f) -> Tensor:  # f(name, i) -> [R]  ->  [R, N, M]
        return torch.stack([torch.stack([f(nm, i) for i in range(n)], 1) for nm in names], -1)

    grads, shuffled = [], []
    for i in progress_bar(range(n), progress, desc="online gradients", unit="step"):
        grads.append(gradient_at(model, loss, i, names, patch=patches[i]))
        shuffled.append(gradient_at(model, loss, order[i], names, patch=patches[i]))
    rand = {nm: torch.randn(runs, n, *dw[nm][0].shape, generator=generator, dtype=torch.float64) for nm in names}
    out = {
        "gradient": stacked(lambda nm, i: cosine(step[nm][i], -grads[i][nm])),
        "gradient_shuffled": stacked(lambda nm, i: cosine(step[nm][i], -shuffled[i][nm])),
        "gradient_other_run": stacked(lambda nm, i: cosine(step[nm][i], -grads[i][nm].roll(1, 0))),
        "random": stacked(lambda nm, i: cosine(step[nm][i], rand[nm][:, i])),
    }
    sgd: dict[str, list[Tensor]] = {k: [] for k in ("step", "weights", "ceiling", "sh_step", "sh_weights", "heldout")}
    for lr in progress_bar(list(lrs), progress, desc="online SGD", unit="rate"):
        for prefix, pi in (("", None), ("sh_", order)):
            cos_step, cos_w, ceil, held = [], [], [], []
            if heldout is not None and not prefix:
                with torch.no_grad(), finetuned(model, {}):
                    held.append(heldout())
            for g, d in online_sgd(model, loss, n, names, runs, lr, pi):
                j = len(cos_step)
                cos_step.append(torch.stack([cosine(step[nm][j], -g[nm]) for nm in names], -1))  # [R, M]
                cos_w.append(torch.stack([cosine(dw[nm][j + 1], d[nm]) for nm in names], -1))
                if not prefix:
                    ceil.append(torch.stack([_ceiling(d[nm]) for nm in names], -1))
                    if heldout is not None:
                        with torch.no_grad(), finetuned(model, d):
                            held.append(heldout())
            sgd[prefix + "step"].append(torch.stack(cos_step, 1))
            sgd[prefix + "weights"].append(torch.stack(cos_w, 1))
            if not prefix:
                sgd["ceiling"].append(torch.stack(ceil, 1))
                if heldout is not None:
                    sgd["heldout"].append(torch.stack(held, 1))
    return OnlineAlignment(
        names=names,
        lrs=[float(x) for x in lrs],
        order=order,
        **out,
        sgd_step=torch.stack(sgd["step"]),
        sgd_weights=torch.stack(sgd["weights"]),
        sgd_ceiling=torch.stack(sgd["ceiling"]),
        shuffled_sgd_step=torch.stack(sgd["sh_step"]),
        shuffled_sgd_weights=torch.stack(sgd["sh_weights"]),
        heldout=torch.stack(sgd["heldout"]) if heldout is not None else None,
    )
