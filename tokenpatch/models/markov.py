"""The Markov-chain model: an ``ICLTransformer`` on one-hot ``[state; position]`` vectors (``docs/markov.md``).

The model reads ``tasks.markov.encode`` vectors, so every tokenpatch tool (token patches,
trajectories, thought patches) applies to it unchanged. ``minimal=True`` is paper A's minimal model:
one layer reading ``[x_n; x_{n-1}; n]``, the first attention layer replaced by the hard
previous-state concatenation. Training lives in the workbench (``tokenpatch markov``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tokenpatch.errors import InputError
from tokenpatch.models.icl import ICLConfig, ICLTransformer
from tokenpatch.tasks.markov import MarkovTask, encode

__all__ = ["MarkovModel", "markov_model", "model_inputs", "log_probs", "is_minimal"]


@dataclass(frozen=True)
class MarkovModel:
    """Shape of the model; ``minimal``: paper A's one-layer model on ``[x_n; x_{n-1}; n]``."""

    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 1
    minimal: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def markov_model(task: MarkovTask, shape: MarkovModel = MarkovModel()) -> ICLTransformer:
    """A fresh ``ICLTransformer`` for ``task``: width ``C + N`` (``2C + N`` minimal) in, ``C`` logits out."""
    d_in = task.states * (2 if shape.minimal else 1) + task.length
    layers = 1 if shape.minimal else shape.n_layers
    return ICLTransformer(
        ICLConfig(
            d_in=d_in, d_out=task.states, d_model=shape.d_model, n_layers=layers, n_heads=shape.n_heads, norm="pre"
        )
    )


def is_minimal(model: ICLTransformer, task: MarkovTask) -> bool:
    return model.config.d_in == 2 * task.states + task.length


def model_inputs(model: ICLTransformer, task: MarkovTask, states: torch.Tensor) -> torch.Tensor:
    """``encode`` for this model: ``[B, N, d_in]`` in the model's dtype."""
    if model.config.d_in not in (task.states + task.length, 2 * task.states + task.length):
        raise InputError(
            f"the model reads width {model.config.d_in}, not a {task.states}-state, "
            f"length-{task.length} Markov task's {task.states + task.length}"
        )
    dtype = next(model.parameters()).dtype
    return encode(states, task.states, task.length, previous=is_minimal(model, task), dtype=dtype)


def log_probs(model: ICLTransformer, task: MarkovTask, states: torch.Tensor) -> torch.Tensor:
    """The model's next-state log-probabilities ``[B, N, C]`` (float64)."""
    with torch.no_grad():
        return torch.log_softmax(model(model_inputs(model, task, states)).double(), -1)
