"""Where a model computes: a floating dtype and a device from what a user writes (``"float64"``,
``"cuda:1"``), checked against this machine, for ``load_model`` and the pretrained models."""

from __future__ import annotations

import torch

from tokenpatch.errors import InputError

__all__ = ["as_dtype", "as_device"]


_DTYPES = {
    "float64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating torch dtype from a dtype or its name (``"float32"``, ``"torch.float16"``, ``"bfloat16"``)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise InputError(f"dtype {dtype!r} is not a floating dtype; use one of {sorted(set(_DTYPES))} or a torch.dtype")


def as_device(device: torch.device | str | None) -> torch.device | None:
    """A torch device that exists on this machine, from a device or its name (``"cpu"``, ``"cuda:1"``)."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"device {device!r} is not a device name (e.g. 'cpu', 'cuda', 'cuda:1', 'mps')") from exc
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise InputError(f"device {str(device)!r} is not available here ({torch.cuda.device_count()} CUDA devices)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise InputError("device 'mps' is not available here")
    return device
