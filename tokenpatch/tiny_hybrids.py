"""The tiny random configurations of the hybrid and recurrent designs (``arch.recurrent``): a recurrent
or convolutional mixer in some or all layers. Part of ``tiny_configs.TINY_HF``, read as it is."""

from __future__ import annotations

from tokenpatch.tiny_sizes import KV, SMALL

__all__ = ["TINY_HYBRIDS"]

_DELTA = dict(  # Gated DeltaNet: 2 key heads, 4 value heads
    KV,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    pad_token_id=0,
)
_DELTA_MOE = dict(
    _DELTA, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2
)
_JAMBA = dict(KV, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8)
_MAMBA = dict(
    hidden_size=64,
    intermediate_size=96,
    state_size=8,
    time_step_rank=8,
    num_hidden_layers=3,
    vocab_size=101,
    residual_in_fp32=False,
    pad_token_id=0,
)
# Granite 4's layers (Mamba 2 beside Granite's attention, its multipliers); with or without experts below
_GRANITE4 = dict(
    KV,
    shared_intermediate_size=96,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    position_embedding_type="rope",
    mamba_n_heads=8,
    mamba_d_state=8,
    mamba_chunk_size=8,
    embedding_multiplier=3.0,
    residual_multiplier=0.7,
    attention_multiplier=0.2,
    logits_scaling=2.0,
    pad_token_id=0,
)
TINY_HYBRIDS: dict[str, tuple[str, dict]] = {
    "recurrent_gemma": (  # RG-LRU recurrent blocks beside local multi-query attention (Griffin)
        "RecurrentGemmaConfig",
        dict(
            SMALL,
            intermediate_size=192,  # its MLP is half as wide
            num_key_value_heads=1,
            lru_width=64,
            attention_window_size=5,
            block_types=["recurrent", "attention", "recurrent"],
            pad_token_id=0,
        ),
    ),
    "lfm2": (  # gated short convolutions beside attention (q/k norms)
        "Lfm2Config",
        dict(KV, layer_types=["conv", "full_attention", "conv"], pad_token_id=0),
    ),
    # Gated DeltaNet layers beside gated attention (Qwen3.5: 3 of every 4 layers), a dense MLP or experts
    "qwen3_5_text": ("Qwen3_5TextConfig", _DELTA),
    "qwen3_5": ("Qwen3_5Config", dict(text_config=_DELTA)),
    "qwen3_next": ("Qwen3NextConfig", dict(_DELTA_MOE, mlp_only_layers=[1])),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", _DELTA_MOE),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", dict(text_config=_DELTA_MOE)),
    # the same with sliding-window attention layers and an ungated shared expert
    "lara_mini": (
        "LaraMiniConfig",
        dict(_DELTA_MOE, sliding_window=4, layer_types=["linear_attention", "sliding_attention", "full_attention"]),
    ),
    # Mamba layers beside attention (every other one), experts in every other layer
    # lightning attention beside softmax attention, Mixtral's experts, a normalised residual stream
    "minimax": (
        "MiniMaxConfig",
        dict(
            KV,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            block_size=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            full_attn_alpha_factor=0.8,
            full_attn_beta_factor=1.3,
            linear_attn_alpha_factor=0.9,
            linear_attn_beta_factor=1.1,
            mlp_alpha_factor=0.6,
            mlp_beta_factor=1.7,
        ),
    ),
    "jamba": ("JambaConfig", dict(_JAMBA, num_experts=4, num_experts_per_tok=2)),
    "jamba_dense": ("JambaConfig", dict(_JAMBA, num_experts=1)),
    "bamba": (  # Mamba 2 layers beside attention (layers 1), a dense MLP everywhere
        "BambaConfig",
        dict(KV, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8),
    ),
    "lfm2_moe": (  # LFM2 with experts after its first (dense) layer
        "Lfm2MoeConfig",
        dict(
            KV,
            layer_types=["conv", "full_attention", "conv"],
            moe_intermediate_size=32,
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
        ),
    ),
    # OLMo 2's attention layers between Gated DeltaNet layers of Llama's form
    "olmo_hybrid": (
        "OlmoHybridConfig",
        # no padding_idx: a zero-embedding token (the pad) meets no norm before OLMo 2's attention, so alone its
        # MLP input would be exactly zero while the context moves it (no minimal patch: ZeroAnchorError)
        dict(
            _DELTA,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            pad_token_id=None,
            eos_token_id=None,
        ),
    ),
    # no MLP: the patch is the input change of the mixer's out_proj (residual_in_fp32 would round a float64 model)
    "mamba": ("MambaConfig", _MAMBA),
    "falcon_mamba": ("FalconMambaConfig", _MAMBA),
    "mamba2": ("Mamba2Config", dict(_MAMBA, num_heads=8, head_dim=16, n_groups=1, chunk_size=8)),
    # one sublayer per block (Mamba 2, experts, attention, MLP), none followed by an MLP (FLOAT32_INSIDE:
    # its scan and its experts' router compute in float32 whatever the model dtype)
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            KV,
            num_hidden_layers=4,
            head_dim=16,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            ssm_state_size=8,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=1,
            chunk_size=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            residual_in_fp32=False,
        ),
    ),
    # a Mamba 2 layer beside the attention in every layer; multipliers everywhere
    "falcon_h1": (
        "FalconH1Config",
        dict(
            KV,
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=8,
            mlp_multipliers=[0.9, 1.3],
            pad_token_id=0,
        ),
    ),
    # LFM2's layers with a sigmoid gate per head on the attention's output and norms after each sublayer
    # (LFM3: sliding-window and full attention); and without either (lfm3_plain)
    "lfm3": (
        "Lfm3Config",
        dict(
            KV,
            head_dim=16,
            layer_types=["conv", "sliding_attention", "full_attention"],
            sliding_window=4,
            pad_token_id=0,
        ),
    ),
    "lfm3_plain": (
        "Lfm3Config",
        dict(
            KV,
            head_dim=16,
            layer_types=["conv", "full_attention", "conv"],
            use_sandwich_norm=False,
            use_attention_gate=False,
            pad_token_id=0,
        ),
    ),
    # Granite 4 without experts: Mamba 2 layers beside Granite's attention (rotary), one gated MLP each
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(_GRANITE4, num_local_experts=0)),
    # Granite 4 with experts: a mixture of experts beside the shared MLP after each mixer
    "granitemoehybrid_moe": ("GraniteMoeHybridConfig", dict(_GRANITE4, num_local_experts=4, num_experts_per_tok=2)),
}
