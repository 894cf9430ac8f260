"""Shared fixtures: tiny random models with every norm and bias moved away from its init,
so a missing term in a patch cannot hide behind gamma = 1, beta = 0."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import tokenpatch as tp
from tokenpatch.testing import (
    FLOAT32_INSIDE,
    TINY_HF,
    float64_everywhere,
    float64_norms,
    perturbed,
    tiny_hf_config,
    tiny_hf_model,
)

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
# copies across runs: about 15 s + 35 s saved), else in a folder of this session's pytest tmp dir.
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
# norm weight and bias moved off its init (tokenpatch.testing.TINY_HF). Without the Hugging Face extra,
# ``build`` skips the test.
try:
    import transformers as T
except ImportError:  # pragma: no cover - the hf extra is part of the test install
    T = None


VOCAB = 101
CONFIGS = {name: functools.partial(tiny_hf_config, name) for name in TINY_HF}
GEMMAS = ("gemma2", "gemma3")


def build(name: str, seed: int = 0, attn: str | None = None):
    """A tiny random float64 model of ``CONFIGS[name]`` in eval mode (skips without transformers)."""
    if T is None:
        pytest.skip("the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
    return tiny_hf_model(name, seed, attn)


@pytest.fixture
def float64_gemma_norms(request):
    """The norms after the MLP whose scale a patch changes (Gemma 2/3, OLMo 2) compute in float32
    whatever the model dtype; evaluate them in float64. A test of a tiny model whose transformers code
    casts to float32 elsewhere too (``FLOAT32_INSIDE``: scans, routers) runs every cast in float64."""
    name = getattr(getattr(request.node, "callspec", None), "params", {}).get("name")
    with float64_norms(), float64_everywhere() if name in FLOAT32_INSIDE else contextlib.nullcontext():
        yield


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))  # 0 is padding


def hooks_left(model) -> int:
    """Forward hooks and pre-hooks still registered anywhere in ``model`` (0 after every run)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
