"""What the trainers share (``train``, ``markov``, ``lm``): the config base and its checks, the
optimisation loop, optimizer state in a checkpoint, and a Ctrl-C that stops at a step boundary."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenpatch.errors import FileFormatError, InputError
from tokenpatch.progress import progress_bar

__all__ = [
    "TrainingConfig",
    "check_config",
    "check_recipe",
    "run_steps",
    "optim_tensors",
    "load_optim",
    "DeferredInterrupt",
]

log = logging.getLogger(__name__)


def optim_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's state as flat tensors ``optim.<param index>.<key>``, for a checkpoint's extras."""
    out = {}
    for idx, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[f"optim.{idx}.{key}"] = torch.as_tensor(value)
    return out


def load_optim(opt: torch.optim.Optimizer, extra: dict[str, torch.Tensor]) -> None:
    """Restore ``opt`` from the tensors ``optim_tensors`` wrote."""
    state: dict[int, dict] = {}
    for name, value in extra.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


class DeferredInterrupt:
    """Turn the first Ctrl-C into a flag checked between steps, so the checkpoint written on
    interruption is a consistent step boundary; a second Ctrl-C interrupts at once. Inside
    ``with stop.cut_short():`` (work after a finished step, e.g. an evaluation, that a checkpoint
    does not need) the first Ctrl-C also raises ``KeyboardInterrupt`` at once, with ``cut`` set."""

    requested = False
    cut = False
    _now = False

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._old)
        if self._now:
            self.cut = True
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def cut_short(self):
        self._now = True
        try:
            yield
        finally:
            self._now = False

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def check_config(
    cfg, counts: tuple[str, ...] = (), positive: tuple[str, ...] = (), nonnegative: tuple[str, ...] = ()
) -> None:
    """One clear ``InputError`` for a training config's first bad field: ``counts`` are integers
    >= 1, ``seed`` (when present) an integer >= 0, ``positive`` numbers > 0, ``nonnegative`` >= 0."""
    kind = type(cfg).__name__
    for name in counts:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{kind}.{name} must be an integer >= 1, got {value!r}")
    seed = getattr(cfg, "seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise InputError(f"{kind}.seed must be an integer >= 0, got {seed!r}")
    for names, ok, what in ((positive, lambda v: v > 0, "> 0"), (nonnegative, lambda v: v >= 0, ">= 0")):
        for name in names:
            value = getattr(cfg, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not ok(value)
            ):
                raise InputError(f"{kind}.{name} must be a number {what}, got {value!r}")


@dataclass(frozen=True)
class TrainingConfig:
    """The fields every trainer's config has, their checks and ``to_dict`` (``linreg.TrainConfig``,
    ``markov.MarkovTrain``, ``lm.LMTrain``). A subclass re-declares the fields it gives its own default
    (all but ``grad_clip`` and ``seed``), adds its own, names its own checked fields in ``COUNTS``
    (integers >= 1), ``POSITIVE`` and ``NONNEGATIVE``, and lists every field in ``RECIPE_KEYS``: the
    order of ``to_dict``, the order its saved recipes record (a checkpoint's JSON stays what it was)."""

    steps: int
    batch_size: int
    lr: float
    warmup: int
    checkpoint_every: int
    grad_clip: float = 1.0
    seed: int = 0

    COUNTS: ClassVar[tuple[str, ...]] = ()
    POSITIVE: ClassVar[tuple[str, ...]] = ()
    NONNEGATIVE: ClassVar[tuple[str, ...]] = ()
    RECIPE_KEYS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_config(
            self,
            counts=("steps", "batch_size", "warmup", "checkpoint_every", *self.COUNTS),
            positive=("lr", "grad_clip", *self.POSITIVE),
            nonnegative=self.NONNEGATIVE,
        )

    def lr_at(self, step: int) -> float:
        """The learning rate at ``step``: linear warm-up over ``warmup`` steps, then constant (a
        trainer with a decay overrides it)."""
        return self.lr * min(1.0, (step + 1) / self.warmup)

    def to_dict(self) -> dict:
        """The fields, keys in ``RECIPE_KEYS`` order (then any field it does not list, in field order)."""
        fields = dataclasses.asdict(self)
        return {**{k: fields[k] for k in self.RECIPE_KEYS}, **fields}


def check_recipe(path, saved, asked: dict) -> None:
    """Refuse to resume a checkpoint written by another recipe, rather than mix two runs."""
    if saved != asked:
        raise FileFormatError(
            f"{path} was written by another training recipe; pass another path, or start afresh "
            f"(resume=False; --no-resume) (saved {saved}, asked {asked})"
        )


def run_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    start: int,
    steps: int,
    loss_at: Callable[[int], torch.Tensor],
    lr_at: Callable[[int], float],
    grad_clip: float,
    checkpoint: Callable[[int], None],
    checkpoint_every: int,
    after: Callable[[int, float], dict | None],
    desc: str,
    progress: bool | None,
    where: str,
) -> None:
    """The optimisation loop every trainer runs, steps ``start .. steps - 1``:

        loss = loss_at(step);  lr <- lr_at(step);  backward;  clip the gradient norm to grad_clip;
        opt.step();  after(step + 1, loss)   (what ``after`` returns, if anything, is shown on the bar)

    with a progress bar, ``checkpoint(step + 1)`` every ``checkpoint_every`` steps before the last
    (the caller writes the final one, with whatever it adds), and a first Ctrl-C that checkpoints
    at the step boundary and raises ``KeyboardInterrupt``; running the trainer again resumes there.
    A Ctrl-C during ``after`` cuts it short at once (an evaluation can take seconds): ``after`` must
    leave what the checkpoint saves whole when cut, and the trainer redo what it missed on resuming.
    """
    bar = progress_bar(None, progress, total=steps, initial=start, desc=desc, unit="step")
    with DeferredInterrupt() as stop:
        for step in range(start, steps):
            loss = loss_at(step)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            try:  # the step is done: what follows it (an evaluation) is cut short by the first Ctrl-C
                with stop.cut_short():
                    shown = after(step + 1, loss.item())
            except KeyboardInterrupt:
                if not stop.cut:  # a second Ctrl-C: at once
                    raise
                shown = None
            bar.update(1)
            if shown:
                bar.set_postfix(shown)
            if stop.requested:
                checkpoint(step + 1)
                bar.close()
                log.warning("interrupted after step %d; saved %s (run again to resume)", step + 1, where)
                raise KeyboardInterrupt
            if (step + 1) % checkpoint_every == 0 and step + 1 < steps:
                checkpoint(step + 1)
    bar.close()
