"""What the trainers share (``train``, ``markov``, ``lm``): optimizer state in a checkpoint, and a
Ctrl-C that stops at a step boundary."""

from __future__ import annotations

import signal
import threading

import torch

__all__ = ["optim_tensors", "load_optim", "DeferredInterrupt"]


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
    interruption is a consistent step boundary; a second Ctrl-C interrupts at once."""

    requested = False

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._old)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
