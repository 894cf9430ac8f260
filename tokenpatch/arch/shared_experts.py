"""Mixtures of experts with a shared expert: Qwen2-MoE's, scaled by a gate; and added as it is (no gate):
DeepSeek V2/V3, GLM-4-MoE (and its latent-attention Lite), ERNIE 4.5-MoE, EXAONE-MoE, HunYuan V3,
dots.llm1, Param2-MoE, Sarvam-MoE and -MLA, Solar Open, Aria (its text decoder), dots.llm3 Note (its text
decoder), Laguna, MiniCPM 5, Flint, A.X-K2, the hybrids Kimi Linear and Ling 3; and with a norm after the
whole mixture, Kolibri and AXK1.

The MLP module's output is ``routed(s) + shared(s)``. Every expert, the router and the shared expert
read the MLP input ``s``, so one input change patches them all (the same experts are chosen, with the
same weights); the output shift ``m_C - m_0`` goes whole into the shared expert's output matrix, whose
output the block adds unscaled (``MoE.shared``): the rank-1 ``(m_C - m_0) h_C^T / |h_C|^2`` on its hidden
state. The first layers of DeepSeek V3 and GLM-4-MoE have a plain MLP (``first_k_dense_replace``,
``mlp_layer_types``): their record is ``MoE.dense``'s.

Latent attention (DeepSeek, GLM-4-MoE-Lite: keys and values up-projected from a compressed latent) does
more than mix values, so a token alone runs its layers (no ``value``); its MLPs are skipped as always.
"""

from __future__ import annotations

from dataclasses import replace

from tokenpatch.arch.family import SELF_ATTN_QK, Family, Mixer, MoE

__all__ = ["SHARED_EXPERTS", "GATED_SHARED_INPUTS"]

# Qwen2-MoE's form (also Qwen3-Next's): a shared expert scaled by the sigmoid of its gate; every parameter
# reading the MLP input
GATED_SHARED_INPUTS = (
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert_gate.weight",
)

_ROUTED_AND_SHARED = (
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
)
_SHARED = Family(
    name="shared_experts",
    model_types=("ernie4_5_moe", "exaone_moe", "glm4_moe", "param2moe", "sarvam_moe", "solar_open", "hy_v3", "dots1"),
    mlp_norm="post_attention_layernorm",
    inputs=_ROUTED_AND_SHARED,
    down="mlp.shared_experts.down_proj",
    moe=MoE(dense="llama", shared=True),
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
)
_LATENT = Family(  # a plain MLP after an attention whose lone token runs the layer (DeepSeek V3's first layers)
    name="latent_attention",
    model_types=("youtu",),
    mlp_norm="post_attention_layernorm",
    inputs=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    down="mlp.down_proj",
)
_LATENT_SHARED = replace(
    _SHARED,
    name="latent_shared_experts",
    model_types=("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "sarvam_mla"),
    moe=MoE(dense="latent_attention", shared=True),
    lone_zero=(),
    value=None,
)
# DeepSeek V3.2, GLM-MoE-DSA, dots.llm3 Note (its text decoder; a gate on the attention output, sliding-window
# layers) and A.X-K2: latent attention restricted to the keys an indexer ranks best for
# each query (index_topk of them; a token alone: itself, so the no-context pass is unchanged). A.X-K2 gates
# its norms before the sublayers by a low-rank MLP of their output (the MLP's norm gives s all the same)
# and its attention's output by a sigmoid of a second half of its query projection. Declared as a
# mixer beside the attention because transformers' indexer ranks pad keys too: a left-padded row's logits
# differ from the row alone's (0.12 on the tiny model), so padded inputs are refused (reads_pads) and a
# trajectory's prefix rows run unpadded.
_INDEXER = Mixer(
    "self_attn.indexer",
    "self_attn.o_proj",
    "indexed sparse attention (an indexer picks the keys)",
    beside=True,
    reads_pads=True,
)
# Kimi Linear: Kimi delta attention (a gated delta rule, docs/recurrent-layers.md) in 3 of every 4 layers,
# latent attention in the others, every one named ``self_attn`` (told apart by class); Ling 3
# (``bailing_hybrid``) the same, its latent attention with a sigmoid gate per head on its output
_KDA = Mixer(
    "self_attn",
    "self_attn.o_proj",
    "Kimi delta attention",
    classes=("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"),
)
_KOLIBRI = replace(
    _SHARED,
    name="kolibri1",
    model_types=("kolibri1",),
    post_attn_norm="post_self_attn_layernorm",
    post_mlp_norm="post_mlp_layernorm",
    moe=MoE(dense=None, shared=True),
)
_KOLIBRI_DENSE = MoE(dense="kolibri1_1_dense", shared=True)
SHARED_EXPERTS: list[Family] = [
    # Aria's text decoder: a router named router, experts stored transposed ([E, in, out], arch.experts)
    replace(
        _SHARED,
        name="aria",
        model_types=("aria_text",),
        inputs=("mlp.router.weight", *_ROUTED_AND_SHARED[1:]),
    ),
    # Qwen2-MoE: the output shift goes into the shared expert's down_proj, divided by its sigmoid gate
    Family(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        mlp_norm="post_attention_layernorm",
        inputs=GATED_SHARED_INPUTS,
        down="mlp.shared_expert.down_proj",
        moe=MoE(dense="llama", shared_gate="mlp.shared_expert_gate"),
        lone_zero=SELF_ATTN_QK,
        value="self_attn.v_proj",
    ),
    _SHARED,
    _LATENT_SHARED,
    _LATENT,
    replace(
        _LATENT_SHARED,
        name="kimi_linear",
        model_types=("kimi_linear", "bailing_hybrid"),
        moe=MoE(dense="kimi_linear_dense", shared=True),
        mixers=(_KDA,),
    ),
    replace(_LATENT, name="kimi_linear_dense", mixers=(_KDA,)),
    replace(
        _LATENT_SHARED,
        name="indexed_attention",
        model_types=("deepseek_v32", "glm_moe_dsa", "dots3_note_text", "dots3_note", "axk2"),
        moe=MoE(dense="indexed_attention_dense", shared=True),
        mixers=(_INDEXER,),
    ),
    replace(_LATENT, name="indexed_attention_dense", mixers=(_INDEXER,)),
    # shared experts after an attention that does more than mix values (a gate on its output: Laguna,
    # MiniCPM 5; sinks: Flint, whose one shared expert is named shared_expert): a token alone runs the layers
    replace(_LATENT_SHARED, name="shared_experts_attention", model_types=("laguna", "minicpm5_moe")),
    # HunYuan-MoE V1: the router is a gate module's wg, the shared expert named shared_mlp
    replace(
        _SHARED,
        name="hunyuan_moe",
        model_types=("hunyuan_v1_moe",),
        inputs=(
            "mlp.gate.wg.weight",
            "mlp.experts.gate_up_proj",
            "mlp.shared_mlp.gate_proj.weight",
            "mlp.shared_mlp.up_proj.weight",
        ),
        down="mlp.shared_mlp.down_proj",
    ),
    replace(
        _LATENT_SHARED,
        name="flint",
        model_types=("flint",),
        inputs=GATED_SHARED_INPUTS[:4],
        down="mlp.shared_expert.down_proj",
    ),
    # a norm after the whole mixture (routed plus shared experts) before the residual add: the shared expert's
    # output matrix and the norm's scale take the shift, as Gemma 2's (arch.outputs.ScaledMatrixOutput; the
    # norm's input is recorded, p). Kolibri: GLM-4's four norms (scale w) around experts in every layer;
    # AXK1: DeepSeek V3 with a norm inside its mixture block (mlp.post_mlp_layernorm), none after its dense MLPs
    _KOLIBRI,
    replace(_LATENT_SHARED, name="axk1", model_types=("axk1",), post_mlp_norm="mlp.post_mlp_layernorm"),
    # Kolibri 1.1: Kolibri's layers, a plain MLP in the first ones (mlp_only_layers); sliding-window layers
    # and indexed ones (NoPE, keys and values rounded to NVFP4, the keys a weightless indexer picks), some of
    # which read another layer's keys and values (kv_source_layers: no k_proj, v_proj of their own). A token
    # alone attends to itself in each, from the keys and values its source layer makes of it: it runs the layers
    replace(_KOLIBRI, name="kolibri1_1", model_types=("kolibri1_1",), lone_zero=(), value=None, moe=_KOLIBRI_DENSE),
    replace(
        _LATENT,
        name="kolibri1_1_dense",
        post_attn_norm="post_self_attn_layernorm",
        post_mlp_norm="post_mlp_layernorm",
    ),
]
