"""Hugging Face block designs as data: one ``Family`` record per design, and the norms whose scale
a patch may change.

The adapter (``arch.hf``) changes the MLP input of every layer once (``Sites.input_site``), which
covers every parameter reading it, so it needs to know only where ``m``, ``s`` and ``hidden`` are
read and where the output side goes; that is the ``Family`` record. Supported block designs
(``docs/hugging-face.md``):

* ``llama`` (Llama, Mistral, Qwen2, Qwen3, Gemma 1; no biases, GQA, q/k norms): ``gate_proj`` and
  ``up_proj`` share the input patch; the output shift is a rank-1 patch of ``down_proj``;
* ``gemma2`` (Gemma 2, Gemma 3): as Llama, plus the post-feedforward RMSNorm with scale
  ``1 + w``: a rank-1 ``down_proj`` patch and a dense patch of that norm's scale
  (``solve.output_patch_scaled``, zero-scale channels included);
* ``gpt2`` (``Conv1D`` weights stored ``[in, out]``, absolute positions): rank-1 on ``c_fc``, the
  output shift in the ``c_proj`` bias;
* ``gpt_neox`` (Pythia): with the parallel residual (the default) the MLP reads the norm of the
  layer input, the same in both passes, so there is no input patch; the attention difference goes
  into the ``dense_4h_to_h`` bias. With ``use_parallel_residual=False`` it is the sequential case;
* ``qwen2_moe`` (mixture of experts with a shared expert): the router and every expert read the
  input change (the same experts are chosen); the output shift goes into the shared expert's
  ``down_proj``, divided by its sigmoid gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch.errors import UnsupportedModelError

__all__ = ["Family", "FAMILIES", "SCALE_NORMS", "scale_norm", "CONFIG_IGNORED"]

# Hugging Face config fields that do not change a causal LM's forward, left out of a patch's config
# record (every other field counts, ``Adapter.config_ignored``): names and versions, the dtype (the
# weight fingerprint survives ``.double()``), the cache and output flags, the attention and experts
# implementations, the initialisation, labels and special token ids (read by tokenizers and
# generation, not the forward), and GPT-2's sequence-summary head (a double-heads model's, not the LM's).
CONFIG_IGNORED = (
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "attn_implementation",
    "_attn_implementation",
    "experts_implementation",
    "_experts_implementation",
    "initializer_range",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
)


@dataclass(frozen=True)
class Family:
    """Where a block design keeps what the patch needs, as names relative to a decoder layer.

    ``layers``: the decoder layers' ``ModuleList`` under the base model. ``mlp_norm``: the norm
    whose output is the MLP input ``s``; in a sequential block its input is ``m``. ``attn``: the
    attention module; a parallel block's ``m`` is the layer input plus its output. ``inputs``: the
    parameters reading ``s`` (changed together through the input change of ``mlp``). ``down``: the
    MLP output matrix (its input is ``hidden``). ``out_norm``: a norm between the MLP and the
    residual add (Gemma 2/3), patched in its scale. ``down_gate``: a module whose sigmoid scales
    ``down``'s output (a shared expert's gate). ``parallel``: whether a model of this family (its
    config) has a parallel block. ``dense``: the family of the layers that lack ``down`` (the plain
    MLP layers of a mixture-of-experts model). ``lone_zero``: projections whose outputs a token
    alone does not need (its own query and key: one attention weight, 1), skipped in the
    no-context pass. ``o_proj``: the attention's output matrix, whose input is the heads' outputs
    side by side (per-head baselines read and patch it). ``attn_out``: the module whose output is
    the attention's contribution to the residual stream, if not ``attn`` (a norm after it: Gemma 2/3).
    ``position_table``: the learned position embedding under the base model (GPT-2's ``wpe``), whose
    size bounds the position ids; ``None`` for rotary positions.
    """

    name: str
    model_types: tuple[str, ...]
    layers: str
    mlp_norm: str
    attn: str
    inputs: tuple[str, ...]
    down: str
    out_norm: str | None = None
    parallel: Callable[[Any], bool] = field(default=lambda config: False)
    mlp: str = "mlp"
    down_gate: str | None = None
    dense: str | None = None
    lone_zero: tuple[str, ...] = ()
    o_proj: str = "self_attn.o_proj"
    attn_out: str | None = None
    position_table: str | None = None


_QK = ("self_attn.q_proj", "self_attn.k_proj")  # separate query and key projections (zeroed for a lone token)
FAMILIES: list[Family] = [
    Family(
        "llama",
        ("llama", "mistral", "qwen2", "qwen3", "gemma"),
        "layers",
        "post_attention_layernorm",
        "self_attn",
        ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.down_proj",
        lone_zero=_QK,
    ),
    Family(
        "gemma2",
        ("gemma2", "gemma3_text"),
        "layers",
        "pre_feedforward_layernorm",
        "self_attn",
        ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.down_proj",
        out_norm="post_feedforward_layernorm",
        lone_zero=_QK,
        attn_out="post_attention_layernorm",
    ),
    Family(
        "gpt2",
        ("gpt2",),
        "h",
        "ln_2",
        "attn",
        ("mlp.c_fc.weight",),
        "mlp.c_proj",
        o_proj="attn.c_proj",
        position_table="wpe",
    ),
    Family(
        "gpt_neox",
        ("gpt_neox",),
        "layers",
        "post_attention_layernorm",
        "attention",
        ("mlp.dense_h_to_4h.weight",),
        "mlp.dense_4h_to_h",
        parallel=lambda config: bool(getattr(config, "use_parallel_residual", False)),
        o_proj="attention.dense",
    ),
    # Mixture of experts with a shared expert: the router and every expert read the MLP input (one
    # input change patches them all, so the same experts are chosen with the same weights); the
    # output shift goes into the shared expert's down_proj, divided by its sigmoid gate. Layers with
    # a plain MLP (``mlp_only_layers``) are patched as Llama's.
    Family(
        "qwen2_moe",
        ("qwen2_moe",),
        "layers",
        "post_attention_layernorm",
        "self_attn",
        (
            "mlp.gate.weight",
            "mlp.experts.gate_up_proj",
            "mlp.shared_expert.gate_proj.weight",
            "mlp.shared_expert.up_proj.weight",
            "mlp.shared_expert_gate.weight",
        ),
        "mlp.shared_expert.down_proj",
        down_gate="mlp.shared_expert_gate",
        dense="llama",
        lone_zero=_QK,
    ),
]


def _rms_unit(module: nn.Module, x: Tensor) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)``, in at least float32: what an RMSNorm multiplies its scale by."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + module.eps)


# Norms whose scale a patch may change: class name -> (the normalised input the scale multiplies,
# the constant added to the weight to give the scale). ``out = (offset + w) * unit(x)``, so a
# delta ``dw`` adds ``dw * unit(x)``.
SCALE_NORMS: dict[str, tuple[Callable[[nn.Module, Tensor], Tensor], float]] = {
    "Gemma3RMSNorm": (_rms_unit, 1.0),
    "Gemma2RMSNorm": (_rms_unit, 1.0),
}


def scale_norm(module: nn.Module, name: str = "") -> tuple[Callable[[nn.Module, Tensor], Tensor], float]:
    for cls in type(module).__mro__:
        if cls.__name__ in SCALE_NORMS:
            return SCALE_NORMS[cls.__name__]
    raise UnsupportedModelError(
        f"cannot patch the scale of {name or 'module'} ({type(module).__name__}): not a "
        f"known norm (known: {sorted(SCALE_NORMS)}); add it to tokenpatch.arch.families.SCALE_NORMS"
    )
