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
Gaussian matrix (``~ +-1/sqrt(rows cols)``, drawn from the cosine's distribution); another sequence's gradient of its own example ``i``
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
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch import offload
from tokenpatch.arch import weight_layout
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.dynamics.diagnostics import cosine, rank1_ceiling
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
    becomes ``W D`` on each matrix reading it (``D = sum_k d_k v_k^T``: factors ``W d_k``, ``v_k``; ``W``
    read through ``offload.value``, an ``accelerate``-offloaded one being on ``meta``)."""
    out: dict[str, LowRank] = {}
    for key, delta in patch.items():
        if key.endswith(INPUT_SUFFIX):
            for reader, layout in patch.readers.get(key, ()):
                w = offload.value(model, reader).detach().to(delta.u.device, delta.dtype)
                wd = delta.u @ (w.T if layout == "out_in" else w)  # [*lead, k, out]: W d_k
                out[reader] = LowRank(wd, delta.v) if layout == "out_in" else LowRank(delta.v, wd)
        elif dl.is_lowrank(delta):
            out[key] = delta
    return out


def _contexts(model: nn.Module, patch: Patch | None, deltas: dict) -> contextlib.ExitStack:
    """``patch`` and ``deltas`` on hooks. The patch's matrices go on as weight deltas (``matrix_deltas``: a
    change of a module's input as ``W D`` on each matrix reading it), so every matrix reads its own,
    unchanged input; its other deltas (biases, norm scales) through its own hooks."""
    stack = contextlib.ExitStack()
    if patch is not None:
        patch.check_model(model)
        if patch.lead[1] != 1:
            raise InputError(f"a patch of one query per run is needed, lead [R, 1]; got {list(patch.lead)}")
        rest = {k: d for k, d in patch.items() if not k.endswith(INPUT_SUFFIX) and not dl.is_lowrank(d)}
        if rest:
            stack.enter_context(hooked(model, patch.replace(deltas=rest), broadcast=False, any_length=True))
        weights = {n: d.index((slice(None), 0)) for n, d in matrix_deltas(model, patch).items()}  # lead [R]
        stack.enter_context(finetuned(model, weights))
    if deltas:
        stack.enter_context(finetuned(model, deltas))
    return stack


def _matrices(model: nn.Module, names: Sequence[str]) -> dict[str, tuple[nn.Module, str]]:
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        module_name, _, attr = name.rpartition(".")
        if name not in params or attr != "weight" or params[name].ndim != 2:
            raise InputError(f"{name} is not the weight matrix of a module of this model")
        module = model.get_submodule(module_name)
        out[name] = (module, weight_layout(module, module_name))
    return out


def gradient_at(
    model: nn.Module,
    loss: Loss,
    i: int,
    names: Sequence[str],
    *,
    patch: Patch | None = None,
    deltas: dict[str, Tensor | LowRank] | None = None,
) -> dict[str, LowRank]:
    """``grad_W L_i`` at ``W + patch + deltas`` for each matrix of ``names``, per run, in factors.

    For a matrix read as ``y_t = W x_t`` at positions ``t``, ``grad_W L = sum_t delta_t x_t^T`` with
    ``delta_t = dL/dy_t``: a ``LowRank`` with lead ``[R]`` and one rank per position of the run's
    sequences (``u = delta``, ``v = x`` in the ``[out, in]`` layout), never a dense matrix. The patch's
    matrices run as weight deltas (a change of a module's input ``s -> s + D s`` as the weight ``W + W D``
    reading ``s``), so ``x`` is the input of the matrix at the shifted weights. ``delta`` is the gradient of a zero added to the output. ``patch`` (lead ``[R, 1]``):
    run ``r`` under its own patch, every delta of it; ``deltas``: ``name -> [R, *W.shape]`` dense
    changes or ``LowRank`` ones with lead ``[R]`` (``finetuned``). The runs do not mix: ``loss(i)``
    is ``[R]``, a sum of per-run losses, over ``R * k`` sequences, run-major."""
    mods = _matrices(model, names)
    inputs: dict[str, list[Tensor]] = {n: [] for n in names}
    probes: dict[str, list[Tensor]] = {n: [] for n in names}

    def reads(n: str):
        return lambda module, args: inputs[n].append(args[0].detach())

    def writes(n: str):
        def hook(module, args, out):
            zero = torch.zeros_like(out, requires_grad=True)
            probes[n].append(zero)
            return out + zero

        return hook

    pairs = [(m.register_forward_pre_hook, reads(n)) for n, (m, _) in mods.items()]
    pairs += [(m.register_forward_hook, writes(n)) for n, (m, _) in mods.items()]
    with registered_hooks(pairs), _contexts(model, patch, dict(deltas or {})), torch.enable_grad():
        value = loss(i)  # the recording hooks were registered first: they see each matrix's own input
        runs = value.shape[0] if value.ndim == 1 else 0
        if not runs or not value.requires_grad:
            raise InputError(f"loss({i}) must return one differentiable loss per run, [R]; got {tuple(value.shape)}")
        flat = [p for n in names for p in probes[n]]
        grads = iter(torch.autograd.grad(value.sum(), flat, allow_unused=True))
    out = {}
    for n, (_, layout) in mods.items():
        if not inputs[n]:
            raise InputError(f"loss({i}) never ran {n}")
        d, x = [], []
        for xi, p in zip(inputs[n], probes[n]):
            g = next(grads)
            g = torch.zeros_like(p) if g is None else g
            if xi.shape[0] % runs:
                raise InputError(f"{n}: a batch of {xi.shape[0]} sequences is not {runs} runs of equal size")
            d.append(g.reshape(runs, -1, g.shape[-1]))  # [R, k*T, out]
            x.append(xi.reshape(runs, -1, xi.shape[-1]))  # [R, k*T, in]
        d, x = torch.cat(d, 1), torch.cat(x, 1)
        out[n] = LowRank(d, x) if layout == "out_in" else LowRank(x, d)
    return out


def online_sgd(
    model: nn.Module, loss: Loss, n: int, names: Sequence[str], lr: float, order: Sequence[int] | None = None
) -> Iterator[tuple[dict[str, LowRank], dict[str, LowRank]]]:
    """Online SGD, batch 1, one pass: yields ``(g_i, D_i)`` for ``i = 1..n`` with ``g_i = grad L_k(W + D_{i-1})``
    (``k = order[i - 1]``, default ``i - 1``: context order) and ``D_i = D_{i-1} - lr g_i``, each
    ``name -> LowRank`` with lead ``[R]`` (``D_i``: the factors of every step so far). Plain
    ``torch.optim.SGD`` (no momentum, no decay) on the ``R`` copies of those matrices, one example per step."""
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0):
        raise InputError(f"lr must be a positive number, got {lr!r}")
    order = list(range(n)) if order is None else list(order)
    d: dict[str, LowRank] = {}
    for k in order:
        g = gradient_at(model, loss, k, names, deltas=d)
        step = {nm: LowRank(-lr * t.u, t.v) for nm, t in g.items()}
        d = {nm: d[nm] + step[nm] if nm in d else step[nm] for nm in names}
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


def _random_cosine(runs: int, size: int, generator: torch.Generator | None) -> Tensor:
    """``cos(S, G)`` of a fixed nonzero matrix ``S`` with ``G`` of ``size`` i.i.d. standard normal entries,
    drawn from its distribution: ``<S, G> ~ N(0, |S|_F^2)`` and ``|G|_F^2 ~ chi^2_size`` independently
    of it (rotation invariance), so ``cos = z / sqrt(chi^2_size)`` whatever ``S`` is -> ``[runs]``,
    without drawing ``size`` numbers per matrix (NumPy's chi-square, seeded from ``generator``)."""
    z = torch.randn(runs, generator=generator, dtype=torch.float64)
    rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=generator)))
    return z / torch.from_numpy(rng.chisquare(size, runs)).sqrt()


def _neg(d: LowRank) -> LowRank:
    return LowRank(-d.u, d.v)


def _roll(d: LowRank) -> LowRank:
    """Run ``b`` gets run ``b - 1``'s matrix."""
    return LowRank(d.u.roll(1, 0), d.v.roll(1, 0))


def online_alignment(
    model: nn.Module,
    patches: Sequence[Patch],
    loss: Loss,
    *,
    lrs: Sequence[float],
    names: Sequence[str] | None = None,
    heldout: Callable[[], Tensor] | None = None,
    ceiling_steps: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> OnlineAlignment:
    """Implicit steps against explicit gradients and online SGD (module docstring).

    ``patches``: the implicit weights ``dW_0 .. dW_N``, each a ``Patch`` with lead ``[R, 1]``
    (``[traj.patch(i) for i in range(N + 1)]``, ``dW_0 = 0``; on a language model whose query has tokens
    before the one the patch is anchored at, ``dW_0`` is theirs, and the trajectory is compared as
    ``dW_i - dW_0``); ``loss(i)``: example ``i``'s
    (0-based, ``i < N``) loss for every run, ``[R]``; ``lrs``: the online-SGD learning rates;
    ``names``: the matrices compared (default: every one the patches change, ``matrix_deltas``);
    ``heldout()``: a loss ``[R]`` on held-out data, read under ``W + D_i`` for every ``i`` and rate;
    ``ceiling_steps``: the steps ``i`` (1-based) whose ceiling is computed (an SVD per matrix and run;
    default all, NaN elsewhere); ``generator``: for the permutation and the random matrices."""
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
    step = {nm: [dw[nm][i] + _neg(dw[nm][i - 1]) for i in range(1, n + 1)] for nm in names}
    # dW_i - dW_0: what the examples moved (dW_0 is the query's own context, zero when it has none)
    moved = {nm: [dw[nm][i] + _neg(dw[nm][0]) for i in range(1, n + 1)] for nm in names}
    order = derangement(n, generator)
    if ceiling_steps is not None and not set(ceiling_steps) <= set(range(1, n + 1)):
        raise InputError(f"ceiling_steps must be steps in 1..{n}, got {list(ceiling_steps)}")

    cos: dict[str, list[Tensor]] = {k: [] for k in ("gradient", "gradient_shuffled", "gradient_other_run", "random")}
    for i in progress_bar(range(n), progress, desc="online gradients", unit="step"):  # each gradient used, then freed
        g = gradient_at(model, loss, i, names, patch=patches[i])
        cos["gradient"].append(torch.stack([cosine(step[nm][i], _neg(g[nm])) for nm in names], -1))  # [R, M]
        cos["gradient_other_run"].append(torch.stack([cosine(step[nm][i], _neg(_roll(g[nm]))) for nm in names], -1))
        cos["random"].append(torch.stack([_random_cosine(runs, math.prod(g[nm].shape), generator) for nm in names], -1))
        del g
        g = gradient_at(model, loss, order[i], names, patch=patches[i])
        cos["gradient_shuffled"].append(torch.stack([cosine(step[nm][i], _neg(g[nm])) for nm in names], -1))
        del g
    out = {k: torch.stack(v, 1) for k, v in cos.items()}  # [R, N, M]
    sgd: dict[str, list[Tensor]] = {k: [] for k in ("step", "weights", "ceiling", "sh_step", "sh_weights", "heldout")}
    for lr in progress_bar(list(lrs), progress, desc="online SGD", unit="rate"):
        for prefix, pi in (("", None), ("sh_", order)):
            cos_step, cos_w, ceil, held = [], [], [], []
            if heldout is not None and not prefix:
                with torch.no_grad():
                    held.append(heldout())
            for g, d in online_sgd(model, loss, n, names, lr, pi):
                j = len(cos_step)
                cos_step.append(torch.stack([cosine(step[nm][j], _neg(g[nm])) for nm in names], -1))  # [R, M]
                cos_w.append(torch.stack([cosine(moved[nm][j], d[nm]) for nm in names], -1))
                if not prefix:
                    ceil.append(
                        torch.stack([rank1_ceiling(d[nm]) for nm in names], -1)
                        if ceiling_steps is None or j + 1 in ceiling_steps
                        else torch.full((runs, len(names)), math.nan, dtype=torch.float64)
                    )
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
