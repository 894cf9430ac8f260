"""Helpers for checking exactness on your own models.

A missing term in a patch can hide behind freshly initialised norms (gamma = 1, beta = 0) and
zero biases; ``perturbed`` moves them off their init first, as tokenpatch's own tests do.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["perturbed"]


def perturbed(module: nn.Module, seed: int = 0, scale: float = 0.3) -> nn.Module:
    """Add ``N(0, scale^2)`` noise, in place, to every norm parameter (names containing ``ln`` or
    ``norm``) and every bias of ``module``; returns ``module``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "ln" in name or "norm" in name or name.endswith("bias"):
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p))
    return module
