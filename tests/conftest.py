"""Shared fixtures: tiny random models with every norm and bias moved away from its init,
so a missing term in a patch cannot hide behind gamma = 1, beta = 0."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import tokenpatch as tp
from tokenpatch.testing import perturbed

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("thorough", deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=200)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
settings.load_profile(PROFILE)

# Examples per parametrised case of the main exactness sweep (tests/test_equivalence.py): small by
# default, large under HYPOTHESIS_PROFILE=thorough. Use ``@sweep``, never a hard-coded max_examples.
SWEEP_EXAMPLES = {"default": 8, "thorough": 100}
sweep = settings(max_examples=SWEEP_EXAMPLES[PROFILE])

torch.set_num_threads(min(2, torch.get_num_threads()))


def random_model(config: tp.ICLConfig, seed: int = 0, dtype=torch.float64) -> tp.ICLTransformer:
    torch.manual_seed(seed)
    return perturbed(tp.ICLTransformer(config).to(dtype), seed)


def random_block(config: tp.ICLConfig, seed: int = 0, dtype=torch.float64) -> tp.Block:
    torch.manual_seed(seed)
    return perturbed(tp.Block(config).to(dtype), seed)


@pytest.fixture
def small_model() -> tp.ICLTransformer:
    return random_model(tp.ICLConfig(d_in=5, d_model=8, n_layers=3, n_heads=2, norm="pre"), seed=1)


@pytest.fixture
def small_inputs() -> torch.Tensor:
    return torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def non_snake_keys(obj) -> list[str]:
    """Every key of a JSON-able nest of dicts and lists that is not snake_case (results.json keys)."""
    import re

    if isinstance(obj, dict):
        return [k for k in obj if not re.fullmatch(r"[a-z0-9_]+", str(k))] + [
            b for v in obj.values() for b in non_snake_keys(v)
        ]
    if isinstance(obj, list):
        return [b for v in obj for b in non_snake_keys(v)]
    return []


# Real pretrained models (tokenpatch.workbench.zoo.pretrained), each loaded once per session by the tests that ask for it
# (tests marked ``slow``). They are cached in $TOKENPATCH_CACHE when that is set (set it to reuse the float32
# copies across runs: about 20 s + 45 s saved), else in a folder of this session's pytest tmp dir.
# The fixtures' models are shared by every test of the session: never change their weights in place
# (patch a copy, or restore what you changed); they are in eval mode and float32.


@pytest.fixture(scope="session")
def pretrained_cache_dir(tmp_path_factory):
    """The cache root of the session's pretrained models ($TOKENPATCH_CACHE, else a session tmp folder)."""
    from pathlib import Path

    env = os.environ.get("TOKENPATCH_CACHE")
    return Path(env).expanduser() if env else tmp_path_factory.mktemp("tokenpatch-cache", numbered=False)


def load_session_pretrained(name: str, cache_dir):
    """``(model, tokenizer)`` of ``name`` in float32, or a skip saying which package to install."""
    from tokenpatch.workbench.zoo import pretrained

    try:
        pretrained.check_requirements(name)
    except tp.UnsupportedModelError as exc:
        if os.environ.get("TOKENPATCH_REQUIRE_REAL_MODELS", "") not in ("", "0"):  # CI: a promise, not optional
            pytest.fail(f"real model {name} not installed (TOKENPATCH_REQUIRE_REAL_MODELS is set): {exc}")
        pytest.skip(f"real model {name} not installed: {exc}")
    return pretrained.load_pretrained(name, dtype=torch.float32, cache_dir=cache_dir, progress=False)


@pytest.fixture(scope="session")
def smollm2(pretrained_cache_dir):
    """SmolLM2-135M-Instruct: ``(LlamaForCausalLM, tokenizer)``, 30 layers, float32, eval mode."""
    return load_session_pretrained("smollm2-135m", pretrained_cache_dir)


@pytest.fixture(scope="session")
def gemma3(pretrained_cache_dir):
    """Gemma 3 270M (Gemma Terms of Use): ``(Gemma3ForCausalLM, tokenizer)``, 18 layers, float32, eval mode."""
    return load_session_pretrained("gemma3-270m", pretrained_cache_dir)


# Tiny random Hugging Face models, one per block design (tokenpatch/arch/families.py), float64, with every
# norm weight and bias moved off its init. Without the Hugging Face extra, ``build`` skips the test.
try:
    import transformers as T
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.olmo2 import modeling_olmo2
except ImportError:  # pragma: no cover - the hf extra is part of the test install
    T = None


VOCAB = 101
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**SMALL, num_key_value_heads=2),
    "qwen2": lambda: T.Qwen2Config(**SMALL, num_key_value_heads=2),  # biases on q, k, v
    "qwen3": lambda: T.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16),  # q/k norms
    "mistral": lambda: T.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=5),
    "gemma": lambda: T.GemmaConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, pad_token_id=0
    ),  # Gemma 1: llama's form
    "gemma2": lambda: T.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=16, sliding_window=5),
    "gemma3": lambda: T.Gemma3TextConfig(
        **SMALL,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64),
    "gpt_neox": lambda: T.GPTNeoXConfig(**SMALL, rotary_pct=0.5),  # parallel residual
    "gpt_neox_sequential": lambda: T.GPTNeoXConfig(**SMALL, use_parallel_residual=False),
    # mixture of experts with a shared expert; layer 1 a plain MLP
    "qwen2_moe": lambda: T.Qwen2MoeConfig(
        **SMALL,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "phi3": lambda: T.Phi3Config(**SMALL, num_key_value_heads=2, pad_token_id=0),  # fused qkv and gate_up
    "olmo": lambda: T.OlmoConfig(**SMALL, num_key_value_heads=2, pad_token_id=0),  # norms without parameters
    "stablelm": lambda: T.StableLmConfig(**SMALL, num_key_value_heads=2, qk_layernorm=True),
    "starcoder2": lambda: T.Starcoder2Config(**SMALL, num_key_value_heads=2),  # biases, a plain MLP
    "granite": lambda: T.GraniteConfig(  # multipliers on the embedding, each sublayer, attention, logits
        **SMALL,
        num_key_value_heads=2,
        embedding_multiplier=3.0,
        residual_multiplier=0.7,
        attention_multiplier=0.2,
        logits_scaling=2.0,
    ),
    "olmo2": lambda: T.Olmo2Config(**SMALL, num_key_value_heads=2, pad_token_id=0),  # norms after the sublayers
    "phi": lambda: T.PhiConfig(**SMALL, qk_layernorm=True),  # parallel, partial rotary
    "gptj": lambda: T.GPTJConfig(n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, rotary_dim=8, n_positions=64),
    "cohere": lambda: T.CohereConfig(**SMALL, num_key_value_heads=2, use_qk_norm=True),  # parallel
    "stablelm_parallel": lambda: T.StableLmConfig(**SMALL, num_key_value_heads=2, use_parallel_residual=True),
    "falcon": lambda: T.FalconConfig(**SMALL, bias=True),  # parallel attention, one norm
    "falcon_new": lambda: T.FalconConfig(**SMALL, new_decoder_architecture=True, num_kv_heads=2),  # two norms
    "falcon_sequential": lambda: T.FalconConfig(**SMALL, parallel_attn=False),
}
GEMMAS = ("gemma2", "gemma3")


def build(name: str, seed: int = 0, attn: str | None = None):
    """A tiny random float64 model of ``CONFIGS[name]`` in eval mode (skips without transformers)."""
    if T is None:
        pytest.skip("the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
    torch.manual_seed(seed)
    attn = attn or ("eager" if name == "gemma2" else "sdpa")  # transformers has no sdpa path for Gemma 2
    extra = {"experts_implementation": "eager"} if name == "qwen2_moe" else {}  # float64 experts on CPU
    model = T.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=attn, **extra)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm weights and biases
                p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # greedy for the full length
    return model.double().eval()


@pytest.fixture
def float64_gemma_norms(monkeypatch):
    """The norms after the MLP whose scale a patch changes (Gemma 2/3, OLMo 2) compute in float32
    whatever the model dtype; evaluate them in float64."""

    def forward(self, x):
        return self._norm(x) * (1.0 + self.weight)

    def olmo2(self, x):
        return self.weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", forward)
    monkeypatch.setattr(modeling_gemma2.Gemma2RMSNorm, "forward", forward)
    monkeypatch.setattr(modeling_olmo2.Olmo2RMSNorm, "forward", olmo2)


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))  # 0 is padding


def hooks_left(model) -> int:
    """Forward hooks and pre-hooks still registered anywhere in ``model`` (0 after every run)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
