"""Explicit fine-tuning on the context's examples: the baseline the implicit update is set beside.

In-context learning reads examples ``(x_1, y_1) .. (x_n, y_n)`` and, by the patch theorem, acts
like a weight update ``dW_ICL`` (the token patch). The explicit counterpart trains the same
weights on the same examples *without* a context: each example becomes a no-context training
sequence (for linear regression the query token ``[x_i; 0]``, target ``y_i``;
``tasks.linreg.training_points``), and SGD or Adam updates exactly the parameters the patch
touches (the matrices reading the MLP input, ``Sites.inputs``; with ``output=True`` also the
output-side site), of every layer or of chosen ones. The result is ``dW_FT = W_after - W``.

Every run ``b`` of a batch fine-tunes its own copy of those parameters on its own examples: the
deltas are ``[B, *param.shape]`` leaves, added in the forward by hooks (``finetuned``), so ``B``
tasks train in one batched pass, the model is never written to, and the runs stay independent
(the loss is a sum of per-run losses; SGD and Adam update elementwise). With ``B`` runs each of
``n`` examples, the input batch is ``B * n`` sequences, run-major.

Comparisons (``docs/dynamics.md``): ``diagnostics.cosine(dW_ICL, dW_FT)`` per layer, the
normalised Frobenius inner product ``<dW_ICL, dW_FT>_F / (|dW_ICL|_F |dW_FT|_F)`` read from the
patch's factors (``u^T dW_FT v``); and ``simaou``, the similarity of attention-output updates of
Dai et al. (2023) taken on each layer's output: the cosine between what the context changes and
what fine-tuning changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch.arch import adapter_for, weight_layout
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank
from tokenpatch.patch import Patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import DeltaHook

__all__ = ["FineTune", "finetune", "finetuned", "simaou", "OPTIMIZERS"]

# optimizer name -> (class, default learning rate)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], float]] = {
    "sgd": (torch.optim.SGD, 1e-2),
    "adam": (torch.optim.Adam, 1e-3),
}


@dataclass(frozen=True)
class FineTune:
    """The result of ``finetune``.

    ``deltas``: recorded step -> parameter name -> ``dW [B, *param.shape]`` (the parameter's own
    layout, the model's dtype), the change after that many steps; the last step is always there.
    ``losses [B, steps + 1]``: each run's training loss on all its examples before step 1, ..., after
    the last step. ``meta``: optimizer, learning rate, steps, batch size, parameter names.
    """

    deltas: dict[int, dict[str, Tensor]]
    losses: Tensor
    meta: dict

    @property
    def steps(self) -> int:
        return self.meta["steps"]

    @property
    def names(self) -> list[str]:
        return list(self.meta["names"])

    def at(self, step: int | None = None) -> dict[str, Tensor]:
        """The deltas after ``step`` steps (default: the last); ``step`` must have been recorded."""
        step = self.steps if step is None else step
        if step not in self.deltas:
            raise InputError(
                f"step {step} was not recorded; recorded: {sorted(self.deltas)} (pass record=[...] to tp.finetune)"
            )
        return self.deltas[step]


def _names(model: nn.Module, layers, output: bool) -> list[str]:
    adapter = adapter_for(model)
    n = adapter.n_layers(model)
    if layers is None:
        chosen = list(range(n))
    else:
        chosen = [layers] if isinstance(layers, int) else list(layers)
        bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n]
        if not chosen or bad or len({i % n for i in chosen}) != len(chosen):
            raise InputError(f"layers must be distinct layer indices of this {n}-layer model, got {layers!r}")
        chosen = sorted(i % n for i in chosen)
    names = []
    for i in chosen:
        sites = adapter.sites(model, i)
        names += list(sites.inputs)
        if output and sites.output is not None:
            names.append(sites.output[1])
    return names


@contextlib.contextmanager
def finetuned(model: nn.Module, deltas: Mapping[str, Tensor | LowRank]) -> Iterator[nn.Module]:
    """Run ``model`` as ``R`` fine-tuned models at once: ``deltas`` maps parameter names to
    ``[R, *param.shape]`` changes (``FineTune.at()``), or for a weight a ``LowRank`` with lead ``[R]``; inside the block, the ``k`` consecutive
    sequences ``r * k .. r * k + k - 1`` of an input batch of ``R * k`` run with parameters
    ``W + dW[r]``. Hooks only, ``delta_hooks.DeltaHook`` (each run's deltas a ``[R, 1]`` patch acting everywhere on
    its ``k`` consecutive sequences): the weights are never written, and the hooks go on exit, errors
    included."""
    params = dict(model.named_parameters())
    by_module: dict[str, dict[str, Tensor]] = {}
    runs = set()
    for name, delta in deltas.items():
        if name not in params:
            raise InputError(f"{name} is not a parameter of this model")
        if dl.is_lowrank(delta):
            if len(delta.lead) != 1 or tuple(delta.shape) != tuple(params[name].shape):
                raise InputError(
                    f"{name}: a low-rank delta must have lead [runs] and shape {tuple(params[name].shape)}"
                )
        elif tuple(delta.shape[1:]) != tuple(params[name].shape):
            raise InputError(f"{name}: delta {tuple(delta.shape)} is not [runs, *{tuple(params[name].shape)}]")
        runs.add(dl.lead(delta, 1)[0])
        module_name, _, attr = name.rpartition(".")
        by_module.setdefault(module_name, {})[attr] = dl.index(delta, (slice(None), None))  # lead [R, 1]
    if len(runs) > 1:
        raise InputError(f"deltas disagree on the number of runs: {sorted(runs)}")
    pairs = []  # (register, hook): every delta checked before any hook goes on
    for module_name, d in by_module.items():
        module = model.get_submodule(module_name)
        if set(d) - {"weight", "bias"}:
            raise InputError(f"{module_name}: only weight and bias deltas can be run, got {sorted(d)}")
        layout = weight_layout(module, module_name) if "weight" in d else "out_in"
        runs_patch = Patch({f"{module_name}.{a}": t for a, t in d.items()})  # [R, 1], acting everywhere
        hook = DeltaHook(
            module_name,
            runs_patch,
            False,
            True,
            weight=d.get("weight"),
            layout=layout,
            bias=d.get("bias"),
            consecutive=True,
        )
        pairs.append((module.register_forward_hook, hook.after))
    with registered_hooks(pairs):
        yield model


def _mse(pred: Tensor, target: Tensor) -> Tensor:
    """Mean squared error per run: ``[R, n, d_out]`` -> ``[R]``."""
    return ((pred - target) ** 2).flatten(1).mean(1)


def finetune(
    model: nn.Module,
    examples: Tensor,
    targets: Tensor,
    *,
    layers: int | list[int] | None = None,
    output: bool = False,
    optimizer: str = "sgd",
    lr: float | None = None,
    steps: int = 64,
    batch_size: int | None = None,
    record: list[int] | tuple[int, ...] = (),
    loss: Callable[[Tensor, Tensor], Tensor] | None = None,
    progress: bool | None = None,
) -> FineTune:
    """Fine-tune the parameters a token patch touches on no-context examples, ``R`` runs at once.

    ``examples [R, n, T, d_in]``: run ``r``'s ``n`` training sequences (no context: for linear
    regression ``T = 1``, the token ``[x_i; 0]``); ``targets [R, n, d_out]`` (or ``[R, n]`` when
    ``d_out = 1``): what the model's output at each sequence's last position should be.
    ``layers``: the layers whose input matrices train (default: all, at once); ``output=True``
    also trains each layer's output-side site. ``optimizer``: ``"sgd"`` (plain gradient steps,
    default ``lr`` 1e-2) or ``"adam"`` (1e-3). Each step uses all ``n`` examples, or with
    ``batch_size`` the next ``batch_size`` in order, cycling (``batch_size=1``: one example per
    step, like the context consumed token by token). ``loss(pred [R, n', d_out], target) -> [R]``:
    default mean squared error over examples and outputs. ``record``: steps at which to keep the
    deltas besides the last (memory: ``R`` x the trained parameters per step).

    The model is not modified: its parameters are read, never written, and get no gradients.
    """
    adapter = adapter_for(model)
    if optimizer not in OPTIMIZERS:
        raise InputError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZERS)}")
    opt_cls, default_lr = OPTIMIZERS[optimizer]
    lr = default_lr if lr is None else lr
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise InputError(f"lr must be a positive number, got {lr!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be an int >= 1, got {steps!r}")
    if not isinstance(examples, Tensor) or examples.ndim != 4:
        raise InputError(
            "examples must be a tensor [runs, n, pos, d_in] (one no-context training sequence per "
            f"example), got {tuple(examples.shape) if isinstance(examples, Tensor) else type(examples).__name__}"
        )
    runs, n = examples.shape[:2]
    if runs == 0 or n == 0:
        raise InputError(f"examples are empty: shape {tuple(examples.shape)}")
    if not isinstance(targets, Tensor) or tuple(targets.shape[:2]) != (runs, n) or targets.ndim not in (2, 3):
        raise InputError(
            f"targets must be [runs, n, d_out] = [{runs}, {n}, d_out] (or [runs, n]) to match the "
            f"examples, got {tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__}"
        )
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= n
    ):
        raise InputError(f"batch_size must be an int in 1..{n} (the examples per run), got {batch_size!r}")
    record = sorted(set(record))
    if any(isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= steps for s in record):
        raise InputError(f"record must list steps in 1..{steps}, got {record!r}")
    flat = adapter.check_inputs(model, examples.reshape(runs * n, *examples.shape[2:]))
    targets = (targets[..., None] if targets.ndim == 2 else targets).to(flat.dtype)
    loss = _mse if loss is None else loss
    names = _names(model, layers, output)
    params = dict(model.named_parameters())
    leaves = {
        nm: torch.zeros(runs, *params[nm].shape, dtype=params[nm].dtype, device=params[nm].device, requires_grad=True)
        for nm in names
    }
    opt = opt_cls(list(leaves.values()), lr=lr)
    xs = flat.reshape(runs, n, *flat.shape[1:])  # [R, n, T, d]

    def forward(idx: Tensor | None) -> Tensor:
        x = xs if idx is None else xs[:, idx]
        pred = adapter.run(model, x.flatten(0, 1))[0][:, -1]  # [R * n', d_out]
        return loss(pred.reshape(runs, x.shape[1], -1), targets if idx is None else targets[:, idx])  # [R]

    losses, kept = [], {}
    with finetuned(model, leaves):
        for step in progress_bar(range(steps), progress, desc=f"finetune ({optimizer})", unit="step"):
            if batch_size is None or batch_size == n:
                value = forward(None)
                losses.append(value.detach())
            else:
                with torch.no_grad():
                    losses.append(forward(None))
                value = forward(torch.arange(step * batch_size, (step + 1) * batch_size) % n)
            grads = torch.autograd.grad(value.sum(), list(leaves.values()))
            for leaf, g in zip(leaves.values(), grads):
                leaf.grad = g
            opt.step()
            if step + 1 in record or step + 1 == steps:
                kept[step + 1] = {nm: t.detach().clone() for nm, t in leaves.items()}
        with torch.no_grad():
            losses.append(forward(None))
    meta = {
        "optimizer": optimizer,
        "lr": lr,
        "steps": steps,
        "batch_size": batch_size or n,
        "examples": n,
        "runs": runs,
        "names": names,
    }
    return FineTune(kept, torch.stack(losses, 1), meta)


def simaou(with_context: Tensor, alone: Tensor, finetuned_out: Tensor) -> Tensor:
    """Cosine between what the context changes and what fine-tuning changes, along the last dim:
    ``cos(h_C - h_0, h_FT - h_0)``. Dai et al. (2023), *Why can GPT learn in-context?*, take
    ``h`` = a layer's attention output at the query (SimAOU); any per-layer output works the same.
    Random directions score ~0 (in ``d`` dimensions, +-1/sqrt(d))."""
    a, b = with_context - alone, finetuned_out - alone
    den = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(den > 0, (a * b).sum(-1) / den.clamp_min(torch.finfo(den.dtype).tiny), torch.zeros_like(den))
