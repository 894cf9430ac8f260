"""The tiny random configurations of the mixtures of experts with a shared expert (``arch.shared_experts``):
GLM-4-MoE's form, and DeepSeek's after latent attention. Part of ``tiny_configs.TINY_HF``, read as it is."""

from __future__ import annotations

from tokenpatch.tiny_sizes import KV, SMALL

__all__ = ["TINY_SHARED_EXPERTS", "LATENT"]

_SHARED_MOE = dict(KV, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, pad_token_id=0)
LATENT = dict(  # DeepSeek's latent attention: queries and keys/values through low-rank latents
    SMALL,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    qk_head_dim=16,
    head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    pad_token_id=0,
)
TINY_SHARED_EXPERTS: dict[str, tuple[str, dict]] = {
    # mixtures of experts with a shared expert added ungated, a plain MLP in the first layer
    # Aria's text decoder: its experts stored transposed, a router named router
    "aria_text": ("AriaTextConfig", dict(KV, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, pad_token_id=0)),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        dict(KV, moe_intermediate_size=32, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1, pad_token_id=0),
    ),
    "exaone_moe": (
        "ExaoneMoeConfig",
        dict(
            _SHARED_MOE,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
    ),
    "glm4_moe": ("Glm4MoeConfig", dict(_SHARED_MOE, n_routed_experts=4, num_nextn_predict_layers=0)),
    "param2moe": ("Param2MoeConfig", dict(_SHARED_MOE, head_dim=16, n_routed_experts=4, first_k_dense_replace=1)),
    "sarvam_moe": ("SarvamMoEConfig", dict(_SHARED_MOE, head_dim=16, n_routed_experts=4, first_k_dense_replace=1)),
    # a zero pad embedding (as Kimi Linear's): greedy decoding of this tiny model reaches the pad token
    "solar_open": ("SolarOpenConfig", dict(_SHARED_MOE, head_dim=16, n_routed_experts=4, pad_token_id=None)),
    "hunyuan_v1_moe": (  # q/k norms per head; the shared expert beside the experts in every layer
        "HunYuanMoEV1Config",
        dict(
            KV,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            moe_topk=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            pad_token_id=None,
        ),
    ),
    "dots1": (  # per-head q/k norms, a dense first layer, sliding-window layers after max_window_layers
        "Dots1Config",
        dict(
            KV,
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            sliding_window=4,
            max_window_layers=2,
            pad_token_id=0,
        ),
    ),
    "hy_v3": ("HYV3Config", dict(_SHARED_MOE, head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"])),
    # the same after an attention with a gate on its output (Laguna, MiniCPM 5) or sinks (Flint)
    "laguna": (
        "LagunaConfig",
        dict(
            _SHARED_MOE, head_dim=16, shared_expert_intermediate_size=48, mlp_layer_types=["dense", "sparse", "sparse"]
        ),
    ),
    "minicpm5_moe": (
        "MiniCPM5MoeConfig",
        dict(
            _SHARED_MOE,
            head_dim=16,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            mlp_layer_types=["dense", "sparse", "sparse"],
            pad_token_id=None,  # a zero pad embedding (as Kimi Linear's)
        ),
    ),
    "flint": (
        "FlintConfig",
        dict(
            _SHARED_MOE,
            head_dim=16,
            shared_expert_intermediate_size=48,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            pad_token_id=None,  # a zero pad embedding (as Kimi Linear's)
        ),
    ),
    # the same after latent attention
    "deepseek_v2": ("DeepseekV2Config", dict(LATENT, first_k_dense_replace=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(LATENT, first_k_dense_replace=1, num_nextn_predict_layers=0)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(LATENT, mlp_layer_types=["dense", "sparse", "sparse"])),
    "sarvam_mla": ("SarvamMLAConfig", dict(LATENT, first_k_dense_replace=1)),
    # the same with indexed sparse attention: each query attends to its index_topk best keys (4 of up to 12)
    "deepseek_v32": (
        "DeepseekV32Config",
        dict(LATENT, first_k_dense_replace=1, index_topk=4, index_head_dim=16, index_n_heads=2, pad_token_id=None),
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        dict(LATENT, first_k_dense_replace=1, index_topk=4, index_head_dim=16, index_n_heads=2, pad_token_id=None),
    ),
    # Kimi delta attention beside latent attention, shared experts after a dense first layer
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            LATENT,
            num_experts=4,
            num_experts_per_token=2,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_head_dim=16,
            linear_num_heads=4,
            pad_token_id=None,  # a zero pad embedding: alone, its MLP input would be exactly zero (no patch)
        ),
    ),
    # the same in Ling 3 (bailing_hybrid), its latent attention gated per head, DeepSeek's grouped router
    "bailing_hybrid": (
        "BailingHybridConfig",
        dict(
            SMALL,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=16,  # Kimi delta attention's heads (the latent attention's rotary part: qk_rope_head_dim)
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            pad_token_id=None,
        ),
    ),
    # DeepSeek V3.2's indexed attention with gated norms and a gate on the attention's output (A.X-K2)
    "axk2": (
        "AXK2Config",
        dict(
            LATENT,
            first_k_dense_replace=1,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            gated_norm_rank=8,
            n_group=None,
            topk_group=None,
            pad_token_id=None,
        ),
    ),
    # a norm after the whole mixture of experts: GLM-4's four norms (Kolibri), DeepSeek V3's block (AXK1)
    "kolibri1": (
        "Kolibri1Config",
        dict(
            _SHARED_MOE,
            head_dim=16,
            shared_expert_intermediate_size=48,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "axk1": ("AXK1Config", dict(LATENT, mlp_layer_types=["dense", "sparse", "sparse"])),
    # Kolibri 1.1: a plain first layer, sliding-window layers and indexed ones, the last reading layer 1's
    # keys and values (its own indexer pool from layer 1's)
    "kolibri1_1": (
        "Kolibri1_1Config",
        dict(
            _SHARED_MOE,
            pad_token_id=None,  # a zero pad embedding (as Kimi Linear's): greedy decoding reaches it
            num_hidden_layers=4,
            head_dim=16,
            shared_expert_intermediate_size=48,
            sliding_window=4,
            layer_types=["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
            index_layers=[1],
            kv_source_layers=[0, 1, 2, 1],
            index_topk=4,
            index_pool_size=16,
            index_compression=4,
            index_num_heads=2,
            index_num_local_tokens=2,
            index_num_sink_tokens=1,
            mlp_only_layers=[0],
            mlp_only_intermediate_size=96,
        ),
    ),
}
