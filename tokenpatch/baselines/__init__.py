"""What tokenpatch's thought patches are measured against, run on the same Hugging Face models
(``docs/prompt-compression.md``): activation steering (``steering.py``: the injection, as restoring
context managers) and the vectors it injects (``vectors.py``: task vectors, function vectors, the
attention shift, the thought vector)."""

from tokenpatch.baselines.steering import Steering, head_contribution, heads_set, recording_heads, site_modules, steer
from tokenpatch.baselines.vectors import (
    attention_shift,
    function_vectors,
    head_effects,
    in_context_vectors,
    mean_heads,
    pad_left,
    task_vectors,
    thought_vector,
)

__all__ = [
    "Steering",
    "steer",
    "heads_set",
    "recording_heads",
    "head_contribution",
    "site_modules",
    "pad_left",
    "task_vectors",
    "mean_heads",
    "head_effects",
    "function_vectors",
    "attention_shift",
    "thought_vector",
    "in_context_vectors",
]
