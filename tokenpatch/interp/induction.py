"""Induction-head scores on attention patterns (``docs/induction.md``).

Two definitions of the induction score, both on ``[BOS, r_1..r_L, r_1..r_L]`` with ``r`` random tokens:

* **diagonal** (Olsson et al.; ARENA): ``mean_{q in second copy} A[q, q - L + 1]``, the attention
  from the second occurrence of a token to the token that followed its first occurrence
  (``pattern.diagonal(1 - L)`` over the second copy's rows);
* **detector** (TransformerLens' ``detect_head(..., "induction_head", error_measure="mul")``):
  ``sum(A * D) / sum(A)`` per sequence, then the mean over sequences, where ``D`` is the
  duplicate-token mask (``D[i, j] = 1`` iff ``tok_j = tok_i`` and ``j < i``) shifted one column to
  the right. ``exclude_bos`` zeroes the first column of ``A`` first (a head that rests on BOS where
  it has nothing to copy then scores 1.0); ``exclude_current_token`` the diagonal.

Previous-token and duplicate-token scores use the same detector with ``D`` the sub-diagonal and
the duplicate mask itself. Patterns are ``[S, H, T, T]`` (sequences, heads, query, key).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tokenpatch.arch import adapter_for, text_config
from tokenpatch.errors import InputError

__all__ = [
    "repeated_tokens",
    "detection_pattern",
    "detector_score",
    "diagonal_score",
    "KINDS",
    "rank_heads",
    "attention_patterns",
    "kv_group",
    "head_scores",
]

KINDS = ("previous_token", "duplicate_token", "induction")


def repeated_tokens(pool, length: int, sequences: int, seed: int = 0, bos: int | None = None) -> Tensor:
    """``[S, 2L]`` (``[S, 1 + 2L]`` with ``bos``): ``L`` tokens drawn uniformly from ``pool`` (a size or
    a list of ids; ``L`` distinct ones when the pool allows), then the same ``L`` again. ``bos`` is never
    drawn as a token."""
    ids = np.arange(pool) if isinstance(pool, int) else np.asarray(list(pool))
    if bos is not None:
        ids = ids[ids != bos]
    if len(ids) == 0:
        raise InputError("the token pool is empty (BOS excluded)")
    if length < 2 or sequences < 1:
        raise InputError(f"need length >= 2 and sequences >= 1, got {length} and {sequences}")
    rng = np.random.default_rng(seed)
    replace = len(ids) < length
    first = np.stack([rng.choice(ids, size=length, replace=replace) for _ in range(sequences)])  # [S, L]
    seq = torch.from_numpy(np.concatenate([first, first], 1)).long()
    return seq if bos is None else torch.cat([torch.full((sequences, 1), bos, dtype=torch.long), seq], 1)


def detection_pattern(tokens: Tensor, kind: str) -> Tensor:
    """TransformerLens' 0/1 pattern ``[T, T]`` (lower triangular) for one sequence ``tokens [T]``."""
    t = tokens.shape[-1]
    if kind == "previous_token":
        return torch.diag(torch.ones(t - 1), -1)
    dup = (tokens[:, None] == tokens[None, :]).float().tril(-1)  # j < i and tok_j == tok_i
    if kind == "duplicate_token":
        return dup
    if kind == "induction":
        shifted = torch.zeros(t, t)
        shifted[:, 1:] = dup[:, :-1]  # D[i, j] = dup[i, j - 1]
        return shifted.tril()
    raise InputError(f"kind={kind!r}; choose one of {KINDS}")


def _check(pattern: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    if pattern.ndim == 3:
        pattern = pattern[None]
    if tokens.ndim == 1:
        tokens = tokens[None]
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise InputError(f"attention patterns must be [sequences, heads, T, T], got {tuple(pattern.shape)}")
    if tokens.shape != (pattern.shape[0], pattern.shape[-1]):
        raise InputError(f"tokens {tuple(tokens.shape)} do not match patterns {tuple(pattern.shape)}")
    return pattern, tokens


def detector_score(
    pattern: Tensor,
    tokens: Tensor,
    kind: str = "induction",
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
) -> Tensor:
    """``mean_seq sum(A * D) / sum(A)`` per head -> ``[H]`` (module docstring; ``A`` is not modified).

    A sequence where the head has no attention left (all of it on BOS with ``exclude_bos``, or on
    the token itself with ``exclude_current_token``) scores 0 there: it attends to no pattern."""
    pattern, tokens = _check(pattern, tokens)
    a = pattern.double().clone()
    if exclude_bos:
        a[..., 0] = 0
    if exclude_current_token:
        a.diagonal(0, -2, -1).zero_()
    masks = torch.stack([detection_pattern(t, kind) for t in tokens]).double()[:, None]  # [S, 1, T, T]
    num, den = (a * masks).sum((-1, -2)), a.sum((-1, -2))  # [S, H]
    return torch.where(den > 0, num / den.clamp_min(1e-300), 0.0).mean(0)


def diagonal_score(pattern: Tensor, length: int, bos: bool = True) -> Tensor:
    """``mean A[q, q - L + 1]`` over the second copy's queries and the sequences -> ``[H]``.

    With ``bos``, positions are ``0`` (BOS), ``1..L`` (first copy), ``L+1..2L`` (second copy)."""
    if pattern.ndim == 3:
        pattern = pattern[None]
    t = pattern.shape[-1]
    if t != 2 * length + int(bos):
        raise InputError(f"patterns of length {t} are not [BOS] + 2 x {length} tokens")
    start = length + int(bos)  # first query of the second copy
    diag = pattern.diagonal(1 - length, -2, -1)  # [S, H, T - L + 1]: entry i is A[L - 1 + i, i]
    return diag[..., start - (length - 1) :].double().mean((0, -1))


def rank_heads(scores: dict[str, Tensor], by: str = "diagonal") -> list[dict]:
    """``[{"layer", "head", <score names>...}]`` from per-kind ``[layers, heads]`` tensors, sorted by
    ``by``, descending (ties by layer, then head)."""
    ref = scores[by]
    rows = [
        {"layer": l, "head": h, **{k: float(v[l, h]) for k, v in scores.items()}}
        for l in range(ref.shape[0])
        for h in range(ref.shape[1])
    ]
    return sorted(rows, key=lambda r: (-r[by], r["layer"], r["head"]))


def attention_patterns(model, inputs: Tensor) -> list[Tensor]:
    """Every layer's attention probabilities ``[B, H, T, T]`` (one per query head; under GQA, query
    head ``h`` reads KV group ``h // (H / H_kv)``, ``kv_group``), from the model's adapter
    (``Adapter.attention_patterns``).

    Our models: from the softmax attention layers. Hugging Face models: one forward with
    ``output_attentions=True`` under eager attention (fused kernels return no probabilities), the
    model's own implementation restored afterwards, errors included."""
    return adapter_for(model).attention_patterns(model, inputs)


def kv_group(model, head: int) -> int:
    """The key/value head that query head ``head`` reads (itself without grouped-query attention)."""
    c = text_config(model)
    heads = getattr(c, "num_attention_heads", None)
    kv = getattr(c, "num_key_value_heads", None) or heads
    return head if not heads else head // (heads // kv)


def head_scores(
    model, length: int = 50, sequences: int = 20, seed: int = 0, pool=None, bos: int | None = None, inputs_of=None
) -> list[dict]:
    """Every head's scores on ``[BOS, r_1..r_L, r_1..r_L]`` (``repeated_tokens``), ranked by ``diagonal``:
    ``{"layer", "head", "kv_group", "diagonal", "detector", "previous_token", "duplicate_token"}``.

    ``pool``: token ids to draw from (default: every id of the vocabulary but ``bos``); ``inputs_of``:
    maps token ids to the model's inputs (our models read one-hot vectors)."""
    vocab = pool if pool is not None else [i for i in range(_vocab(model)) if i != bos]
    tokens = repeated_tokens(vocab, length, sequences, seed, bos)  # [S, T]
    pats = attention_patterns(model, tokens if inputs_of is None else inputs_of(tokens))
    has_bos = bos is not None
    scores = {
        "diagonal": torch.stack([diagonal_score(p, length, has_bos) for p in pats]),
        "detector": torch.stack([detector_score(p, tokens, "induction", exclude_bos=has_bos) for p in pats]),
        "previous_token": torch.stack([detector_score(p, tokens, "previous_token", exclude_bos=has_bos) for p in pats]),
        "duplicate_token": torch.stack(
            [detector_score(p, tokens, "duplicate_token", exclude_bos=has_bos) for p in pats]
        ),
    }
    rows = rank_heads(scores)
    for r in rows:
        r["kv_group"] = kv_group(model, r["head"])
    return rows


def _vocab(model) -> int:
    c = text_config(model)
    size = getattr(c, "vocab_size", None)
    if not size:
        raise InputError("give pool= (the token ids to draw from): the model does not say its vocabulary size")
    return int(size)
