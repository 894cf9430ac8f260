"""Temporal order in context: the lag probe and few-shot serial recall (``docs/induction.md``), after
*Temporal Dependencies in In-Context Learning: The Role of Induction Heads* (Bajaj et al., 2026).

* **Word pool.** Common English nouns (``data/nouns/nouns.txt``, the noun list of the MIT-licensed
  package ``wonderwords``), kept where the word with a leading space is exactly one token of the
  model's tokenizer, so that one word is one position.
* **Lag probe.** ``n`` pool tokens drawn once (seeded); each prompt is a random permutation of them
  with its middle token (index ``n // 2``) repeated at the end. The model's next-token distribution
  at that last position is read at every prompt token: the token at index ``i`` sits at lag
  ``i - n // 2`` (lag 0: the repeated token itself, lag +1: its original successor). Every lag is
  available once per prompt, so the mean probability per lag is the analogue of the lag-CRP
  (not renormalised).
* **Lag-CRP** (Kahana): for recall sequences of serial positions, ``CRP(lag) = actual / available``
  transitions at each lag, items already recalled excluded from the available ones.
* **Serial recall.** k solved examples then a query list, ``"List: w_1 ... w_n\\nRecall: w_1 ... w_n"``;
  scored by exact match per position and for the whole list, and by the lag-CRP of the recall.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import numpy as np
import torch
from torch import Tensor

from tokenpatch.errors import InputError
from tokenpatch.stats import mean_interval

__all__ = [
    "nouns",
    "single_token_words",
    "lag_prompts",
    "lag_probabilities",
    "lag_crp",
    "recall_lists",
    "recall_prompt",
    "score_recall",
]


@lru_cache(maxsize=1)
def nouns() -> tuple[str, ...]:
    """The shipped noun list (6,782 words), in file order."""
    text = (resources.files("tokenpatch") / "tasks" / "data" / "nouns" / "nouns.txt").read_text(encoding="utf-8")
    return tuple(w.strip() for w in text.splitlines() if w.strip())


def single_token_words(tokenizer, words=None, prefix: str = " ") -> list[tuple[str, int]]:
    """``(word, id)`` for every lower-case alphabetic word that ``prefix + word`` encodes to one token."""
    out, seen = [], set()
    for w in words if words is not None else nouns():
        if not (w.isalpha() and w.islower()):
            continue
        ids = tokenizer(prefix + w, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and ids[0] not in seen:
            seen.add(ids[0])
            out.append((w, ids[0]))
    return out


def lag_prompts(pool, n: int, prompts: int, seed: int = 0) -> Tensor:
    """``[P, n + 1]`` token ids: ``n`` tokens drawn once from ``pool`` (distinct), permuted per
    prompt, then the middle one (index ``n // 2``) again."""
    pool = np.asarray(list(pool))
    if n < 3 or n > len(pool):
        raise InputError(f"n={n}: need 3 <= n <= {len(pool)} (the pool's size)")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(pool, size=n, replace=False)
    rows = np.stack([rng.permutation(chosen) for _ in range(prompts)])  # [P, n]
    return torch.from_numpy(np.concatenate([rows, rows[:, n // 2 : n // 2 + 1]], 1)).long()


def lag_probabilities(probs: Tensor, prompts: Tensor) -> dict:
    """From the final-position next-token probabilities ``probs [P, V]`` of ``prompts [P, n + 1]``:
    ``{"lags", "mean", "lo", "hi", "per_prompt"}`` with the probability of the token at each lag
    (``i - n // 2``): its mean over prompts and 95% interval (``stats.mean_interval``,
    ``mean ∓ t_{0.975, P-1} sd / sqrt(P)``), lists over the lags, and every prompt's ``[P][n]``."""
    n = prompts.shape[1] - 1
    at = probs.gather(1, prompts[:, :n]).double()  # [P, n]: p(token at index i)
    return {"lags": list(range(-(n // 2), n - n // 2)), **mean_interval(at), "per_prompt": at.tolist()}


def lag_crp(recalls: list[list[int]], length: int) -> dict:
    """Lag-conditional response probability of recall sequences (serial positions ``0..length-1``;
    repeats and intrusions, ``None`` or out of range, end the transitions they touch)."""
    actual = np.zeros(2 * length - 1)
    available = np.zeros(2 * length - 1)
    for seq in recalls:
        done: set[int] = set()
        prev = None
        for pos in seq:
            ok = pos is not None and 0 <= pos < length and pos not in done
            if prev is not None and ok:
                for other in range(length):
                    if other not in done and other != prev:
                        available[other - prev + length - 1] += 1
                actual[pos - prev + length - 1] += 1
            if ok:
                done.add(pos)
                prev = pos
            else:
                prev = None
    crp = np.divide(actual, available, out=np.full_like(actual, np.nan), where=available > 0)
    return {
        "lags": list(range(-(length - 1), length)),
        "crp": [None if np.isnan(v) else float(v) for v in crp],
        "actual": actual.astype(int).tolist(),
        "available": available.astype(int).tolist(),
    }


def recall_lists(words: list[str], length: int, count: int, seed: int = 0) -> list[list[str]]:
    """``count`` lists of ``length`` distinct words each (seeded)."""
    if length > len(words):
        raise InputError(f"lists of {length} words need a pool of at least {length}, got {len(words)}")
    rng = np.random.default_rng(seed)
    return [[words[i] for i in rng.choice(len(words), size=length, replace=False)] for _ in range(count)]


def recall_prompt(shots: list[list[str]], query: list[str]) -> str:
    """Few-shot serial recall: each solved list, then the query list and ``"Recall:"``."""
    solved = "".join(f"List: {' '.join(s)}\nRecall: {' '.join(s)}\n\n" for s in shots)
    return f"{solved}List: {' '.join(query)}\nRecall:"


def score_recall(recalled: list[str], target: list[str]) -> dict:
    """``{"per_position": [0/1 ...], "exact": 0/1, "positions": [serial position or None]}``."""
    index = {w: i for i, w in enumerate(target)}
    padded = (recalled + [""] * len(target))[: len(target)]
    per = [int(a == b) for a, b in zip(padded, target)]
    return {"per_position": per, "exact": int(all(per)), "positions": [index.get(w) for w in recalled[: len(target)]]}
