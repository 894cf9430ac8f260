"""Helpers for checking exactness on your own models.

A missing term in a patch can hide behind freshly initialised norms (gamma = 1, beta = 0) and
zero biases; ``perturbed`` moves them off their init first, as tokenpatch's own tests do.
``tiny_hf_model`` builds a tiny random float64 Hugging Face model of each block design tokenpatch
patches (``TINY_HF``), and ``float64_norms`` evaluates the norms that Hugging Face keeps in float32.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from torch import nn

from tokenpatch.arch.norms import NORMS
from tokenpatch.float64_mode import float64_everywhere
from tokenpatch.tiny_configs import EAGER_ONLY, FLOAT32_INSIDE, MOE, NO_ATTENTION, TINY_HF

__all__ = [
    "perturbed",
    "TINY_HF",
    "EAGER_ONLY",
    "MOE",
    "NO_ATTENTION",
    "tiny_hf_config",
    "tiny_hf_model",
    "float64_norms",
    "float64_everywhere",
    "FLOAT32_INSIDE",
]


def perturbed(module: nn.Module, seed: int = 0, scale: float = 0.3) -> nn.Module:
    """Add ``N(0, scale^2)`` noise, in place, to every norm parameter (names containing ``ln`` or
    ``norm``) and every bias of ``module``; returns ``module``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "ln" in name or "norm" in name or name.endswith("bias"):
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p))
    return module


def tiny_hf_config(name: str, **overrides):
    """The ``transformers`` config of ``TINY_HF[name]``, ``overrides`` its fields (needs ``pip install 'tokenpatch[hf]'``)."""
    transformers = importlib.import_module("transformers")  # the optional Hugging Face extra
    cls, kwargs = TINY_HF[name]
    return getattr(transformers, cls)(**{**kwargs, **overrides})


def tiny_hf_model(name: str, seed: int = 0, attn: str | None = None, **overrides) -> nn.Module:
    """A tiny random float64 causal LM of ``TINY_HF[name]`` (config fields ``overrides``) in eval mode, every
    1-D parameter (norm weights, biases) and stacked experts' biases moved off their init by ``N(0, 0.3^2)``,
    greedy generation to full length."""
    transformers = importlib.import_module("transformers")
    torch.manual_seed(seed)
    attn = attn or ("eager" if name in EAGER_ONLY + NO_ATTENTION else "sdpa")
    # float64 experts on CPU (and Nemotron-H's experts blocks, where a config has them)
    extra = {"experts_implementation": "eager"} if name in (*MOE, "nemotron_h") else {}
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_hf_config(name, **overrides), attn_implementation=attn, **extra
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_proj_bias"):  # norm weights and biases (stacked experts': [E, out])
                p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model.double().eval()


def _rms_float64(offset: float):
    def forward(self, x):
        eps = getattr(self, "eps", getattr(self, "variance_epsilon", None))
        return (offset + self.weight) * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)

    return forward


@contextlib.contextmanager
def float64_norms() -> Iterator[None]:
    """Inside the block, the RMSNorms after the MLP whose scale a patch changes (Gemma 2/3, OLMo 2/3, EXAONE 4, GLM-4),
    which compute in float32 whatever the model dtype, compute in the input's dtype; restored on exit.
    With them a float64 model's patch is exact to ~1e-15 (without, to that float32 rounding). Which
    norms, and their offsets: the norm table ``tokenpatch.arch.norms.NORMS`` (its entries with a ``home``).
    The class's ``forward`` is swapped, so a model that ``accelerate`` dispatched (``device_map``, offload)
    keeps the forward its hooks bound when it was loaded: load such a model inside the block (its norms
    then compute in the input's dtype for as long as it lives)."""
    saved = []
    try:
        for cls, norm in NORMS.items():
            if norm.home is None:
                continue
            module = getattr(importlib.import_module(norm.home), cls)
            saved.append((module, module.forward))
            module.forward = _rms_float64(norm.offset)
        yield
    finally:
        for module, forward in saved:
            module.forward = forward
