"""Tiny random multimodal models whose text decoder tokenpatch patches (``arch.families.MULTIMODAL``): a tower
of one layer beside the decoder, which text never reaches; read by ``tiny_configs.TINY_HF``."""

from __future__ import annotations

from tokenpatch.tiny_sizes import KV, SMALL

__all__ = ["TINY_MULTIMODAL"]

TINY_MULTIMODAL: dict[str, tuple[str, dict]] = {
    "gemma3_multimodal": (  # Gemma 3 4B and up: Gemma 3's decoder inside the multimodal model, run on text
        "Gemma3Config",
        dict(
            text_config=dict(
                SMALL,
                model_type="gemma3_text",
                num_key_value_heads=1,
                head_dim=16,
                sliding_window=5,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            ),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
        ),
    ),
    "got_ocr2": (  # Qwen2's decoder inside GOT-OCR 2 (its vision tower has eager attention only)
        "GotOcr2Config",
        dict(
            text_config=dict(KV, model_type="qwen2"),
            vision_config=dict(
                hidden_size=32,
                output_channels=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                global_attn_indexes=[0],
                mlp_dim=64,
            ),
            image_token_index=100,
        ),
    ),
    "moss_transcribe_diarize": (  # Qwen3's decoder after an audio encoder
        "MossTranscribeDiarizeConfig",
        dict(
            text_config=dict(KV, head_dim=16, model_type="qwen3"),
            audio_config=dict(
                num_mel_bins=8,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                hidden_size=16,
                max_source_positions=16,
            ),
            audio_token_id=100,
        ),
    ),
    "fuyu": (  # Persimmon's decoder inside Fuyu's multimodal model, run on text
        "FuyuConfig",
        dict(
            text_config=dict(SMALL, pad_token_id=0, model_type="persimmon"),
            vocab_size=101,
            hidden_size=64,
            patch_size=4,
            num_channels=3,
        ),
    ),
}
