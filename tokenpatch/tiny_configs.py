"""The tiny random Hugging Face configurations tokenpatch checks to float64 rounding, one per block
design (``arch.families.FAMILIES``), and what each needs to run exactly: read by
``tokenpatch.testing.tiny_hf_model``, the tests and ``benchmarks/hf_families.py``."""

from __future__ import annotations

__all__ = ["TINY_HF", "EAGER_ONLY", "NO_ATTENTION", "MOE", "FLOAT32_INSIDE"]

# One tiny random configuration per block design tokenpatch patches (``arch.families.FAMILIES``), as
# ``(transformers config class, keyword arguments)``: what tokenpatch's tests check to float64
# rounding, and what ``benchmarks/hf_families.py`` measures for ``docs/hugging-face.md``.
_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=101)
_KV = dict(_SMALL, num_key_value_heads=2)
_OPT = dict(
    hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=101, max_position_embeddings=64
)
_DELTA = dict(  # Gated DeltaNet: 2 key heads, 4 value heads
    _KV,
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
_SHARED_MOE = dict(_KV, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, pad_token_id=0)
_LATENT = dict(  # DeepSeek's latent attention: queries and keys/values through low-rank latents
    _SMALL,
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
_JAMBA = dict(_KV, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8)
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
TINY_HF: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", _KV),
    "qwen2": ("Qwen2Config", _KV),  # biases on q, k, v
    "qwen3": ("Qwen3Config", dict(_KV, head_dim=16)),  # q/k norms
    "mistral": ("MistralConfig", dict(_KV, sliding_window=5)),
    "gemma": ("GemmaConfig", dict(_KV, head_dim=16, pad_token_id=0)),  # Gemma 1: llama's form
    "gemma2": ("Gemma2Config", dict(_KV, head_dim=16, sliding_window=5)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            _SMALL,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, n_positions=64)),
    "gpt_neox": ("GPTNeoXConfig", dict(_SMALL, rotary_pct=0.5)),  # parallel residual
    "gpt_neox_sequential": ("GPTNeoXConfig", dict(_SMALL, use_parallel_residual=False)),
    # mixture of experts with a shared expert; layer 1 a plain MLP
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            _KV,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    # mixture of experts without a shared expert (the output shift split over the chosen experts)
    "mixtral": ("MixtralConfig", dict(_KV, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (  # layer 1 a plain MLP; the routing weights not renormalised
        "Qwen3MoeConfig",
        dict(_KV, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]),
    ),
    "olmoe": ("OlmoeConfig", dict(_KV, num_experts=4, num_experts_per_tok=2, pad_token_id=0, clip_qkv=0.1)),
    "phimoe": ("PhimoeConfig", dict(_KV, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", dict(_KV, pad_token_id=0)),  # fused qkv and gate_up
    "olmo": (
        "OlmoConfig",
        dict(_KV, pad_token_id=0, clip_qkv=0.1),
    ),  # norms without parameters, values clipped in place
    "stablelm": ("StableLmConfig", dict(_KV, qk_layernorm=True)),
    "starcoder2": ("Starcoder2Config", _KV),  # biases, a plain MLP
    "granite": (  # multipliers on the embedding, each sublayer, attention, logits
        "GraniteConfig",
        dict(_KV, embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.0),
    ),
    "olmo2": ("Olmo2Config", dict(_KV, pad_token_id=0)),  # norms after the sublayers
    "phi": ("PhiConfig", dict(_SMALL, qk_layernorm=True)),  # parallel, partial rotary
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, rotary_dim=8, n_positions=64)),
    "cohere": ("CohereConfig", dict(_KV, use_qk_norm=True)),  # parallel
    "stablelm_parallel": ("StableLmConfig", dict(_KV, use_parallel_residual=True)),
    "falcon": ("FalconConfig", dict(_SMALL, bias=True)),  # parallel attention, one norm
    "falcon_new": ("FalconConfig", dict(_SMALL, new_decoder_architecture=True, num_kv_heads=2)),  # two norms
    "falcon_sequential": ("FalconConfig", dict(_SMALL, parallel_attn=False)),
    # the same designs under other model_types (other attention, norms, names: one tiny model each)
    "bitnet": ("BitNetConfig", dict(_KV, pad_token_id=0)),
    "cwm": ("CwmConfig", dict(_KV, head_dim=16)),
    "diffllama": ("DiffLlamaConfig", dict(_KV, pad_token_id=0)),  # differential attention
    "ernie4_5": ("Ernie4_5Config", dict(_KV, head_dim=16, pad_token_id=0)),
    "exaone": ("ExaoneConfig", dict(_KV, pad_token_id=0)),
    "helium": ("HeliumConfig", dict(_KV, head_dim=16, pad_token_id=0)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(_KV, head_dim=16, pad_token_id=0)),
    "internlm3": ("InternLM3Config", dict(_KV, head_dim=16, pad_token_id=0)),
    "iquestcoder": ("IQuestCoderConfig", dict(_KV, head_dim=16, pad_token_id=0)),
    "ministral": ("MinistralConfig", dict(_KV, head_dim=16, pad_token_id=0)),
    "ministral3": ("Ministral3Config", dict(_KV, head_dim=16, pad_token_id=0)),
    "seed_oss": ("SeedOssConfig", dict(_KV, head_dim=16, pad_token_id=0)),
    "smollm3": ("SmolLM3Config", dict(_KV, pad_token_id=0)),
    "glm": ("GlmConfig", dict(_KV, head_dim=16, pad_token_id=0)),  # a fused gate_up_proj, as Phi-3
    "cohere2": ("Cohere2Config", dict(_KV, pad_token_id=0)),  # parallel, as Cohere
    "olmo3": ("Olmo3Config", dict(_KV, pad_token_id=0)),  # norms after the sublayers, as OLMo 2
    "exaone4": ("Exaone4Config", dict(_KV, pad_token_id=0)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, n_positions=64)),
    # learned positions offset by 2, the MLP two loose matrices run on [batch * positions, d]
    "opt": ("OPTConfig", _OPT),
    # OPT-350m: norms after the adds, embeddings of another width projected in and out
    "opt_post": ("OPTConfig", dict(_OPT, do_layer_norm_before=False, word_embed_proj_dim=32)),
    # the residual added inside the attention and MLP modules; ALiBi; eager attention only
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=3, n_head=4, vocab_size=101)),
    "arcee": ("ArceeConfig", dict(_KV, pad_token_id=0)),  # ReLU^2, up and down
    "nemotron": ("NemotronConfig", dict(_KV, head_dim=16, pad_token_id=0)),  # LayerNorm1P (1 + w)
    "jais2": ("Jais2Config", dict(_KV, head_dim=16, pad_token_id=0)),
    "apertus": ("ApertusConfig", dict(_KV, pad_token_id=0)),  # xIELU, norms named for the sublayers
    "nanochat": ("NanoChatConfig", dict(_KV, pad_token_id=0)),
    "vaultgemma": ("VaultGemmaConfig", dict(_KV, head_dim=16, pad_token_id=0)),
    "minicpm3": (  # latent attention, scaled sublayers
        "MiniCPM3Config",
        dict(
            _SMALL,
            q_lora_rank=32,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            kv_lora_rank=16,
            v_head_dim=16,
            scale_depth=1.4,
            pad_token_id=0,
        ),
    ),
    "persimmon": ("PersimmonConfig", dict(_SMALL, pad_token_id=0)),
    "gpt_neo": (  # one global and two local attention layers
        "GPTNeoConfig",
        dict(
            hidden_size=64,
            num_layers=3,
            num_heads=4,
            vocab_size=101,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1], [["local"], 1]],
            window_size=4,
        ),
    ),
    "codegen": ("CodeGenConfig", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, n_positions=64, rotary_dim=8)),
    "mpt": ("MptConfig", dict(d_model=64, n_heads=4, n_layers=3, vocab_size=101, expansion_ratio=2)),
    "glm4": ("Glm4Config", dict(_KV, head_dim=16, pad_token_id=0)),  # Gemma 2's norms, a fused gate_up_proj
    "biogpt": (
        "BioGptConfig",
        dict(_SMALL, max_position_embeddings=64, pad_token_id=0),
    ),  # OPT's loose fc1/fc2, positions offset by 2
    # mixtures of experts with a shared expert added ungated, a plain MLP in the first layer
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        dict(_KV, moe_intermediate_size=32, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1, pad_token_id=0),
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
    # the same after latent attention
    "deepseek_v2": ("DeepseekV2Config", dict(_LATENT, first_k_dense_replace=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(_LATENT, first_k_dense_replace=1, num_nextn_predict_layers=0)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(_LATENT, mlp_layer_types=["dense", "sparse", "sparse"])),
    # Kimi delta attention beside latent attention, shared experts after a dense first layer
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            _LATENT,
            num_experts=4,
            num_experts_per_token=2,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_head_dim=16,
            linear_num_heads=4,
            pad_token_id=None,  # a zero pad embedding: alone, its MLP input would be exactly zero (no patch)
        ),
    ),
    # hybrids: a recurrent or convolutional mixer in some layers (arch.recurrent)
    "recurrent_gemma": (  # RG-LRU recurrent blocks beside local multi-query attention (Griffin)
        "RecurrentGemmaConfig",
        dict(
            _SMALL,
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
        dict(_KV, layer_types=["conv", "full_attention", "conv"], pad_token_id=0),
    ),
    # Gated DeltaNet layers beside gated attention (Qwen3.5: 3 of every 4 layers), a dense MLP or experts
    "qwen3_5_text": ("Qwen3_5TextConfig", _DELTA),
    "qwen3_5": ("Qwen3_5Config", dict(text_config=_DELTA)),
    "qwen3_next": ("Qwen3NextConfig", dict(_DELTA_MOE, mlp_only_layers=[1])),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", _DELTA_MOE),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", dict(text_config=_DELTA_MOE)),
    # Mamba layers beside attention (every other one), experts in every other layer
    "jamba": ("JambaConfig", dict(_JAMBA, num_experts=4, num_experts_per_tok=2)),
    "jamba_dense": ("JambaConfig", dict(_JAMBA, num_experts=1)),
    "bamba": (  # Mamba 2 layers beside attention (layers 1), a dense MLP everywhere
        "BambaConfig",
        dict(_KV, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8),
    ),
    "lfm2_moe": (  # LFM2 with experts after its first (dense) layer
        "Lfm2MoeConfig",
        dict(
            _KV,
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
            _KV,
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
            _KV,
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=8,
            mlp_multipliers=[0.9, 1.3],
            pad_token_id=0,
        ),
    ),
}
# transformers casts to float32 inside these whatever the model dtype (the chunked scans of Gated DeltaNet
# and Mamba 2; mixture-of-experts routers): a float64 model's own forward of a left-padded row differs from the row alone's by
# ~1e-8, a cached step from the full forward. Their tests run under ``testing.float64_everywhere``.
# mixtures of experts with an ungated shared expert: eager experts, and their routers cast to float32
_SHARED_EXPERTS = (
    "ernie4_5_moe",
    "exaone_moe",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "kimi_linear",
)
FLOAT32_INSIDE = (
    "recurrent_gemma",
    "qwen3_5_text",
    "qwen3_5",
    "qwen3_next",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    "falcon_h1",
    "mamba2",
    "nemotron_h",
    "olmo_hybrid",
    "bamba",
    *_SHARED_EXPERTS,
)
EAGER_ONLY = ("gemma2", "bloom", "vaultgemma", "gpt_neo", "mpt")  # transformers has no sdpa path for these
NO_ATTENTION = ("mamba", "falcon_mamba", "mamba2")  # transformers accepts no attention implementation but eager
MOE = (
    "qwen2_moe",
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "phimoe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    "jamba",
    "lfm2_moe",
    *_SHARED_EXPERTS,
)  # run with transformers' eager experts
