"""The tiny random configurations of the mixtures of experts of ``arch.moe_blocks`` (a shared MLP beside
Granite-MoE's experts block, Llama 4, AFMoE, MiniMax-M3, LongCat-Flash), of dots.llm3 Note, DBRX and JetMoE. Part of
``tiny_configs.TINY_HF``, read as it is."""

from __future__ import annotations

from tokenpatch.tiny_sizes import KV, SMALL

__all__ = ["TINY_MOE_BLOCKS", "MOE_BLOCKS_EAGER_ONLY", "MOE_BLOCKS_MOE"]

_GRANITE = dict(
    KV,
    num_local_experts=4,
    num_experts_per_tok=2,
    embedding_multiplier=3.0,
    residual_multiplier=0.7,
    attention_multiplier=0.2,
    logits_scaling=2.0,
)
_SWA = dict(_GRANITE, sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
_LLAMA4 = dict(
    KV,
    head_dim=16,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_layers=[0, 2],
    no_rope_layers=[1, 1, 0],
    attention_chunk_size=4,
    pad_token_id=0,
)
_DOTS3 = dict(
    SMALL,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_experts_intermediate_size=48,
    index_topk=4,
    index_head_dim=16,
    index_n_heads=2,
    sliding_window=4,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=4,
    swa_q_lora_rank=16,
    swa_kv_lora_rank=32,
    swa_head_dim=24,
    swa_qk_nope_head_dim=16,
    swa_v_head_dim=8,
    pad_token_id=None,  # a zero pad embedding (as Kimi Linear's)
)
TINY_MOE_BLOCKS: dict[str, tuple[str, dict]] = {
    # Granite-MoE's experts block and a shared MLP, two modules on one norm output; without the shared
    # MLP (shared_intermediate_size 0, the default) Granite-MoE's block
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(_GRANITE, shared_intermediate_size=48)),
    "granitemoeshared_routed": ("GraniteMoeSharedConfig", _GRANITE),
    # the same with attention sinks and sliding-window layers
    "granitemoe_swa": ("GraniteMoeSWAConfig", _SWA),
    "granitemoe_swa_shared": ("GraniteMoeSWAConfig", dict(_SWA, shared_intermediate_size=48)),
    # experts reading s times their routing weight, stored [E, in, out]; a dense layer 1; chunked
    # attention in the rotary layers, a layer without rotary positions (2)
    "llama4_text": ("Llama4TextConfig", _LLAMA4),
    "llama4": ("Llama4Config", dict(text_config=_LLAMA4)),  # its causal LM: the text model
    # Gemma 2's four norms around shared and routed experts; a gate on the attention output; a dense layer 0
    "afmoe": (
        "AfmoeConfig",
        dict(
            KV,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            num_dense_layers=1,
            route_scale=1.5,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            pad_token_id=0,
        ),
    ),
    # DeepSeek V3.2's indexed latent attention (layers 0, 1) with a gate on its output, a sliding-window
    # latent attention (2) of other sizes; a dense layer 0
    "dots3_note_text": ("Dots3NoteTextConfig", _DOTS3),
    "dots3_note": (  # its causal LM: the text model (the adapters must give its width)
        "Dots3NoteConfig",
        dict(text_config=_DOTS3, vision_config=dict(adapter_out_dim=64), audio_config=dict(adapter_out_dim=64)),
    ),
    # a fused gate-up shared expert beside routed experts (scaled by routed_scaling_factor); a dense layer 0
    "minimax_m3_vl_text": (
        "MiniMaxM3VLTextConfig",
        dict(
            KV,
            head_dim=16,
            intermediate_size=32,
            dense_intermediate_size=96,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            rotary_dim=8,
            mlp_layer_types=["dense", "sparse", "sparse"],
            pad_token_id=0,
        ),
    ),
    # two latent-attention-and-MLP sublayers per layer, a shortcut mixture of experts (two of its six
    # experts the identity) across them
    "longcat_flash": (
        "LongcatFlashConfig",
        dict(
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            vocab_size=101,
            ffn_hidden_size=96,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            head_dim=8,
            v_head_dim=16,
            moe_topk=2,
            n_routed_experts=4,
            zero_expert_num=2,
            expert_ffn_hidden_size=32,
            routed_scaling_factor=1.5,
            pad_token_id=0,
        ),
    ),
    # its experts' matrices stacked along their rows; a fused, clipped query-key-value
    "dbrx": (
        "DbrxConfig",
        dict(
            d_model=64,
            n_heads=4,
            n_layers=3,
            max_seq_len=64,
            vocab_size=101,
            attn_config=dict(kv_n_heads=2, clip_qkv=4.0, rope_theta=10000.0),  # transformers reads it there
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
            pad_token_id=None,  # a zero pad embedding: greedy decoding reaches it, alone its MLP input is 0
        ),
    ),
    # a mixture of attention heads; a block that routes the tokens itself, an output bias after its experts
    "jetmoe": (
        "JetMoeConfig",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_key_value_heads=2,
            kv_channels=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=101,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
    ),
}
MOE_BLOCKS_EAGER_ONLY = ("granitemoe_swa", "granitemoe_swa_shared")  # sinks: no sdpa path
MOE_BLOCKS_MOE = tuple(TINY_MOE_BLOCKS)  # eager experts; routers that cast to float32
