"""Temporal order in context, measured on a model: the lag curve, serial recall, and their
dose-response to head ablation (``docs/induction.md`` §3-4).

* ``lag_curve``: next-token probabilities at the end of ``tasks.recall.lag_prompts``, read at every
  prompt token and aligned by lag (``tasks.recall.lag_probabilities``).
* ``serial_recall``: few-shot recall of word lists by greedy decoding, scored per position, per
  list and by the lag-CRP of the recalled order.
* ``dose_response``: a measurement with the top-n heads ablated and with n random heads outside the
  top max(M, n) ablated (several draws), for every n.
"""

from __future__ import annotations

from math import comb

import numpy as np
import torch
from torch import Tensor

from tokenpatch.interp.ablation import ablate_heads, control_pool, random_sets, select_heads
from tokenpatch.progress import progress_bar
from tokenpatch.stats import half_width, interval, mean_interval
from tokenpatch.tasks.recall import lag_crp, lag_probabilities, recall_lists, recall_prompt, score_recall

__all__ = ["lag_curve", "serial_recall", "dose_response", "pooled"]


def lag_curve(model, prompts: Tensor, bos: int | None = None, batch_size: int = 32, inputs_of=None) -> dict:
    """``{"lags", "mean", "lo", "hi", "per_prompt"}`` for ``prompts [P, n + 1]`` (``bos`` is put in front of
    every prompt when given). A Hugging Face causal LM reads the ids; ``inputs_of`` maps them to the
    inputs of our models (``tokenpatch.models.lm.lm_inputs``)."""
    rows = []
    with torch.no_grad():
        for i in range(0, prompts.shape[0], batch_size):
            ids = prompts[i : i + batch_size]
            if bos is not None:
                ids = torch.cat([torch.full((ids.shape[0], 1), bos, dtype=ids.dtype), ids], 1)
            logits = model(ids).logits if inputs_of is None else model(inputs_of(ids))  # [b, T, V]
            logits = logits[:, -1].double()  # [b, V]
            rows.append(torch.softmax(logits, -1))
    return lag_probabilities(torch.cat(rows), prompts)


def pooled(runs: list[dict], exact: bool = False) -> dict:
    """``{"mean", "lo", "hi"}`` over the random control's head sets, each ``{"mean", "lo", "hi"}``: the
    mean of the sets, and an interval. Drawn sets (``exact=False``): ``t_{0.975, D-1} sd / sqrt(D)`` of the
    set means (``stats.mean_interval``), the uncertainty from the choice of heads (the prompts are the
    same for every set, so their noise is common to all: the top curve's interval shows its size).
    Every subset measured (``exact=True``): the mean is the control's own and only the prompts' noise is
    left; the sets share the prompts, so their errors are correlated and the mean of their half-widths
    bounds it. One set keeps its own."""
    if len(runs) == 1:
        return dict(runs[0])
    means = [r["mean"] for r in runs]
    if exact:
        return interval(float(np.mean(means)), float(np.mean([half_width(r) for r in runs])))
    return mean_interval(means)


def serial_recall(
    model, tokenizer, words: list[str], length: int = 14, shots: int = 2, lists: int = 20, seed: int = 0
) -> dict:
    """Greedy few-shot serial recall of ``lists`` lists of ``length`` single-token words.

    Returns ``{"per_position": [mean exact match at each position], "accuracy": their mean,
    "accuracy_interval": its 95% interval over lists (``stats.mean_interval``: ``{"mean", "lo", "hi"}``),
    "exact": share of lists recalled perfectly, "crp": lag-CRP of the recalled serial positions}``."""
    pool = recall_lists(words, length, lists * (shots + 1), seed)
    scores = []
    for j in range(lists):
        group = pool[j * (shots + 1) : (j + 1) * (shots + 1)]
        text = recall_prompt(group[:-1], group[-1])
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=length,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            )
        recalled = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split()[:length]
        scores.append(score_recall(recalled, group[-1]))
    per = np.array([s["per_position"] for s in scores], dtype=float)  # [lists, length]
    exact = np.array([s["exact"] for s in scores], dtype=float)
    acc = mean_interval(per.mean(1))
    return {
        "per_position": per.mean(0).tolist(),
        "accuracy": acc["mean"],
        "accuracy_interval": acc,
        "exact": float(exact.mean()),
        "crp": lag_crp([s["positions"] for s in scores], length),
    }


def dose_response(
    model,
    ranked: list[dict],
    measure,
    ns=(0, 1, 2, 4, 8, 16),
    exclude_top: int = 50,
    draws: int = 3,
    seed: int = 0,
    progress=None,
) -> dict:
    """``{"n": [...], "top": [measure(...)], "random": [[measure(...) per draw]], "random_heads": ...}``:
    ``measure()`` (a callable returning a JSON-able result) with the top-``n`` heads of ``ranked``
    ablated (zero), and with ``n`` random heads outside the top ``max(exclude_top, n)``
    (``ablation.control_pool``), ``draws`` times. When
    the pool has at most ``draws`` subsets of ``n`` heads (a small model), every subset is measured
    once instead: the random control's exact average."""
    out = {
        "n": list(ns),
        "top": [],
        "random": [],
        "random_heads": [],
        "exact": [],
        "exclude_top": exclude_top,
        "draws": draws,
    }
    for n in progress_bar(ns, progress, desc="dose-response", unit="n"):
        with ablate_heads(model, select_heads(ranked, n)):
            out["top"].append(measure())
        sets = random_sets(ranked, n, exclude_top, draws, seed)
        runs = []
        for heads in sets:
            with ablate_heads(model, heads):
                runs.append(measure())
        out["random"].append(runs)
        out["random_heads"].append(sets)
        out["exact"].append(len(sets) == comb(len(control_pool(ranked, n, exclude_top)), n))  # every subset measured
    return out
