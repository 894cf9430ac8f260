"""How a module applies its weight to an input (``weight_layout``), and lookups by class name
(``by_class``), so that optional libraries need not be imported."""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenpatch.errors import UnsupportedModelError

__all__ = ["WEIGHT_LAYOUTS", "by_class", "weight_layout"]

# How a module applies its ``weight`` to an input: "out_in" means ``y = x @ W.T`` (W stored
# [out, in], torch's nn.Linear); "in_out" means ``y = x @ W`` (W stored [in, out], GPT-2's Conv1D).
# Keyed by class name so optional libraries need not be imported; a class whose parameters differ, by
# parameter name.
WEIGHT_LAYOUTS: dict[str, str | dict[str, str]] = {
    "Linear": "out_in",
    "Conv1D": "in_out",
    # mixture-of-experts routers: a weight [experts, d] applied with F.linear
    "Qwen2MoeTopKRouter": "out_in",
    "MixtralTopKRouter": "out_in",
    "Qwen3MoeTopKRouter": "out_in",
    "OlmoeTopKRouter": "out_in",
    "Qwen3NextTopKRouter": "out_in",
    "Qwen3_5MoeTopKRouter": "out_in",
    "JambaTopKRouter": "out_in",
    "Lfm2MoeTopKRouter": "out_in",
    "Ernie4_5_MoeTopKRouter": "out_in",
    "ExaoneMoeTopkRouter": "out_in",
    "Glm4MoeTopkRouter": "out_in",
    "Glm4MoeLiteTopkRouter": "out_in",
    "DeepseekV2TopkRouter": "out_in",
    "DeepseekV3TopkRouter": "out_in",
    "KimiLinearTopkRouter": "out_in",
    "MiniMaxM2TopKRouter": "out_in",
    "GraniteMoeTopKRouter": "out_in",
    "GraniteMoeHybridTopKRouter": "out_in",
    "GraniteMoeSharedTopKRouter": "out_in",
    "GraniteMoeSWATopKRouter": "out_in",
    "SolarOpenTopkRouter": "out_in",
    "MellumTopKRouter": "out_in",
    "MiniCPM5MoeTopkRouter": "out_in",
    "HYV3TopKRouter": "out_in",
    "LagunaTopKRouter": "out_in",
    "FlintTopKRouter": "out_in",
    "MiMoV2FlashTopkRouter": "out_in",
    "LaraMiniTopKRouter": "out_in",
    "Cohere2MoeTopKRouter": "out_in",
    "DeepseekV32TopkRouter": "out_in",
    "MiniMaxTopKRouter": "out_in",
    "GlmMoeDsaTopkRouter": "out_in",
    "GptOssTopKRouter": "out_in",
    "AriaTextTopKRouter": "out_in",
    "Dots1TopkRouter": "out_in",
    "Dots3NoteTextTopkRouter": "out_in",
    "MiniMaxM3VLTopKRouter": "out_in",
    # Llama 4's experts: not transformers' stacked-experts modules, stored [E, in, out] (x @ W)
    "Llama4TextExperts": "in_out",
    # DBRX's experts' matrices [E * I, d], by parameter: the gate and up read as x W^T, the output as h W
    "DbrxExpertGLU": {"w1": "out_in", "v1": "out_in", "w2": "in_out"},
    "JetMoeParallelExperts": "out_in",  # [E, out, in]
    "BailingHybridTopkRouter": "out_in",
    "AXK1TopkRouter": "out_in",
    "AXK2TopkRouter": "out_in",
    "Kolibri1TopKRouter": "out_in",
    "Kolibri1_1TopKRouter": "out_in",
}


def by_class(table: dict[str, Any], module: nn.Module) -> Any:
    """The entry of ``table`` (keyed by class name, so optional libraries need not be imported) for
    ``module``'s class or the nearest base class listed; ``None`` if none is."""
    return next((table[cls.__name__] for cls in type(module).__mro__ if cls.__name__ in table), None)


def weight_layout(module: nn.Module, name: str = "") -> str:
    """``"out_in"`` or ``"in_out"`` for ``module``'s weight, from its type (never its shape); for the
    stacked experts of ``transformers`` (``use_experts_implementation``) from what the module says of its
    matrices: ``[E, out, in]``, or ``[E, in, out]`` where ``is_transposed`` (gpt-oss)."""
    if isinstance(getattr(module, "is_transposed", None), bool) and hasattr(module, "has_gate"):
        return "in_out" if module.is_transposed else "out_in"
    layout = by_class(WEIGHT_LAYOUTS, module)
    if isinstance(layout, dict):  # by parameter (DBRX's experts)
        layout = layout.get(name.rpartition(".")[2])
    if layout is not None:
        return layout
    raise UnsupportedModelError(
        f"cannot patch {name or 'module'} of type {type(module).__name__}: its weight layout is unknown "
        f"(known: {sorted(WEIGHT_LAYOUTS)}); add it to tokenpatch.arch.WEIGHT_LAYOUTS"
    )
