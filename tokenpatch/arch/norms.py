"""The norms a patch reads or changes: their epsilon, whatever their class calls it, and the RMSNorms
whose scale a patch may change after the MLP (Gemma 2/3, OLMo 2/3, EXAONE 4, GLM-4), with the normalised input that
scale multiplies."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tokenpatch.arch.sites import by_class
from tokenpatch.errors import UnsupportedModelError

__all__ = ["SCALE_NORMS", "scale_norm", "norm_eps"]


def norm_eps(module: nn.Module) -> float:
    """A norm's epsilon, whichever name its class gives it (``eps``, ``variance_epsilon``)."""
    return module.eps if hasattr(module, "eps") else module.variance_epsilon


def _rms_unit(module: nn.Module, x: Tensor) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)``, in at least float32: what an RMSNorm multiplies its scale by."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps(module))


# Norms whose scale a patch may change: class name -> (the normalised input the scale multiplies,
# the constant added to the weight to give the scale). ``out = (offset + w) * unit(x)``, so a
# delta ``dw`` adds ``dw * unit(x)``.
SCALE_NORMS: dict[str, tuple[Callable[[nn.Module, Tensor], Tensor], float]] = {
    "Gemma3RMSNorm": (_rms_unit, 1.0),
    "Gemma2RMSNorm": (_rms_unit, 1.0),
    "Olmo2RMSNorm": (_rms_unit, 0.0),
    "Olmo3RMSNorm": (_rms_unit, 0.0),
    "Exaone4RMSNorm": (_rms_unit, 0.0),
    "Glm4RMSNorm": (_rms_unit, 0.0),
}


def scale_norm(module: nn.Module, name: str = "") -> tuple[Callable[[nn.Module, Tensor], Tensor], float]:
    found = by_class(SCALE_NORMS, module)
    if found is not None:
        return found
    raise UnsupportedModelError(
        f"cannot patch the scale of {name or 'module'} ({type(module).__name__}): not a "
        f"known norm (known: {sorted(SCALE_NORMS)}); add it to tokenpatch.arch.norms.SCALE_NORMS"
    )
