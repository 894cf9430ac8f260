"""Hooks that leave the model as it was: registered for a block, removed on exit, errors included.

Every part of tokenpatch that reads or edits a forward by hooks (the adapters' passes, steering,
head ablation, the probes) registers them through ``registered_hooks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor

__all__ = ["registered_hooks", "output_tensor"]


@contextlib.contextmanager
def registered_hooks(pairs: Iterable) -> Iterator[None]:
    """Register ``(register_fn, hook)`` pairs (e.g. ``(module.register_forward_hook, hook)``) for the
    block; every handle is removed on exit, errors included (also an error while registering)."""
    handles = []
    try:
        for register, hook in pairs:
            handles.append(register(hook))
        yield
    finally:
        for h in handles:
            h.remove()


def output_tensor(out: Any) -> Tensor:
    """A module's output tensor (``transformers`` 5 returns a tensor, 4.x a tuple for some layers)."""
    return out if isinstance(out, Tensor) else out[0]
