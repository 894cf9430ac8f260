"""Head ablation as a context manager, for our models and Hugging Face models (``docs/induction.md``).

A head's output is its slice ``z_h`` of the attention's output-projection input
``z = [z_1 .. z_H]`` (``A(x) = W_O z + b``). Ablating head ``h`` replaces ``z_h`` at every position by

* ``"zero"``: 0, so the head writes nothing but the shared bias (TransformerLens' ``-inf`` scores
  with NaN mapped to 0 do the same);
* ``"mean"``: its mean over every position of reference inputs;
* ``"resample"``: its value at the same position in a reference sequence drawn at random (seeded)
  per sequence of the batch.

Hooks only, removed on exit, errors included: the model is left exactly as it was.
``select_heads`` picks heads by list, top-n by score, or n random ones outside the top M, within a
layer range.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import combinations
from math import comb
from typing import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import InputError

__all__ = ["head_sites", "select_heads", "outside_top", "random_sets", "ablate_heads", "MODES"]

MODES = ("zero", "mean", "resample")


def head_sites(model: nn.Module) -> tuple[list[nn.Module], int]:
    """``(modules, n_heads)``: per layer, the module whose input is ``z``, and the heads per layer."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None and all(hasattr(b, "mixer") and hasattr(b.mixer, "out") for b in blocks):
        return [b.mixer.out for b in blocks], blocks[0].mixer.n_heads
    from ..baselines.steering import n_heads, o_proj_modules

    return o_proj_modules(model), n_heads(model)


def outside_top(ranked: list[dict], exclude_top: int = 50, layers=None) -> list[tuple[int, int]]:
    """The heads of ``ranked`` outside its first ``exclude_top``, within ``layers``: the random control's pool."""
    top = {(r["layer"], r["head"]) for r in ranked[:exclude_top]}
    return [(r["layer"], r["head"]) for r in ranked
            if (layers is None or r["layer"] in layers) and (r["layer"], r["head"]) not in top]


def select_heads(ranked: list[dict], n: int, how: str = "top", exclude_top: int = 50, layers=None,
                 seed: int = 0) -> list[tuple[int, int]]:
    """``n`` heads from ``ranked`` (rows ``{"layer", "head", ...}``, best first, as ``rank_heads`` gives):
    the first ``n`` (``how="top"``) or ``n`` drawn at random (seeded) from those outside the first
    ``exclude_top`` (``"random"``); ``layers``: only heads whose layer is in it (e.g. ``range(0, 6)``)."""
    if how not in ("top", "random"):
        raise InputError(f"how={how!r}; choose 'top' or 'random'")
    if how == "top":
        pool = [(r["layer"], r["head"]) for r in ranked if layers is None or r["layer"] in layers]
    else:
        pool = outside_top(ranked, exclude_top, layers)
    if n > len(pool):
        raise InputError(f"asked for {n} heads, only {len(pool)} are eligible ({how}, excluding the top {exclude_top})")
    if how == "random":
        pick = np.random.default_rng(seed).choice(len(pool), size=n, replace=False)
        pool = [pool[i] for i in sorted(pick)]
    return pool[:n]


def random_sets(ranked: list[dict], n: int, exclude_top: int = 50, draws: int = 3, seed: int = 0) -> list[list]:
    """The random control's head sets for ``n``: ``draws`` distinct seeded draws of ``n`` heads outside
    the top ``exclude_top``, or every such subset once when there are at most ``draws`` of them (a
    small model: the control's exact average). ``n = 0``: one empty set."""
    pool = outside_top(ranked, exclude_top)
    if n > len(pool):
        raise InputError(f"asked for {n} random heads, only {len(pool)} lie outside the top {exclude_top}")
    if n == 0:
        return [[]]
    if comb(len(pool), n) <= draws:
        return [list(c) for c in combinations(pool, n)]
    sets: dict[tuple, list] = {}
    for d in range(100 * draws):  # seeded draws, repeats skipped
        heads = select_heads(ranked, n, how="random", exclude_top=exclude_top, seed=seed + d)
        sets.setdefault(tuple(heads), heads)
        if len(sets) == draws:
            break
    return list(sets.values())


def _record(model: nn.Module, modules: list[nn.Module], layers: set[int], reference) -> dict[int, Tensor]:
    seen: dict[int, Tensor] = {}
    handles = [modules[l].register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(l, a[0].detach()))
               for l in layers]
    try:
        with torch.no_grad():
            model(reference)
    finally:
        for h in handles:
            h.remove()
    return seen


@contextmanager
def ablate_heads(model: nn.Module, heads, mode: str = "zero", reference=None, seed: int = 0) -> Iterator[nn.Module]:
    """Run ``model`` with ``heads`` (``(layer, head)`` pairs) ablated inside the block (module docstring).

    ``reference``: inputs of the model (token ids ``[B, T]`` or our models' ``[B, T, d_in]``) for the
    ``"mean"`` and ``"resample"`` modes; resampling needs reference sequences at least as long as
    the ablated run's."""
    if mode not in MODES:
        raise InputError(f"mode={mode!r}; choose one of {MODES}")
    if mode != "zero" and reference is None:
        raise InputError(f"mode={mode!r} needs reference inputs")
    modules, n_heads = head_sites(model)
    heads = [(int(l), int(h)) for l, h in heads]
    for l, h in heads:
        if not (0 <= l < len(modules) and 0 <= h < n_heads):
            raise InputError(f"head ({l}, {h}) is not in the model ({len(modules)} layers x {n_heads} heads)")
    by_layer: dict[int, list[int]] = {}
    for l, h in heads:
        by_layer.setdefault(l, []).append(h)
    ref = _record(model, modules, set(by_layer), reference) if mode != "zero" else {}
    gen = np.random.default_rng(seed)

    def hook_for(layer: int):
        mine = by_layer[layer]

        def hook(module, args):
            z = args[0].clone()  # [B, T, H * dh]
            dh = z.shape[-1] // n_heads
            if mode == "resample":
                r = ref[layer]
                if r.shape[1] < z.shape[1]:
                    raise InputError(f"resample: reference sequences have {r.shape[1]} positions, the run {z.shape[1]}")
                rows = torch.from_numpy(gen.integers(r.shape[0], size=z.shape[0]))
                donor = r[rows, : z.shape[1]].to(z.dtype)  # [B, T, H * dh]
            for h in mine:
                sl = slice(h * dh, (h + 1) * dh)
                if mode == "zero":
                    z[..., sl] = 0
                elif mode == "mean":
                    z[..., sl] = ref[layer][..., sl].mean((0, 1)).to(z.dtype)
                else:
                    z[..., sl] = donor[..., sl]
            return (z, *args[1:])
        return hook

    handles = []
    try:
        for layer in sorted(by_layer):
            handles.append(modules[layer].register_forward_pre_hook(hook_for(layer)))
        yield model
    finally:
        for h in handles:
            h.remove()
