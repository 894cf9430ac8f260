"""The tiny random Hugging Face configurations tokenpatch checks to float64 rounding, one per block
design (``arch.families.FAMILIES``), and what each needs to run exactly: read by
``tokenpatch.testing.tiny_hf_model``, the tests and ``benchmarks/hf_families.py``."""

from __future__ import annotations

from tokenpatch.tiny_hybrids import TINY_HYBRIDS
from tokenpatch.tiny_moe_blocks import MOE_BLOCKS_EAGER_ONLY, MOE_BLOCKS_MOE, TINY_MOE_BLOCKS
from tokenpatch.tiny_multimodal import TINY_MULTIMODAL
from tokenpatch.tiny_shared_experts import LATENT, TINY_SHARED_EXPERTS
from tokenpatch.tiny_sizes import KV, SMALL

__all__ = ["TINY_HF", "EAGER_ONLY", "NO_ATTENTION", "MOE", "FLOAT32_INSIDE"]

# One tiny random configuration per block design tokenpatch patches (``arch.families.FAMILIES``), as
# ``(transformers config class, keyword arguments)``: what tokenpatch's tests check to float64
# rounding, and what ``benchmarks/hf_families.py`` measures for ``docs/hugging-face.md``.
_OPT = dict(
    hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=101, max_position_embeddings=64
)
TINY_HF: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", KV),
    "qwen2": ("Qwen2Config", KV),  # biases on q, k, v
    "qwen3": ("Qwen3Config", dict(KV, head_dim=16)),  # q/k norms
    "mistral": ("MistralConfig", dict(KV, sliding_window=5)),
    "gemma": ("GemmaConfig", dict(KV, head_dim=16, pad_token_id=0)),  # Gemma 1: llama's form
    "gemma2": ("Gemma2Config", dict(KV, head_dim=16, sliding_window=5)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            SMALL,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, n_positions=64)),
    # GPT-SW3: GPT-2's classes; a checkpoint's config keeps model_type "gpt-sw3" (its config.json's)
    "gpt-sw3": (
        "GPT2Config",
        dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, n_positions=64, model_type="gpt-sw3"),
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, rotary_pct=0.5)),  # parallel residual
    "gpt_neox_sequential": ("GPTNeoXConfig", dict(SMALL, use_parallel_residual=False)),
    # mixture of experts with a shared expert; layer 1 a plain MLP
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            KV,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    # mixture of experts without a shared expert (the output shift split over the chosen experts)
    "mixtral": ("MixtralConfig", dict(KV, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (  # layer 1 a plain MLP; the routing weights not renormalised
        "Qwen3MoeConfig",
        dict(KV, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]),
    ),
    "olmoe": ("OlmoeConfig", dict(KV, num_experts=4, num_experts_per_tok=2, pad_token_id=0, clip_qkv=0.1)),
    "phimoe": ("PhimoeConfig", dict(KV, num_local_experts=4, num_experts_per_tok=2)),
    "minimax_m2": ("MiniMaxM2Config", dict(KV, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    "mellum": (
        "MellumConfig",
        dict(KV, head_dim=16, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    ),
    "gpt_oss": (  # sinks, experts stored transposed with biases; sliding and full attention layers
        "GptOssConfig",
        dict(
            KV,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=4,
            pad_token_id=0,
        ),
    ),
    "mimo_v2_flash": (  # sinks in the sliding-window layers, a dense first layer
        "MiMoV2FlashConfig",
        dict(
            KV,
            head_dim=16,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
    ),
    "cohere2_moe": (  # parallel, Mixtral's experts
        "Cohere2MoeConfig",
        dict(
            KV,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            pad_token_id=0,
        ),
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        dict(KV, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, residual_multiplier=0.7),
    ),
    "zaya": (  # one expert per token, a router MLP reading the previous layer's, residual scaling per channel
        "ZayaConfig",
        dict(
            KV,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            router_hidden_size=16,
            layer_types=["hybrid", "hybrid_sliding", "hybrid"],
            sliding_window=4,
            bos_token_id=None,
            eos_token_id=None,
        ),
    ),
    "phi3": ("Phi3Config", dict(KV, pad_token_id=0)),  # fused qkv and gate_up
    "olmo": (
        "OlmoConfig",
        dict(KV, pad_token_id=0, clip_qkv=0.1),
    ),  # norms without parameters, values clipped in place
    "stablelm": ("StableLmConfig", dict(KV, qk_layernorm=True)),
    "starcoder2": ("Starcoder2Config", KV),  # biases, a plain MLP
    "granite": (  # multipliers on the embedding, each sublayer, attention, logits
        "GraniteConfig",
        dict(KV, embedding_multiplier=3.0, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.0),
    ),
    "granite_swa": (
        "GraniteSWAConfig",
        dict(
            KV,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            embedding_multiplier=3.0,
            residual_multiplier=0.7,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        ),
    ),
    "olmo2": ("Olmo2Config", dict(KV, pad_token_id=0)),  # norms after the sublayers
    "hyperclovax": ("HyperCLOVAXConfig", dict(KV, head_dim=16, embedding_multiplier=3.0, logits_scaling=2.0)),
    "phi": ("PhiConfig", dict(SMALL, qk_layernorm=True)),  # parallel, partial rotary
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, rotary_dim=8, n_positions=64)),
    "cohere": ("CohereConfig", dict(KV, use_qk_norm=True)),  # parallel
    "stablelm_parallel": ("StableLmConfig", dict(KV, use_parallel_residual=True)),
    "falcon": ("FalconConfig", dict(SMALL, bias=True)),  # parallel attention, one norm
    "falcon_new": ("FalconConfig", dict(SMALL, new_decoder_architecture=True, num_kv_heads=2)),  # two norms
    "falcon_sequential": ("FalconConfig", dict(SMALL, parallel_attn=False)),
    # the same designs under other model_types (other attention, norms, names: one tiny model each)
    "bitnet": ("BitNetConfig", dict(KV, pad_token_id=0)),
    "cwm": ("CwmConfig", dict(KV, head_dim=16)),
    "diffllama": ("DiffLlamaConfig", dict(KV, pad_token_id=0)),  # differential attention
    "ernie4_5": ("Ernie4_5Config", dict(KV, head_dim=16, pad_token_id=0)),
    "exaone": ("ExaoneConfig", dict(KV, pad_token_id=0)),
    "helium": ("HeliumConfig", dict(KV, head_dim=16, pad_token_id=0)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(KV, head_dim=16, pad_token_id=0)),
    "internlm3": ("InternLM3Config", dict(KV, head_dim=16, pad_token_id=0)),
    "iquestcoder": ("IQuestCoderConfig", dict(KV, head_dim=16, pad_token_id=0)),
    "ministral": ("MinistralConfig", dict(KV, head_dim=16, pad_token_id=0)),
    "ministral3": ("Ministral3Config", dict(KV, head_dim=16, pad_token_id=0)),
    "seed_oss": ("SeedOssConfig", dict(KV, head_dim=16, pad_token_id=0)),
    "smollm3": ("SmolLM3Config", dict(KV, pad_token_id=0)),
    "glm": ("GlmConfig", dict(KV, head_dim=16, pad_token_id=0)),  # a fused gate_up_proj, as Phi-3
    "cohere2": ("Cohere2Config", dict(KV, pad_token_id=0)),  # parallel, as Cohere
    "olmo3": ("Olmo3Config", dict(KV, pad_token_id=0)),  # norms after the sublayers, as OLMo 2
    "exaone4": ("Exaone4Config", dict(KV, pad_token_id=0)),
    "openai-gpt": (  # GPT-1: norms after each residual add
        "OpenAIGPTConfig",
        dict(n_embd=64, n_layer=3, n_head=4, n_positions=64, vocab_size=101),
    ),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=101, n_positions=64)),
    # learned positions offset by 2, the MLP two loose matrices run on [batch * positions, d]
    "opt": ("OPTConfig", _OPT),
    # OPT-350m: norms after the adds, embeddings of another width projected in and out
    "opt_post": ("OPTConfig", dict(_OPT, do_layer_norm_before=False, word_embed_proj_dim=32)),
    # the residual added inside the attention and MLP modules; ALiBi; eager attention only
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=3, n_head=4, vocab_size=101)),
    "arcee": ("ArceeConfig", dict(KV, pad_token_id=0)),  # ReLU^2, up and down
    "nemotron": ("NemotronConfig", dict(KV, head_dim=16, pad_token_id=0)),  # LayerNorm1P (1 + w)
    "jais2": ("Jais2Config", dict(KV, head_dim=16, pad_token_id=0)),
    "apertus1p5_text": ("Apertus1p5TextConfig", dict(KV, pad_token_id=0)),
    "apertus": ("ApertusConfig", dict(KV, pad_token_id=0)),  # xIELU, norms named for the sublayers
    "nanochat": ("NanoChatConfig", dict(KV, pad_token_id=0)),
    "vaultgemma": ("VaultGemmaConfig", dict(KV, head_dim=16, pad_token_id=0)),
    "minicpm3": (  # latent attention, scaled sublayers
        "MiniCPM3Config",
        dict(
            SMALL,
            q_lora_rank=32,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            kv_lora_rank=16,
            v_head_dim=16,
            scale_depth=1.4,
            pad_token_id=0,
        ),
    ),
    "youtu": ("YoutuConfig", dict(LATENT, intermediate_size=96)),  # latent attention, a dense MLP
    "persimmon": ("PersimmonConfig", dict(SMALL, pad_token_id=0)),
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
    "glm4": ("Glm4Config", dict(KV, head_dim=16, pad_token_id=0)),  # Gemma 2's norms, a fused gate_up_proj
    "biogpt": (
        "BioGptConfig",
        dict(SMALL, max_position_embeddings=64, pad_token_id=0),
    ),  # OPT's loose fc1/fc2, positions offset by 2
    # the sequential form under other names (arch.renamed): sinusoidal absolute positions (CTRL, XGLM)
    "ctrl": ("CTRLConfig", dict(n_embd=64, dff=96, n_layer=3, n_head=4, vocab_size=101, n_positions=64)),
    "xglm": ("XGLMConfig", dict(_OPT, pad_token_id=0)),  # hidden_size, ... as d_model, ... (attribute_map)
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", dict(SMALL, intermediate_multiple_size=2)),
    "modernbert-decoder": (  # local attention in two layers of three; the first layer's attention norm an Identity
        "ModernBertDecoderConfig",
        dict(SMALL, local_attention=8, mlp_bias=True, norm_bias=True, pad_token_id=0),
    ),
    # per-channel residual weights (moved off init); each query keeps its 4 best keys by the value-made mask
    "doge": ("DogeConfig", dict(KV, keep_window_size=4, pad_token_id=0)),
    "emu3": ("Emu3Config", dict(text_config=dict(KV, pad_token_id=0))),  # Llama's block
    "cohere_compass_text": (  # Cohere's parallel block: M-RoPE in the sliding-window layers, no positions in the other
        "CohereCompassTextConfig",
        dict(
            KV,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2]),
                full_attention=None,
            ),
        ),
    ),
    **TINY_SHARED_EXPERTS,
    **TINY_MOE_BLOCKS,
    **TINY_HYBRIDS,
    **TINY_MULTIMODAL,
}
# transformers casts to float32 inside these whatever the model dtype (the chunked scans of Gated DeltaNet
# and Mamba 2; mixture-of-experts routers): a float64 model's own forward of a left-padded row differs from the row alone's by
# ~1e-8, a cached step from the full forward. Their tests run under ``testing.float64_everywhere``.
# mixtures of experts with an ungated shared expert: eager experts, and their routers cast to float32
_SHARED_EXPERTS = (
    "ernie4_5_moe",
    "dots1",
    "exaone_moe",
    "glm4_moe",
    "param2moe",
    "sarvam_moe",
    "solar_open",
    "sarvam_mla",
    "deepseek_v32",
    "glm_moe_dsa",
    "hy_v3",
    "hunyuan_v1_moe",
    "laguna",
    "minicpm5_moe",
    "flint",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "kimi_linear",
    "bailing_hybrid",
    "axk2",
    "kolibri1",
    "kolibri1_1",
    "axk1",
)
FLOAT32_INSIDE = (
    "xglm",  # its scores clamped at torch.full((), finfo(float64).min): a float32 tensor (overflows)
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
    "minimax_m2",
    "granitemoe",
    "mimo_v2_flash",
    "lara_mini",
    "granitemoehybrid",
    "granitemoehybrid_moe",
    *_SHARED_EXPERTS,
    *MOE_BLOCKS_MOE,
)
EAGER_ONLY = (  # transformers has no sdpa path for these
    "gemma2",
    "bloom",
    "vaultgemma",
    "gpt_neo",
    "mpt",
    "granite_swa",
    "mimo_v2_flash",
    "flint",
    "openai-gpt",
    "gpt_oss",
    "got_ocr2",
    "xglm",
    "gpt_neox_japanese",
    *MOE_BLOCKS_EAGER_ONLY,
)
NO_ATTENTION = ("mamba", "falcon_mamba", "mamba2")  # transformers accepts no attention implementation but eager
MOE = (
    "qwen2_moe",
    "zaya",
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "phimoe",
    "minimax_m2",
    "granitemoe",
    "mellum",
    "mimo_v2_flash",
    "gpt_oss",
    "aria_text",
    "cohere2_moe",
    "lara_mini",
    "minimax",
    "qwen3_next",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    "jamba",
    "lfm2_moe",
    "granitemoehybrid_moe",
    *_SHARED_EXPERTS,
    *MOE_BLOCKS_MOE,
)  # run with transformers' eager experts
