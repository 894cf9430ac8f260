"""The norms tokenpatch reads or changes, by class, in ONE table (``NORMS``): how each computes, its
scale's offset (Gemma's ``1 + w``), and which RMSNorms a patch may change the scale of after the MLP
(Gemma 2/3, OLMo 2/3, EXAONE 4, GLM-4), with the normalised input that scale multiplies. Everything
else that names a norm class reads this table: ``arch.float64`` (the float64 copies the head patches
differentiate), ``SCALE_NORMS`` and ``tokenpatch.testing.float64_norms``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenpatch.arch.layouts import by_class
from tokenpatch.errors import UnsupportedModelError
from tokenpatch.offload import value

__all__ = ["NORMS", "NormClass", "SCALE_NORMS", "RMS_OFFSETS", "scale_norm", "norm_eps", "float32_scale_norms"]


def norm_eps(module: nn.Module) -> float:
    """A norm's epsilon, whichever name its class gives it (``eps``, ``variance_epsilon``)."""
    return module.eps if hasattr(module, "eps") else module.variance_epsilon


def _rms_unit(module: nn.Module, x: Tensor) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)``, in at least float32: what an RMSNorm multiplies its scale by."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps(module))


@dataclass(frozen=True)
class NormClass:
    """How a norm class computes: ``out = (offset + w) * unit(x) (+ b)``.

    ``rms``: ``unit(x) = x / sqrt(mean(x^2) + eps)`` (else a LayerNorm's ``(x - mean) / sqrt(var + eps)``).
    ``offset``: the constant added to the weight to give the scale (Gemma's ``1 + w``). ``eps``: the
    class's fixed epsilon where it keeps none (OLMo's LayerNorm without parameters). ``home``: for a
    norm after the MLP whose scale a patch may change, the ``transformers`` module defining it (it
    computes in float32 whatever the model dtype; ``tokenpatch.testing.float64_norms`` swaps its
    forward there); ``None`` for the others."""

    rms: bool = True
    offset: float = 0.0
    eps: float | None = None
    home: str | None = None


def _scaled(offset: float, folder: str) -> NormClass:
    return NormClass(offset=offset, home=f"transformers.models.{folder}.modeling_{folder}")


# Norm classes by name (optional libraries need not be imported; a subclass finds its nearest base
# listed, ``layouts.by_class``). Adding a norm is one entry here.
NORMS: dict[str, NormClass] = {
    "LayerNorm": NormClass(rms=False),  # torch's, its weight and bias optional
    "OlmoLayerNorm": NormClass(rms=False, eps=1e-5),  # a LayerNorm without parameters
    "LlamaRMSNorm": NormClass(),
    "MistralRMSNorm": NormClass(),
    "Qwen2RMSNorm": NormClass(),
    "Qwen3RMSNorm": NormClass(),
    "Phi3RMSNorm": NormClass(),
    "GraniteRMSNorm": NormClass(),
    "DogeRMSNorm": NormClass(),
    "GemmaRMSNorm": NormClass(offset=1.0),
    "RecurrentGemmaRMSNorm": NormClass(offset=1.0),
    "Gemma3RMSNorm": _scaled(1.0, "gemma3"),
    "Gemma2RMSNorm": _scaled(1.0, "gemma2"),
    "Olmo2RMSNorm": _scaled(0.0, "olmo2"),
    "Olmo3RMSNorm": _scaled(0.0, "olmo3"),
    "OlmoHybridRMSNorm": _scaled(0.0, "olmo_hybrid"),
    "Exaone4RMSNorm": _scaled(0.0, "exaone4"),
    "Glm4RMSNorm": _scaled(0.0, "glm4"),
    "HyperCLOVAXRMSNorm": _scaled(0.0, "hyperclovax"),
    "AfmoeRMSNorm": _scaled(0.0, "afmoe"),
    "Lfm3RMSNorm": _scaled(0.0, "lfm3"),
    "Kolibri1RMSNorm": _scaled(0.0, "kolibri1"),
    "Kolibri1_1RMSNorm": _scaled(0.0, "kolibri1_1"),
    "AXK1RMSNorm": _scaled(0.0, "axk1"),
}

# Read from ``NORMS``: the RMSNorms' offsets (``arch.float64``), and the norms whose scale a patch may
# change, class name -> (the normalised input the scale multiplies, the offset). ``out = (offset + w) *
# unit(x)``, so a delta ``dw`` adds ``dw * unit(x)``.
RMS_OFFSETS: dict[str, float] = {name: n.offset for name, n in NORMS.items() if n.rms}
SCALE_NORMS: dict[str, tuple[Callable[[nn.Module, Tensor], Tensor], float]] = {
    name: (_rms_unit, n.offset) for name, n in NORMS.items() if n.home is not None
}


def scale_norm(module: nn.Module, name: str = "") -> tuple[Callable[[nn.Module, Tensor], Tensor], float]:
    found = by_class(SCALE_NORMS, module)
    if found is not None:
        return found
    raise UnsupportedModelError(
        f"cannot patch the scale of {name or 'module'} ({type(module).__name__}): not a "
        f"known norm (known: {sorted(SCALE_NORMS)}); add it to tokenpatch.arch.norms.NORMS"
    )


@torch.no_grad()
def float32_scale_norms(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The modules owning parameters ``names`` that are ``SCALE_NORMS`` computing in float32 whatever
    the model's dtype (transformers casts the input and the scale of Gemma 2/3, OLMo 2/3, EXAONE 4 and
    GLM-4 RMSNorms to float32), as ``"name (Class)"``.

    Found by a probe, not by name: the module's own output on a float64 input ``x`` against
    ``(offset + w) * x / sqrt(mean(x^2) + eps)`` in float64; a gap above 1e-10 relative (float32
    rounding is ~1e-7) marks it. A float64 model's patch of such a scale is exact only to float32
    rounding there; ``tokenpatch.testing.float64_norms`` evaluates these norms in the input's dtype."""
    found = []
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        entry = by_class(SCALE_NORMS, module)
        if entry is None or leaf != "weight":
            continue
        unit, offset = entry
        p = model.get_parameter(name)
        w = value(model, name, p).detach().double().cpu()
        x = torch.randn((2, w.shape[-1]), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        want = (offset + w) * unit(module, x)
        got = module(x.to("cpu" if p.device.type == "meta" else p.device)).double().cpu()  # offload hooks move x
        if (got - want).abs().max() > 1e-10 * want.abs().max():
            found.append(f"{module_name} ({type(module).__name__})")
    return found
