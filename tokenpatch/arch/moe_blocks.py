"""Mixtures of experts whose block places its parts otherwise than Mixtral's or Qwen2-MoE's: Granite-MoE
with a shared MLP beside the experts block (GraniteMoeShared, GraniteMoE-SWA), Llama 4, AFMoE and
MiniMax-M3's text decoder; and LongCat-Flash's.

The patch is the one of ``arch.shared_experts``: every expert, the router and the shared expert read
the MLP input ``s``, so one input change patches them all; the output shift ``m_C - m_0`` goes whole
into the shared expert's output matrix. What differs:

* Granite-MoE-Shared and -SWA call the experts block and the shared MLP as two modules on one norm
  output and add them (times ``residual_multiplier``): the input change goes on the input of each
  (its readers outside the block name the shared MLP, ``delta_hooks.hooked``); without a shared MLP
  (``shared_intermediate_size`` 0) the block is Granite-MoE's (``arch.routed_experts``);
* Llama 4: every expert reads ``s`` times its routing weight, the experts stored ``[E, in, out]``
  (``arch.layouts``), the block returns ``(y, router logits)`` (a token alone's anchor comes from its
  values, ``Family.value``: no pass replaces the block); dense layers between;
* AFMoE: Gemma 2's four norms around the block, whose sum of shared and routed experts is the input
  of the norm after it (``ScaledMatrixOutput``: the norm's input ``p``); a gate on the attention's
  output (a token alone runs the layers);
* MiniMax-M3: a fused gate-up shared expert, routed experts scaled by ``routed_scaling_factor``; a
  config with indexed (block-sparse) layers is refused: transformers' indexer cannot run a token
  alone past its first key block (``index_block_size``).

LongCat-Flash's layer is two attention-and-MLP sublayers and a shortcut mixture of experts: the patch
goes to its second MLP, everything before it being what mixes the tokens (its record, below).
"""

from __future__ import annotations

from dataclasses import replace

from tokenpatch.arch.family import SELF_ATTN_QK, Family, Mixer, MoE

__all__ = ["MOE_BLOCKS"]


def _residual_multiplier(config) -> float:
    return float(config.residual_multiplier)


def _shared_mlp(config) -> bool:
    return bool(getattr(config, "shared_intermediate_size", 0))


_GRANITE_SHARED = Family(
    name="granitemoe_shared",
    model_types=("granitemoeshared",),
    when=_shared_mlp,
    mlp_norm="post_attention_layernorm",
    mlp="block_sparse_moe",
    inputs=(
        "block_sparse_moe.router.weight",
        "block_sparse_moe.experts.gate_up_proj",
        "shared_mlp.input_linear.weight",  # outside the block: its own input change (delta_hooks)
    ),
    down="shared_mlp.output_linear",
    moe=MoE(dense=None, shared=True),
    out_scale=_residual_multiplier,
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
)
_LLAMA4_DENSE = Family(
    name="llama4_dense",
    model_types=(),
    layers="model.layers",  # Llama4ForCausalLM names no base model (its prefix, language_model, is absent)
    mlp_norm="post_attention_layernorm",
    mlp="feed_forward",
    inputs=("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight"),
    down="feed_forward.down_proj",
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
)
_AFMOE_DENSE = Family(  # a gate on the attention's output: a token alone runs the layers
    name="afmoe_dense",
    model_types=(),
    mlp_norm="pre_mlp_layernorm",
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_mlp_layernorm",
    inputs=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    down="mlp.down_proj",
)
_M3_DENSE = Family(
    name="minimax_m3_dense",
    model_types=(),
    mlp_norm="post_attention_layernorm",
    inputs=("mlp.gate_up_proj.weight",),
    down="mlp.down_proj",
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
)
# LongCat-Flash: each layer two sublayers of latent attention and a plain MLP, and a mixture of experts
# (with identity "zero" experts) reading the first sublayer's MLP input, whose output the layer adds at
# its end (a shortcut). The patch goes to the second sublayer's MLP: the first sublayer is part of what
# mixes the tokens (declared a mixer beside the attention: the head tools refuse the layer; a token alone
# runs the layers), and the shortcut's output is part of the residual value m (Family.shortcut).
_LONGCAT_FIRST = Mixer(
    "self_attn.0",
    "self_attn.0.o_proj",
    "first sublayer (latent attention and an MLP) with a shortcut mixture of experts",
    beside=True,
)
MOE_BLOCKS: list[Family] = [
    _GRANITE_SHARED,
    # with attention sinks (a token alone runs the layers)
    replace(_GRANITE_SHARED, name="granitemoe_swa_shared", model_types=("granitemoe_swa",), lone_zero=(), value=None),
    replace(
        _LLAMA4_DENSE,
        name="llama4",
        model_types=("llama4_text", "llama4"),
        inputs=(
            "feed_forward.router.weight",
            "feed_forward.experts.gate_up_proj",
            "feed_forward.shared_expert.gate_proj.weight",
            "feed_forward.shared_expert.up_proj.weight",
        ),
        down="feed_forward.shared_expert.down_proj",
        moe=MoE(dense="llama4_dense", shared=True),
    ),
    _LLAMA4_DENSE,
    replace(
        _AFMOE_DENSE,
        name="afmoe",
        model_types=("afmoe",),
        inputs=(
            "mlp.router.gate.weight",
            "mlp.experts.gate_up_proj",
            "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight",
        ),
        down="mlp.shared_experts.down_proj",
        moe=MoE(dense="afmoe_dense", shared=True),
    ),
    _AFMOE_DENSE,
    replace(
        _M3_DENSE,
        name="minimax_m3",
        model_types=("minimax_m3_vl_text",),
        when=lambda config: "minimax_m3_sparse" not in config.layer_types,
        inputs=("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.shared_experts.gate_up_proj.weight"),
        down="mlp.shared_experts.down_proj",
        moe=MoE(dense="minimax_m3_dense", shared=True),
    ),
    _M3_DENSE,
    Family(
        name="longcat_flash",
        model_types=("longcat_flash",),
        o_proj="self_attn.1.o_proj",
        mixers=(_LONGCAT_FIRST,),
        mlp_norm="post_attention_layernorm.1",
        mlp="mlps.1",
        inputs=("mlps.1.gate_proj.weight", "mlps.1.up_proj.weight"),
        down="mlps.1.down_proj",
        shortcut="mlp",
    ),
]
