"""Block designs with recurrent or convolutional mixers (``Mixer``): the hybrids, whose layers mix
tokens by attention in some layers and by a recurrent or convolutional layer in the others, or beside
it (``HYBRIDS``), and the purely recurrent models, whose blocks have no MLP (``RECURRENT``).

A token alone runs such a mixer from a zero state (no earlier token, zero convolution history): what
the model's own forward does on a one-token sequence without a cache, which is how the no-context pass
runs it (``docs/recurrent-layers.md``). A hybrid layer's patch is then the usual one (the MLP's input
change and output shift); a block without an MLP, ``out = h + W y``, is patched in the input of its
mixer's output matrix ``W``, through which alone the context reaches the residual stream.
"""

from __future__ import annotations

from dataclasses import replace

from tokenpatch.arch.family import SELF_ATTN_QK, Family, Mixer, MoE
from tokenpatch.arch.shared_experts import GATED_SHARED_INPUTS

__all__ = ["HYBRIDS", "RECURRENT"]

# Gated DeltaNet (Qwen3-Next, Qwen3.5): a short causal convolution, then the delta rule
# S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t; a norm gated by the token's own z;
# out_proj. A token alone: o = b (k . q) v from S_0 = 0.
_DELTANET = Mixer("linear_attn", "linear_attn.out_proj", "gated delta rule (Gated DeltaNet)")
# Mamba (Jamba) and Mamba 2: a causal conv1d, then the selective scan h_t = A_t h_{t-1} + B_t x_t,
# y_t = C_t h_t + D x_t gated by silu(z_t), then out_proj. A token alone: h = B x, y = C B x + D x.
_MAMBA = Mixer("mamba", "mamba.out_proj", "Mamba selective scan")
_MAMBA2 = Mixer("mamba", "mamba.out_proj", "Mamba 2 selective scan")
# Granite 4 (granitemoehybrid) without experts (num_local_experts 0: the H-Micro form): Mamba 2 layers and
# Granite's attention, each followed by one gated MLP (shared_mlp), Granite's residual multiplier on both
_GRANITE4_DENSE = Family(
    name="granitemoehybrid_dense",
    model_types=("granitemoehybrid",),
    when=lambda config: not config.num_local_experts,
    mlp="shared_mlp",
    mlp_norm="post_attention_layernorm",
    inputs=("shared_mlp.input_linear.weight",),
    down="shared_mlp.output_linear",
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
    out_scale=lambda config: float(config.residual_multiplier),
    mixers=(_MAMBA2,),
)
# Qwen3-Next's and Qwen3.5's attention gates its output by a sigmoid of a second half of q_proj: a token
# alone's output is not o_proj of its values, so it runs the layer (its key projection zeroed)
_QWEN35 = Family(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text"),
    mlp_norm="post_attention_layernorm",
    inputs=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    down="mlp.down_proj",
    lone_zero=("self_attn.k_proj",),
    mixers=(_DELTANET,),
)

_JAMBA = Family(  # Llama's attention or a Mamba layer; a dense SwiGLU MLP, or experts in some layers
    name="jamba",
    model_types=("jamba",),
    when=lambda config: config.num_experts == 1,
    mlp="feed_forward",
    mlp_norm="pre_ff_layernorm",
    inputs=("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight"),
    down="feed_forward.down_proj",
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
    mixers=(_MAMBA,),
)
# LFM2: gated short convolutions (B * x, a depthwise causal conv1d, times C) in most layers, Llama's
# attention (q/k norms) in the others; every layer a pre-norm SwiGLU MLP, feed_forward.w1/w3/w2
_LFM2 = Family(
    name="lfm2",
    model_types=("lfm2",),
    mlp_norm="ffn_norm",
    mlp="feed_forward",
    inputs=("feed_forward.w1.weight", "feed_forward.w3.weight"),
    down="feed_forward.w2",
    o_proj="self_attn.out_proj",
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
    mixers=(Mixer("conv", "conv.out_proj", "gated short convolution"),),
)
_LFM3 = replace(
    _LFM2,
    name="lfm3",
    model_types=("lfm3",),
    value=None,
    post_attn_norm="post_operator_norm",
    post_mlp_norm="post_ffn_norm",
    when=lambda config: config.use_sandwich_norm,
)
# RecurrentGemma (Griffin): a temporal block that is local MQA attention (partial rotary) or a recurrent
# block, linear_out((RG-LRU(conv1d(linear_x x))) * gelu(linear_y x)), told apart by class; every layer a
# gated MLP with biases (mlp_block), Gemma's 1 + w RMSNorms. The RG-LRU h_t = a_t h_(t-1) + sqrt(1 - a_t^2)
# (i_t x_t) starts from a zero state on a token alone (its input not rescaled at position 0).
_RECURRENT_GEMMA = Family(
    name="recurrent_gemma",
    model_types=("recurrent_gemma",),
    attn="temporal_block",
    o_proj="temporal_block.o_proj",
    lone_zero=("temporal_block.q_proj", "temporal_block.k_proj"),
    value="temporal_block.v_proj",
    mlp="mlp_block",
    mlp_norm="channel_pre_norm",
    inputs=("mlp_block.gate_proj.weight", "mlp_block.up_proj.weight"),
    down="mlp_block.down_proj",
    mixers=(
        Mixer(
            "temporal_block",
            "temporal_block.linear_out",
            "real-gated linear recurrence (RG-LRU)",
            classes=("RecurrentGemmaRecurrentBlock",),
            reads_pads=True,  # its convolution and scan run over the pads (transformers 5.25)
            keeps_state=True,  # its conv and scan states live on the module between cached forwards
        ),
    ),
)
HYBRIDS: list[Family] = [
    _RECURRENT_GEMMA,
    _QWEN35,
    _JAMBA,
    replace(  # experts without a shared one: the output shift split over the chosen experts (arch.experts)
        _JAMBA,
        name="jamba_moe",
        when=lambda config: config.num_experts > 1,
        inputs=("feed_forward.router.weight", "feed_forward.experts.gate_up_proj"),
        down="feed_forward.experts",
        moe=MoE(dense="jamba"),
    ),
    # Qwen3-Next and Qwen3.5-MoE: Qwen2-MoE's experts with a gated shared expert, the output shift in the
    # shared expert's down_proj divided by its gate (arch.outputs.GatedOutput)
    Family(
        name="qwen3_next",
        model_types=("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"),
        mlp_norm="post_attention_layernorm",
        inputs=GATED_SHARED_INPUTS,
        down="mlp.shared_expert.down_proj",
        moe=MoE(dense="qwen3_5", shared_gate="mlp.shared_expert_gate"),
        lone_zero=("self_attn.k_proj",),
        mixers=(_DELTANET,),
    ),
    # LaRA mini: Qwen3-Next's layers (and sliding-window attention ones) with the shared expert added ungated
    Family(
        name="lara_mini",
        model_types=("lara_mini",),
        mlp_norm="post_attention_layernorm",
        inputs=GATED_SHARED_INPUTS[:4],
        down="mlp.shared_expert.down_proj",
        moe=MoE(dense="qwen3_5", shared=True),
        mixers=(_DELTANET,),
    ),
    # Bamba: Jamba's block with Mamba 2 layers, a dense MLP in every layer
    replace(_JAMBA, name="bamba", model_types=("bamba",), when=lambda config: True, mixers=(_MAMBA2,)),
    # Falcon-H1: a Mamba 2 layer beside the attention in every layer, their outputs (each scaled) summed;
    # the MLP scales its own output (mlp_multipliers[1]), which the output shift is divided by
    Family(
        name="falcon_h1",
        model_types=("falcon_h1",),
        mlp="feed_forward",
        mlp_norm="pre_ff_layernorm",
        inputs=("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight"),
        down="feed_forward.down_proj",
        lone_zero=SELF_ATTN_QK,
        mixers=(replace(_MAMBA2, beside=True),),
        out_scale=lambda config: config.mlp_multipliers[1],
    ),
    _LFM2,
    # LFM2-MoE: experts without a shared one after the first layers (num_dense_layers), LFM2's there
    replace(
        _LFM2,
        name="lfm2_moe",
        model_types=("lfm2_moe",),
        inputs=("feed_forward.gate.weight", "feed_forward.experts.gate_up_proj"),
        down="feed_forward.experts",
        moe=MoE(dense="lfm2"),
    ),
    # LFM3: LFM2's layers, its attention (sliding-window and full) with a sigmoid gate per head on its output
    # (use_attention_gate: a token alone runs the layer, its query and key zeroed), and with use_sandwich_norm
    # norms after the mixer and after the MLP (Gemma 2's four norms, scale w; nn.Identity without)
    _LFM3,
    replace(_LFM3, name="lfm3_plain", post_attn_norm=None, post_mlp_norm=None, when=lambda c: not c.use_sandwich_norm),
    _GRANITE4_DENSE,
    # Granite 4 with experts (its releases): Granite-MoE-shared's MLP part after each mixer, the experts block
    # and shared_mlp two modules reading the one norm (the input change hooked on both, delta_hooks)
    replace(
        _GRANITE4_DENSE,
        name="granitemoehybrid",
        when=lambda config: bool(config.num_local_experts),
        mlp="block_sparse_moe",
        inputs=(
            "block_sparse_moe.router.weight",
            "block_sparse_moe.experts.gate_up_proj",
            "shared_mlp.input_linear.weight",
        ),
        moe=MoE(dense=None, shared=True),
    ),
    # OLMo hybrid: OLMo 2's attention layers (norms after each sublayer, none before the MLP) between
    # Gated DeltaNet layers of Llama's form (a norm before the MLP, none after)
    Family(
        name="olmo_hybrid",
        model_types=("olmo_hybrid",),
        mlp_norm=None,
        post_attn_norm="post_attention_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        inputs=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        down="mlp.down_proj",
        lone_zero=SELF_ATTN_QK,
        value="self_attn.v_proj",
        mixers=(
            Mixer(
                "linear_attn",
                "linear_attn.o_proj",
                "gated delta rule (Gated DeltaNet)",
                fields=(("mlp_norm", "post_attention_layernorm"), ("post_attn_norm", None), ("post_mlp_norm", None)),
            ),
        ),
    ),
    # MiniMax: lightning attention (linear attention with a decay) in place of softmax attention in some
    # layers, told apart by class, and Mixtral's experts. Its residual stream is the normalised one: a
    # layer computes x = a LN_1(h) + b attn(LN_1(h)), s = LN_2(x), out = alpha s + beta MLP(s). So the MLP
    # reads what it is added to (s = m, no mlp_norm), and with the input change (MLP(s_0) -> MLP(s_C))
    # the layer still misses alpha (s_C - s_0): the experts' output must move by alpha (s_C - s_0) / beta
    # (residual_scale alpha, out_scale beta; docs/hugging-face.md).
    Family(
        name="minimax",
        model_types=("minimax",),
        mlp_norm=None,
        inputs=("mlp.gate.weight", "mlp.experts.gate_up_proj"),
        down="mlp.experts",
        moe=MoE(dense=None),
        out_scale=lambda config: config.mlp_beta_factor,
        residual_scale=lambda config: config.mlp_alpha_factor,
        mixers=(
            Mixer(
                "self_attn",
                "self_attn.out_proj",
                "lightning attention (linear attention with a decay)",
                classes=("MiniMaxLightningAttention",),
                reads_pads=True,  # a left-padded row's forward is 3e-9 off the row alone's in float64
            ),
        ),
    ),
]

# Blocks without an MLP: out = h + mixer(norm(h)). The context reaches the residual stream only through
# the mixer's out_proj, whose input change is the whole patch: W (y_C - y_0) y_0^T / |y_0|^2
# (docs/recurrent-layers.md); ``mlp`` names that out_proj (the module whose input is ``s``).
_NO_MIXING = (("mlp", "mixer"), ("inputs", ()))  # a block that mixes no tokens: a zero input change, nothing read
RECURRENT: list[Family] = [
    Family(
        name="mamba",
        model_types=("mamba", "falcon_mamba", "mamba2"),
        attn="mixer",
        o_proj="mixer.out_proj",
        mlp="mixer.out_proj",
        mlp_norm=None,
        inputs=("mixer.out_proj.weight",),
        down=None,
        mixers=(Mixer("mixer", "mixer.out_proj", "Mamba selective scan"),),
    ),
    # Nemotron-H: blocks of one sublayer each, every one named ``mixer`` (told apart by class): a Mamba 2
    # layer or an attention, whose output matrix's input change is the patch (no MLP after them), or an
    # MLP or mixture of experts, which mixes no tokens (its input, the layer input's norm, is the same
    # with and without the context: a zero input change)
    Family(
        name="nemotron_h",
        model_types=("nemotron_h",),
        attn="mixer",
        o_proj="mixer.o_proj",
        lone_zero=("mixer.q_proj", "mixer.k_proj"),
        mlp="mixer.o_proj",
        mlp_norm=None,
        inputs=("mixer.o_proj.weight",),
        down=None,
        mixers=(
            Mixer(
                "mixer",
                "mixer.out_proj",
                "Mamba 2 selective scan",
                classes=("NemotronHMamba2Mixer",),
                fields=(("mlp", "mixer.out_proj"), ("inputs", ("mixer.out_proj.weight",))),
            ),
            Mixer("mixer", "mixer.down_proj", "MLP (no token mixing)", classes=("NemotronHMLP",), fields=_NO_MIXING),
            Mixer(
                "mixer",
                "mixer.shared_experts.down_proj",
                "mixture of experts (no token mixing)",
                classes=("NemotronHMoE",),
                fields=_NO_MIXING,
            ),
        ),
    ),
]
