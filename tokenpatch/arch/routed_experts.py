"""Mixtures of experts without a shared expert (Mixtral's form): Mixtral, Qwen3-MoE, OLMoE, MiniMax-M2,
Mellum, PhiMoE, MiMo-V2-Flash, gpt-oss, Cohere 2-MoE, Granite-MoE and ZAYA.

The router and every expert read the MLP input ``s``, so one input change patches them all (the same
experts are chosen, with the same routing weights); the output shift ``m_C - m_0`` goes into the chosen
experts' stacked ``down_proj``, split in proportion to their routing weights (``arch.experts``). Layers
with a plain MLP (Qwen3-MoE's ``mlp_only_layers``, MiMo-V2-Flash's first) are their ``MoE.dense`` record's.
"""

from __future__ import annotations

from dataclasses import replace

from tokenpatch.arch.family import PARALLEL, SELF_ATTN_QK, Family, Mixer, MoE

__all__ = ["ROUTED_EXPERTS"]

_MIXTRAL = Family(
    name="mixtral",
    model_types=("mixtral", "qwen3_moe", "olmoe", "minimax_m2", "mellum"),
    mlp_norm="post_attention_layernorm",
    inputs=("mlp.gate.weight", "mlp.experts.gate_up_proj"),
    down="mlp.experts",
    moe=MoE(dense="llama"),
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
)
ROUTED_EXPERTS: list[Family] = [
    _MIXTRAL,
    # PhiMoE names its router ``router``
    replace(_MIXTRAL, name="phimoe", model_types=("phimoe",), inputs=("mlp.router.weight", "mlp.experts.gate_up_proj")),
    # after an attention that does more than mix values (MiMo-V2-Flash: sinks in its sliding-window layers,
    # docs/hugging-face.md): a token alone runs the layers; its dense first layer likewise (latent_attention)
    replace(
        _MIXTRAL,
        name="mixtral_attention",
        model_types=("mimo_v2_flash",),
        lone_zero=(),
        value=None,
        moe=MoE(dense="latent_attention"),
    ),
    # gpt-oss: sinks in every layer's attention (a token alone runs the layers), a router with a bias,
    # experts stored transposed ([E, in, out], arch.experts) with biases and a clamped, interleaved GLU
    replace(
        _MIXTRAL,
        name="gpt_oss",
        model_types=("gpt_oss",),
        inputs=("mlp.router.weight", "mlp.experts.gate_up_proj"),
        lone_zero=(),
        value=None,
        moe=MoE(dense=None),
    ),
    # Cohere 2's parallel block (attention and MLP read one norm of the layer input): no input change, the
    # whole difference in the experts
    replace(
        _MIXTRAL,
        name="cohere2_moe",
        model_types=("cohere2_moe",),
        **PARALLEL,
    ),
    # Granite's residual multiplier around the experts, named block_sparse_moe
    replace(
        _MIXTRAL,
        name="granitemoe",
        model_types=("granitemoe",),
        mlp="block_sparse_moe",
        inputs=("block_sparse_moe.router.weight", "block_sparse_moe.experts.gate_up_proj"),
        down="block_sparse_moe.experts",
        out_scale=lambda config: float(config.residual_multiplier),
        moe=MoE(dense=None),
    ),
    # ZAYA: one expert per token (or a skip expert, weight 0) chosen by a router MLP that also reads the
    # previous layer's router state (position by position: reproduced with the layers below it); attention
    # whose queries and keys pass causal convolutions and half of whose values are the previous token's (a
    # token alone runs the layer); each sublayer added as (y + b) g + (m + b') g', learned per channel: the
    # shift the experts absorb is g' (m_C - m_0) / g, channel by channel (Family.per_channel)
    replace(
        _MIXTRAL,
        name="zaya",
        model_types=("zaya",),
        inputs=("mlp.gate.down_proj.weight", "mlp.experts.gate_up_proj"),
        lone_zero=(),
        value=None,
        moe=MoE(dense=None),
        out_scale="post_mlp_residual_scale.hidden_states_scale",
        residual_scale="post_mlp_residual_scale.residual_scale",
        # its convolutions and delayed values keep a state in the cache that transformers cannot copy per query:
        # declared as a mixer beside the attention, so a thought patch runs the prompt with its queries
        mixers=(Mixer("self_attn.qkv_proj", "self_attn.o_proj", "compressed convolutional attention", beside=True),),
    ),
]
