"""Float64 copies of a layer's modules as plain functions, whatever the model's dtype.

``Adapter.mlp_input_from_heads`` builds the map from the heads' outputs to the MLP input out of
these (``interp.head_patches`` differentiates it with ``torch.func.jvp``): copies of the few
weights it needs, so the model is never cast, and Hugging Face RMSNorms (which compute in float32
whatever the model dtype) are evaluated in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as Fn
from torch import Tensor, nn

from tokenpatch.arch.norms import SCALE_NORMS, norm_eps
from tokenpatch.errors import UnsupportedModelError
from tokenpatch.offload import value

__all__ = ["RMS_OFFSETS", "linear64", "norm64"]

# RMSNorms: ``out = (offset + w) * x / sqrt(mean(x^2) + eps)``; class name -> offset.
RMS_OFFSETS = {
    "LlamaRMSNorm": 0.0,
    "MistralRMSNorm": 0.0,
    "Qwen2RMSNorm": 0.0,
    "Qwen3RMSNorm": 0.0,
    "Phi3RMSNorm": 0.0,
    "GraniteRMSNorm": 0.0,
    "GemmaRMSNorm": 1.0,
    **{name: offset for name, (_, offset) in SCALE_NORMS.items()},
}


def linear64(module: nn.Module) -> Callable[[Tensor], Tensor]:
    """A float64 copy of a ``Linear`` or GPT-2 ``Conv1D`` as a function (an offloaded one's weights
    read through ``offload.value``)."""
    w = value(module, "weight").detach().double()
    b = None if getattr(module, "bias", None) is None else value(module, "bias").detach().double()
    if type(module).__name__ == "Conv1D":  # stored [in, out]
        return lambda x: x @ w + (0 if b is None else b)
    return lambda x: Fn.linear(x, w, b)


def norm64(module: nn.Module, where: str) -> Callable[[Tensor], Tensor]:
    """A float64 copy of a LayerNorm or a known RMSNorm (``RMS_OFFSETS``) as a function; ``where``
    names the module in the error for an unknown norm."""
    if isinstance(module, nn.LayerNorm):
        w = None if module.weight is None else value(module, "weight").detach().double()
        b = None if module.bias is None else value(module, "bias").detach().double()
        return lambda x: Fn.layer_norm(x, module.normalized_shape, w, b, module.eps)
    if type(module).__name__ == "OlmoLayerNorm":  # a LayerNorm without parameters
        return lambda x: Fn.layer_norm(x, module.normalized_shape, None, None, 1e-5)
    offset = next((RMS_OFFSETS[c.__name__] for c in type(module).__mro__ if c.__name__ in RMS_OFFSETS), None)
    if offset is None:
        raise UnsupportedModelError(
            f"{where}: cannot split by heads through a {type(module).__name__}; known norms: "
            f"LayerNorm and {sorted(RMS_OFFSETS)} (add it to tokenpatch.arch.float64.RMS_OFFSETS)"
        )
    scale = offset + value(module, "weight").detach().double()
    eps = norm_eps(module)
    return lambda x: scale * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
