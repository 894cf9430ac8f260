"""``float64_everywhere``: inside the block, every cast to float32 that ``transformers`` makes whatever
the model dtype (``x.float()``, ``x.to(torch.float32)``, ``dtype=torch.float32``) is a cast to float64.

The chunked scans of Gated DeltaNet and Mamba 2, the routers of DeepSeek-style mixtures of experts, the
norms that upcast, float32 softmaxes: a float64 model then computes in float64 throughout, and two
forwards that should agree (a left-padded row and the row alone, a cached step and the full forward, a
prefix run alone and inside a longer sequence) agree to float64 rounding. tokenpatch's patch is exact
either way (to the model's own arithmetic); this only makes that arithmetic float64. Every torch call
inside the block goes through it (slower), and a float32 model's casts become float64 too, so use it on
float64 models only: the tests do, and the ``transformers`` mixers of ``models.hf_layers`` do on float64
inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["float64_everywhere"]


class _NoFloat32(TorchFunctionMode):
    """Every cast to float32 (``x.float()``, ``x.to(torch.float32)``, ``dtype=torch.float32``) made float64,
    and a ``torch.full`` of a float in the default dtype (XGLM's clamp of its scores at
    ``torch.full((), finfo(float64).min)``, which overflows float32) made in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func is torch.full and "dtype" not in kwargs:
            fill = kwargs["fill_value"] if "fill_value" in kwargs else args[1] if len(args) > 1 else None
            if isinstance(fill, float):
                kwargs["dtype"] = torch.float64
        return func(*(torch.float64 if a is torch.float32 else a for a in args), **kwargs)


@contextlib.contextmanager
def float64_everywhere() -> Iterator[None]:
    """Casts to float32 made casts to float64 inside the block (the module docstring)."""
    with _NoFloat32():
        yield
