"""Mixtures of experts without a shared expert (Mixtral's form): Mixtral, Qwen3-MoE, OLMoE, MiniMax-M2,
Mellum, PhiMoE, MiMo-V2-Flash, gpt-oss, Cohere 2-MoE, Granite-MoE, GraniteMoE-SWA, DBRX, JetMoE (and GraniteMoeShared
without its shared MLP) and ZAYA.

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
_GRANITE = replace(
    _MIXTRAL,
    name="granitemoe",
    model_types=("granitemoe", "granitemoeshared"),
    when=lambda config: not getattr(config, "shared_intermediate_size", 0),
    mlp="block_sparse_moe",
    inputs=("block_sparse_moe.router.weight", "block_sparse_moe.experts.gate_up_proj"),
    down="block_sparse_moe.experts",
    out_scale=lambda config: float(config.residual_multiplier),
    moe=MoE(dense=None),
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
    # Granite's residual multiplier around the experts, named block_sparse_moe (GraniteMoeShared and
    # GraniteMoE-SWA without their shared MLP too: shared_intermediate_size 0; with it, arch.moe_blocks)
    _GRANITE,
    # GraniteMoE-SWA: sinks in its attention (a token alone runs the layers)
    replace(_GRANITE, name="granitemoe_swa", model_types=("granitemoe_swa",), lone_zero=(), value=None),
    # DBRX: its attention and both norms inside one module (a fused, clipped query-key-value: a token alone
    # runs the layers), every expert's matrices stacked along their rows ([E * I, d], arch.experts)
    Family(
        name="dbrx",
        model_types=("dbrx",),
        layers="blocks",
        attn="norm_attn_norm.attn",
        o_proj="norm_attn_norm.attn.out_proj",
        mlp_norm="norm_attn_norm.norm_2",
        mlp="ffn",
        inputs=("ffn.router.layer.weight", "ffn.experts.mlp.w1", "ffn.experts.mlp.v1"),
        down="ffn.experts",
        moe=MoE(dense=None),
    ),
    # JetMoE: a mixture of attention heads (a token alone runs the layers); its MLP block routes the tokens
    # itself, its experts JetMoE's own ([E, 2I, d] and [E, d, I], arch.experts), an output bias after them
    Family(
        name="jetmoe",
        model_types=("jetmoe",),
        attn="self_attention",
        o_proj="self_attention.experts.output_linear",
        mlp_norm="post_attention_layernorm",
        inputs=("mlp.router.layer.weight", "mlp.input_linear.weight"),
        down="mlp",
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
