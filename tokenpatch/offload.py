"""Parameters that ``accelerate`` offloaded to CPU memory or disk, read where they really are.

A model loaded with a ``device_map`` that offloads layers (``from_pretrained(..., device_map=...,
offload_folder=...)``) keeps those layers' parameters on the ``meta`` device, without data; an
``accelerate`` hook on the module (``_hf_hook``, an ``AlignDevicesHook`` with ``offload=True``) loads
them from its ``weights_map`` for each forward and drops them after. The forwards tokenpatch runs go
through those hooks; what reads a weight outside a forward (the fingerprint, the output side of a
patch through a norm, a LoRA's ``B = W d``) or in a hook around one (before ``accelerate`` loads the
module's weights, after it drops them: the stacked experts' hidden states) reads it here:
``value(model, name)``, or ``value(module, attr)`` for a module's own parameter. ``device(module)``
is where a module runs: for an offloaded one, the device its hook loads the weights onto.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from tokenpatch.errors import UnsupportedModelError

__all__ = ["value", "named_values", "offloaded", "device"]


def offloaded(p: Tensor) -> bool:
    """Whether ``p`` is a parameter without data (``meta``), as ``accelerate`` leaves an offloaded one."""
    return p.device.type == "meta"


def _align_hooks(module: nn.Module) -> Iterator:
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):  # a SequentialHook or one
        if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
            yield h


def value(model: nn.Module, name: str, p: Tensor | None = None) -> Tensor:
    """The data of parameter ``name`` of ``model`` (any module: ``value(experts, "down_proj")``): the
    parameter itself, or for one ``accelerate`` offloaded, the tensor in the ``weights_map`` of the
    hook of its module or of the nearest ancestor holding it (on CPU, or memory-mapped from the offload
    folder: move it to where it is used). ``p``: the tensor itself, if known (a buffer's, which
    ``get_parameter`` does not find)."""
    p = model.get_parameter(name) if p is None else p
    if not offloaded(p):
        return p
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):  # the owning module first, then its ancestors
        module = model.get_submodule(".".join(parts[:cut]))
        key = ".".join(parts[cut:])
        for hook in _align_hooks(module):
            if key in hook.weights_map:
                return hook.weights_map[key]
    raise UnsupportedModelError(
        f"{name} is on the meta device and no accelerate offload hook holds its data: load the model's "
        "weights (from_pretrained, or accelerate's load_checkpoint_and_dispatch) before patching it"
    )


def named_values(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``model.named_parameters()`` with every offloaded parameter's data in place of its meta tensor."""
    for name, p in model.named_parameters():
        yield name, value(model, name, p)


def device(module: nn.Module) -> torch.device:
    """The device ``module`` runs on: its first parameter's, or for one ``accelerate`` offloaded (on
    ``meta``), the execution device of its hook (where the hook loads the weights for each forward)."""
    p = next(module.parameters(), None)
    if p is None or not offloaded(p):
        return torch.device("cpu") if p is None else p.device
    for hook in _align_hooks(module):
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    raise UnsupportedModelError(
        f"{type(module).__name__} is on the meta device and no accelerate offload hook says where it runs: load "
        "the model's weights (from_pretrained, or accelerate's load_checkpoint_and_dispatch) before patching it"
    )
