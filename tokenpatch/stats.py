"""95% intervals, in one place and one shape: ``{"mean": m, "lo": lo, "hi": hi}``.

Every interval the package reports (results JSON, the comparison harness, the command line) is
this dict; over a vector of quantities (a lag curve: one mean per lag) the three keys hold lists.
Markdown may print it as ``m ± h`` (``half_width``) or ``[lo, hi]``.

* ``mean_interval``: the mean of ``n`` items with sample standard deviation ``sd``, and
  ``mean ∓ t_{0.975, n-1} sd / sqrt(n)``. With ``n = 3`` (three random head sets) the quantile is
  4.30, not the normal 1.96, which would give an interval that covers 81%, not 95%; with ``n = 20``
  (recall lists) it is 2.09; by ``n = 256`` it is within 0.5% of 1.96. One item: ``lo = hi = mean``.
* ``wilson``: the Wilson score interval of a proportion ``k / n`` (greedy accuracy).
* ``interval``: the shape from a mean and a half-width computed elsewhere.
* ``auroc``: the area under the ROC curve of a score for a binary label, with a stratified
  bootstrap interval (percentiles of 2000 resamples).
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch

__all__ = ["auroc", "half_width", "interval", "mean_interval", "t95", "wilson"]


@cache
def t95(n: int) -> float:
    """The two-sided 95% quantile of Student's t with ``n - 1`` degrees of freedom (``n >= 2`` items)."""
    if n < 2:
        raise ValueError(f"an interval needs at least 2 items, got {n}")
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1))


def _plain(v):
    """A float for a scalar (0-d array or tensor, NumPy scalar), a list for a vector."""
    return v.tolist() if hasattr(v, "tolist") else float(v)


def interval(mean, half) -> dict:
    """``{"mean": mean, "lo": mean - half, "hi": mean + half}``: floats, or lists when ``mean`` and
    ``half`` are arrays or tensors of one shape."""
    return {"mean": _plain(mean), "lo": _plain(mean - half), "hi": _plain(mean + half)}


def half_width(iv: dict):
    """``(hi - lo) / 2`` of an interval (lists: elementwise), for a ``mean ± half`` table cell."""
    if isinstance(iv["lo"], list):
        return [(h - lo) / 2 for lo, h in zip(iv["lo"], iv["hi"])]
    return (iv["hi"] - iv["lo"]) / 2


def mean_interval(values, z: float | None = None) -> dict:
    """The mean of ``values`` over their first axis (items: prompts, lists, head sets, tasks) with
    its 95% interval ``mean ∓ q sd / sqrt(n)``, ``sd`` the sample standard deviation (``n - 1``):
    ``q = t_{0.975, n-1}`` (``t95``), or ``z`` when given (a normal quantile, e.g. 1.96).
    ``values [n]`` gives floats, ``[n, k]`` lists of ``k``; a tensor is reduced in float64 by torch,
    anything else by NumPy. One item: ``lo = hi = mean``."""
    if isinstance(values, torch.Tensor):
        v = values.double()
        n = v.shape[0] if v.dim() else 0
        sd = (v.std(0) if n > 1 else torch.zeros_like(v[0])) if n else None
    else:
        v = np.asarray(values, dtype=float)
        n = v.shape[0] if v.ndim else 0
        sd = (v.std(0, ddof=1) if n > 1 else np.zeros_like(v[0])) if n else None
    if n < 1:
        raise ValueError("an interval needs at least 1 item, got none")
    mean = v.mean(0)
    q = (t95(n) if z is None else z) if n > 1 else 0.0
    return interval(mean, q * sd / n**0.5)


def wilson(k: int, n: int, z: float = 1.96) -> dict:
    """The 95% Wilson score interval of ``k`` successes in ``n`` trials: ``{"mean": k / n, "lo", "hi"}``
    (``lo``, ``hi`` clipped to ``[0, 1]``; not symmetric about ``k / n``)."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"a proportion needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p, z2 = k / n, z * z
    mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return {"mean": p, "lo": max(0.0, mid - half), "hi": min(1.0, mid + half)}


def auroc(scores, labels, resamples: int = 2000, seed: int = 0) -> dict:
    """How well ``scores`` rank the positives (``labels`` true) above the negatives: ``P(s+ > s-) +
    P(s+ = s-) / 2`` over all positive-negative pairs (the Mann-Whitney statistic over ``n+ n-``; 0.5:
    no better than chance, below 0.5: the score ranks the other way), with the 2.5 and 97.5
    percentiles of ``resamples`` stratified bootstrap resamples (positives and negatives each drawn
    with replacement, ``numpy`` seeded by ``seed``) -> ``{"mean", "lo", "hi"}``."""
    s, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    if s.shape != y.shape or s.ndim != 1:
        raise ValueError(f"scores and labels must be two vectors of one length, got {s.shape} and {y.shape}")
    pos, neg = s[y], s[~y]
    if not len(pos) or not len(neg):
        raise ValueError(f"an AUROC needs both classes, got {len(pos)} positives and {len(neg)} negatives")
    wins = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])  # [n+, n-]
    rng = np.random.default_rng(seed)
    i = rng.integers(len(pos), size=(resamples, len(pos)))
    j = rng.integers(len(neg), size=(resamples, len(neg)))
    per_pos = np.stack([wins[:, jj].mean(1) for jj in j])  # [resamples, n+]: each positive against a resample
    boot = np.take_along_axis(per_pos, i, 1).mean(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"mean": float(wins.mean()), "lo": float(lo), "hi": float(hi)}
