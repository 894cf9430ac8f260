"""Sequences with repeats, the training data of the small induction LM (``docs/induction.md``).

``LMData.sample`` draws ``[BOS, x_1 .. x_{T-1}]`` with ``x_1`` uniform over ``1..V-1`` and, for ``t >= 1``,

    x_{t+1} = (what followed x_t the last time it occurred)   with probability ``follow``, if x_t occurred before,
    x_{t+1} ~ uniform(1..V-1)                                   otherwise.

Each sequence thus has its own successor map, written only in its context (``tokenpatch.models.lm``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tokenpatch.errors import InputError

__all__ = ["LMData", "BOS"]

BOS = 0


@dataclass(frozen=True)
class LMData:
    vocab: int = 32  # V, BOS included
    length: int = 64  # T, BOS included
    follow: float = 0.7  # probability that a recurring token is followed by what followed it last time

    def __post_init__(self) -> None:
        if not (
            isinstance(self.vocab, int)
            and self.vocab >= 3
            and isinstance(self.length, int)
            and self.length >= 4
            and 0 <= self.follow <= 1
        ):
            raise InputError(f"LMData needs vocab >= 3, length >= 4 and 0 <= follow <= 1: {self}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def sample(self, batch: int, rng: np.random.Generator) -> torch.Tensor:
        """``[B, T]`` token ids (module docstring)."""
        x = rng.integers(1, self.vocab, size=(batch, self.length))  # the uniform draws
        x[:, 0] = BOS
        copy = rng.random((batch, self.length)) < self.follow  # [B, T]  whether x_t copies, where it can
        last = np.zeros((batch, self.vocab), dtype=x.dtype)  # what followed each token last time (0: nothing yet)
        rows = np.arange(batch)
        for t in range(1, self.length - 1):
            prev = last[rows, x[:, t]]  # [B]
            use = copy[:, t + 1] & (prev > 0)
            x[use, t + 1] = prev[use]
            last[rows, x[:, t]] = x[:, t + 1]
        return torch.from_numpy(x)
