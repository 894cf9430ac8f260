"""Head ablation as a context manager, for our models and Hugging Face models (``docs/induction.md``).

A head's output is its slice ``z_h`` of the attention's output-projection input
``z = [z_1 .. z_H]`` (``A(x) = W_O z + b``). Ablating head ``h`` replaces ``z_h`` at every position by

* ``"zero"``: 0, so the head writes nothing but the shared bias (TransformerLens' ``-inf`` scores
  with NaN mapped to 0 do the same);
* ``"mean"``: its mean over every position of reference inputs;
* ``"resample"``: its value at the same position in a reference sequence drawn at random (seeded)
  for each sequence of the batch, anew for every forward; within a forward every ablated layer
  reads the same reference sequence. Cached decoding (a forward fed one new position after the
  earlier ones) cannot be aligned by position and is refused.

Hooks only, removed on exit, errors included: the model is left exactly as it was.
``select_heads`` picks heads by list, top-n by score, or n random ones outside the top M, within a
layer range.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import combinations
from math import comb
from numbers import Integral

import numpy as np
import torch
from torch import Tensor, nn

from tokenpatch.arch import adapter_for
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.errors import InputError
from tokenpatch.per_model import PerModel

__all__ = [
    "head_sites",
    "select_heads",
    "outside_top",
    "control_pool",
    "random_sets",
    "ablate_heads",
    "active_modes",
    "MODES",
]

MODES = ("zero", "mean", "resample")
_ACTIVE: PerModel[list[str]] = PerModel()  # model -> modes in force


def active_modes(model: nn.Module) -> tuple[str, ...]:
    """The modes of the ``ablate_heads`` contexts in force on ``model`` (innermost last)."""
    return tuple(_ACTIVE.get(model, ()))


def as_heads(heads) -> list[tuple[int, int]]:
    """``(layer, head)`` pairs of ints from pairs or from rows ``{"layer", "head", ...}`` (``rank_heads``)."""
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise InputError(f"heads must be a list of (layer, head) pairs, e.g. [(17, 3)], got {heads!r}")
    out = []
    for item in heads:
        pair = (item.get("layer"), item.get("head")) if isinstance(item, dict) else item
        if (
            isinstance(pair, (str, bytes))
            or not hasattr(pair, "__len__")
            or len(pair) != 2
            or not all(isinstance(v, Integral) and not isinstance(v, bool) for v in pair)
        ):
            raise InputError(
                f"heads must be (layer, head) pairs of ints (or rank_heads rows), e.g. [(17, 3)]; "
                f"got the entry {item!r}"
            )
        out.append((int(pair[0]), int(pair[1])))
    return out


def _check_count(n) -> int:
    if not isinstance(n, Integral) or isinstance(n, bool) or n < 0:
        raise InputError(f"the number of heads must be an integer >= 0, got {n!r}")
    return int(n)


def head_sites(model: nn.Module) -> tuple[list[nn.Module], int]:
    """``(modules, n_heads)``: per layer, the module whose input is ``z``, and the heads per layer
    (``Adapter.output_projections``, ``Adapter.n_heads``)."""
    adapter = adapter_for(model)
    return adapter.output_projections(model), adapter.n_heads(model)


def outside_top(ranked: list[dict], exclude_top: int = 50, layers=None) -> list[tuple[int, int]]:
    """The heads of ``ranked`` outside its first ``exclude_top``, within ``layers``: the random control's pool."""
    top = {(r["layer"], r["head"]) for r in ranked[:exclude_top]}
    return [
        (r["layer"], r["head"])
        for r in ranked
        if (layers is None or r["layer"] in layers) and (r["layer"], r["head"]) not in top
    ]


def select_heads(
    ranked: list[dict], n: int, how: str = "top", exclude_top: int = 50, layers=None, seed: int = 0
) -> list[tuple[int, int]]:
    """``n`` heads from ``ranked`` (rows ``{"layer", "head", ...}``, best first, as ``rank_heads`` gives):
    the first ``n`` (``how="top"``) or ``n`` drawn at random (seeded) from those outside the first
    ``exclude_top`` (``"random"``); ``layers``: only heads whose layer is in it (e.g. ``range(0, 6)``)."""
    if how not in ("top", "random"):
        raise InputError(f"how={how!r}; choose 'top' or 'random'")
    n = _check_count(n)
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


def control_pool(ranked: list[dict], n: int, exclude_top: int = 50) -> list[tuple[int, int]]:
    """The heads the random control of ``n`` draws from: outside the top ``max(exclude_top, n)``, so
    that it never shares a head with the top-``n`` set it is compared with (which matters only when
    ``n > exclude_top``: a small model)."""
    return outside_top(ranked, max(exclude_top, _check_count(n)))


def random_sets(ranked: list[dict], n: int, exclude_top: int = 50, draws: int = 3, seed: int = 0) -> list[list]:
    """The random control's head sets for ``n``: ``draws`` distinct seeded draws of ``n`` heads from
    ``control_pool``, or every such subset once when there are at most ``draws`` of them (a small
    model: the control's exact average). ``n = 0``: one empty set."""
    n = _check_count(n)
    pool = control_pool(ranked, n, exclude_top)
    if n > len(pool):
        raise InputError(f"asked for {n} random heads, only {len(pool)} lie outside the top {max(exclude_top, n)}")
    if n == 0:
        return [[]]
    if comb(len(pool), n) <= draws:
        return [list(c) for c in combinations(pool, n)]
    sets: dict[tuple, list] = {}
    for d in range(100 * draws):  # seeded draws, repeats skipped
        heads = select_heads(ranked, n, how="random", exclude_top=max(exclude_top, n), seed=seed + d)
        sets.setdefault(tuple(heads), heads)
        if len(sets) == draws:
            break
    return list(sets.values())


def _record(model: nn.Module, modules: list[nn.Module], layers: set[int], reference) -> dict[int, Tensor]:
    seen: dict[int, Tensor] = {}
    pairs = [
        (modules[l].register_forward_pre_hook, lambda m, a, l=l: seen.__setitem__(l, a[0].detach())) for l in layers
    ]
    with registered_hooks(pairs), torch.no_grad():
        model(reference)
    return seen


@contextmanager
def ablate_heads(model: nn.Module, heads, mode: str = "zero", reference=None, seed: int = 0) -> Iterator[nn.Module]:
    """Run ``model`` with ``heads`` (``(layer, head)`` pairs, or ``rank_heads`` rows) ablated inside the
    block (module docstring).

    ``reference``: inputs of the model (token ids ``[B, T]`` or our models' ``[B, T, d_in]``) for the
    ``"mean"`` and ``"resample"`` modes. ``"mean"`` averages over every reference position, BOS
    included (pass references without it to leave an attention sink out); resampling needs
    reference sequences at least as long as the ablated run's."""
    if mode not in MODES:
        raise InputError(f"mode={mode!r}; choose one of {MODES}")
    if mode != "zero" and reference is None:
        raise InputError(f"mode={mode!r} needs reference inputs")
    modules, n_heads = head_sites(model)
    heads = as_heads(heads)
    for l, h in heads:
        if not (0 <= l < len(modules) and 0 <= h < n_heads):
            raise InputError(f"head ({l}, {h}) is not in the model ({len(modules)} layers x {n_heads} heads)")
    by_layer: dict[int, list[int]] = {}
    for l, h in heads:
        by_layer.setdefault(l, []).append(h)
    ref = _record(model, modules, set(by_layer), reference) if mode != "zero" else {}
    gen = np.random.default_rng(seed)
    first = min(by_layer, default=None)
    donors: dict[
        str, Tensor
    ] = {}  # this forward's reference rows, drawn by the first ablated layer (layers run in order)

    def hook_for(layer: int):
        mine = by_layer[layer]

        def hook(module, args):
            z = args[0].clone()  # [B, T, H * dh]
            dh = z.shape[-1] // n_heads
            if mode == "resample":
                r = ref[layer]
                if r.shape[1] < z.shape[1]:
                    raise InputError(f"resample: reference sequences have {r.shape[1]} positions, the run {z.shape[1]}")
                if layer == first or donors.get("rows") is None or len(donors["rows"]) != z.shape[0]:
                    donors["rows"] = torch.from_numpy(gen.integers(r.shape[0], size=z.shape[0]))
                donor = r[donors["rows"], : z.shape[1]].to(z.dtype)  # [B, T, H * dh]
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

    def refuse_cached(module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 4.x / 5.x names
        if cache is not None and getattr(cache, "get_seq_length", lambda: 0)() > 0:
            raise InputError(
                "resample ablation aligns the reference by position, which cached decoding (generate) "
                "does not give; use mode='zero' or 'mean', or call generate(..., use_cache=False)"
            )

    pairs = (
        [(lambda h: model.register_forward_pre_hook(h, with_kwargs=True), refuse_cached)] if mode == "resample" else []
    )
    pairs += [(modules[layer].register_forward_pre_hook, hook_for(layer)) for layer in sorted(by_layer)]
    modes = _ACTIVE.get(model) or []
    _ACTIVE[model] = [*modes, mode]
    try:
        with registered_hooks(pairs):
            yield model
    finally:
        if modes:
            _ACTIVE[model] = modes
        else:
            _ACTIVE.pop(model)
