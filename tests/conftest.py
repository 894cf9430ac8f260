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
