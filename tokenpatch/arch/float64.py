"""Float64 copies of a layer's modules as plain functions, whatever the model's dtype.

``Adapter.mlp_input_from_heads`` builds the map from the heads' outputs to the MLP input out of
these (``interp.head_patches`` differentiates it with ``torch.func.jvp``): copies of the few
weights it needs, so the model is never cast, and the norms (``arch.norms.NORMS``; Hugging Face's
RMSNorms compute in float32 whatever the model dtype) are evaluated in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as Fn
from torch import Tensor, nn

from tokenpatch.arch.layouts import by_class
from tokenpatch.arch.norms import NORMS, RMS_OFFSETS, norm_eps
from tokenpatch.errors import UnsupportedModelError
from tokenpatch.offload import value

__all__ = ["RMS_OFFSETS", "linear64", "norm64"]


def linear64(module: nn.Module) -> Callable[[Tensor], Tensor]:
    """A float64 copy of a ``Linear`` or GPT-2 ``Conv1D`` as a function (an offloaded one's weights
    read through ``offload.value``)."""
    w = value(module, "weight").detach().double()
    b = None if getattr(module, "bias", None) is None else value(module, "bias").detach().double()
    if type(module).__name__ == "Conv1D":  # stored [in, out]
        return lambda x: x @ w + (0 if b is None else b)
    return lambda x: Fn.linear(x, w, b)


def norm64(module: nn.Module, where: str) -> Callable[[Tensor], Tensor]:
    """A float64 copy of a norm of the table ``arch.norms.NORMS`` (a LayerNorm, or an RMSNorm
    ``(offset + w) * x / sqrt(mean(x^2) + eps)``) as a function; ``where`` names the module in the
    error for an unknown norm."""
    norm = by_class(NORMS, module)
    if norm is None:
        raise UnsupportedModelError(
            f"{where}: cannot split by heads through a {type(module).__name__}; known norms: "
            f"{sorted(NORMS)} (add it to tokenpatch.arch.norms.NORMS)"
        )
    w = None if getattr(module, "weight", None) is None else value(module, "weight").detach().double()
    eps = norm_eps(module) if norm.eps is None else norm.eps
    if not norm.rms:
        b = None if getattr(module, "bias", None) is None else value(module, "bias").detach().double()
        return lambda x: Fn.layer_norm(x, module.normalized_shape, w, b, eps)
    scale = norm.offset + w
    return lambda x: scale * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
