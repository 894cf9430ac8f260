"""A thought patch's ridge chosen without labels: on calibration queries held out of the fit.

A user with a prompt alone has no dev split, and generalised cross-validation (``ridge="gcv"``)
treats the positions of one query as independent, which they are not: on Gemma 3 it chose ridges
far too small (``docs/thought-patches.md`` §3). The prompted model itself is the reference instead.
The calibration queries (labelled, or written by the model: ``calibration.demonstrations``) are
split at random, a fraction held out; for each ridge of a grid the patch is fitted on the rest and
scored on the held-out queries by

    KL = mean over held-out queries q and their positions j of  KL( p(. | prompt, q_<=j) || p_patched(. | q_<=j) )

(next-token distributions of the language model; the prompt's first token stays in front of the
queries without it when ``keep_bos``). The ridge with the least KL wins; its patch is then fitted
again on every query.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import offload
from tokenpatch.errors import InputError
from tokenpatch.run import apply
from tokenpatch.thought.calibration import batched
from tokenpatch.thought.front import thought_patch

__all__ = ["RIDGE_GRID", "MIN_ROWS", "choose_ridge", "prompt_kl"]

# The grid ``choose_ridge`` tries unless told otherwise: the comparison's on real models.
RIDGE_GRID = (0.003, 0.01, 0.1, 1.0, 10.0, 30.0)
MIN_ROWS = 8  # calibration queries a held-out quarter is taken from (2 held out, 6 fitted)
POSITIONS = 128  # query positions per forward of ``prompt_kl`` (its logits are [positions, vocab])


@torch.no_grad()
def prompt_kl(model: nn.Module, prompt: Tensor, queries: list[Tensor], patch, keep_bos: bool) -> float:
    """Mean over every position of ``queries`` (batches ``[b, T]``) of ``KL(p(. | prompt, q) ||
    p_patch(. | q))``, nats (module docstring)."""
    prompt = prompt.reshape(1, -1)
    head = prompt[:, :1] if keep_bos else prompt[:, :0]
    weight = model.get_input_embeddings().weight
    device, dtype = offload.device(model.get_input_embeddings()), torch.promote_types(weight.dtype, torch.float32)
    total, count = 0.0, 0
    for q in (rows for batch in queries for rows in batch.split(max(1, POSITIONS // batch.shape[1]))):
        q = q.to(device)
        with_prompt = model(input_ids=torch.cat([prompt.to(device).expand(q.shape[0], -1), q], 1), use_cache=False)
        ref = with_prompt.logits[:, prompt.shape[1] :].to(dtype).log_softmax(-1)  # [b, T, vocab]
        with apply(model, patch):
            alone = model(input_ids=torch.cat([head.to(device).expand(q.shape[0], -1), q], 1), use_cache=False)
        got = alone.logits[:, head.shape[1] :].to(dtype).log_softmax(-1)
        total += float((ref.exp() * (ref - got)).sum(-1).double().sum())
        count += q.numel()
    return total / count


def choose_ridge(
    model: nn.Module,
    prompt: Tensor,
    rows: list[list[int]] | Tensor,
    ridges: tuple[float, ...] = RIDGE_GRID,
    *,
    held_out: float = 0.25,
    keep_bos: bool = False,
    seed: int = 0,
    progress: bool | None = None,
    **fit: Any,
) -> tuple[float, dict[float, float]]:
    """The ridge of ``ridges`` whose thought patch, fitted on the other calibration ``rows`` (token-id
    lists, or a tensor ``[n, L]``: ``sample_calibration``'s continuations), is closest to the prompted model on a seeded ``held_out`` fraction of them (``prompt_kl``;
    module docstring). ``fit``: more of ``thought_patch``'s arguments (``rank``, ``output``...).
    Returns ``(ridge, {ridge: held-out KL})``; fit the patch on every row with that ridge."""
    rows = _token_rows(rows)
    if not 0 < held_out < 1:
        raise InputError(f"choose_ridge: held_out must be a fraction in (0, 1), got {held_out!r}")
    if not ridges or any(isinstance(r, bool) or not isinstance(r, (int, float)) or r < 0 for r in ridges):
        raise InputError(f"choose_ridge: ridges must be numbers >= 0, got {ridges!r}")
    n_out = round(held_out * len(rows))
    if n_out < 1 or n_out >= len(rows):
        raise InputError(
            f"choose_ridge: {len(rows)} calibration queries cannot be split {1 - held_out:.0%} / {held_out:.0%}: "
            "give more (at least 2, each side non-empty)"
        )
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    scored, kept = [rows[i] for i in order[:n_out]], [rows[i] for i in order[n_out:]]
    queries = batched(scored)
    by_ridge = {}
    for lam in ridges:
        patch = thought_patch(model, prompt, batched(kept), ridge=lam, keep_bos=keep_bos, progress=progress, **fit)
        by_ridge[float(lam)] = prompt_kl(model, prompt, queries, patch.patch, keep_bos)
    return min(by_ridge, key=by_ridge.get), by_ridge


def _token_rows(rows: Any) -> list[list[int]]:
    """``rows`` as non-empty token-id lists: from a tensor ``[n, L]`` or a list of id sequences; a flat list of
    ids (one query, not a list of them) is refused."""
    if isinstance(rows, Tensor):
        if rows.ndim != 2:
            raise InputError(f"choose_ridge: rows must be token ids [n, L], got a tensor of shape {list(rows.shape)}")
        rows = rows.tolist()
    if isinstance(rows, (str, bytes)) or any(isinstance(r, (int, str, bytes)) for r in rows):
        raise InputError(
            "choose_ridge: rows must be a list of calibration queries, each a list of token ids (or a tensor "
            "[n, L]); got single ids or text"
        )
    return [[int(t) for t in r] for r in rows if len(r)]
