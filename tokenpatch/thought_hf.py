"""Thought patches of Hugging Face language models (``tp.thought_patch`` dispatches here).

The same least squares as ``thought.py`` (``docs/thought-patches.md``), layer by layer in
sequential mode, with both passes the model's own forward:

* **targets**: the calibration query tokens read after the prompt, ``[prompt; q]`` (positions
  ``P ..``), every layer recorded at once per batch;
* **anchors**: the query tokens without the prompt (positions ``0 ..``), under the static patch
  fitted so far, recorded at the layer being fitted.

Input side: ``D`` with ``D s_0 ~ s_C - s_0`` (ridge), stored as the input change
``"<mlp>:input"`` (``s -> s + D s``, i.e. ``W + W D`` on every matrix reading the MLP input: the
gate, the up projection, a router and its experts). Output side, with the input change in place:
``dW h' (+ db) ~ t``, ``t = out_C - out_0`` what the layer still misses, on the output matrix (and
its bias, affine). A post-MLP norm (Gemma) makes the output side nonlinear: only its input side
is fitted there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from . import _io
from ._progress import progress_bar
from .delta import INPUT_SUFFIX, Delta, Patch
from .errors import InputError, UnsupportedModelError
from .hooks import _hooked
from .lstsq import _accumulate, _factor, _residual, _solve
from .patching import param_layout


def _ids(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor) and x.dtype in (torch.int64, torch.int32):
        return x
    raise InputError(f"{what} must be token ids (an integer tensor), got "
                     f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")


def thought_patch_lm(model: nn.Module, adapter, prompt: Tensor, batches: list, *, ridge: float, mode: str,
                     inputs: bool, output: str | None, rank: int | None, solver: str, distributed: bool,
                     progress, fit_types) -> Any:
    """``thought_patch`` for a language model: ``prompt`` token ids ``[P]`` or ``[1, P]``, ``batches`` of
    calibration query ids ``[b, T_q]`` (the same length in a batch). Returns a ``ThoughtPatch``."""
    from .thought import _cut  # thought.py dispatches here: imported on use, not at module load

    ThoughtPatch, LayerFit = fit_types
    if mode != "sequential":
        raise UnsupportedModelError("on a language model only mode='sequential' is supported")
    prompt = _ids(prompt, "prompt")
    prompt = prompt[None] if prompt.ndim == 1 else prompt  # [1, P]
    batches = [_ids(q, "queries") for q in batches]
    if any(q.ndim != 2 for q in batches):
        raise InputError("queries must be token ids [m, T_q]")
    n_layers, p = adapter.n_layers(model), prompt.shape[1]
    vocab = model.get_input_embeddings().num_embeddings
    for t in (prompt, *batches):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise InputError(f"token ids must lie in [0, {vocab})")
    device = model.get_input_embeddings().weight.device

    def targets(q: Tensor) -> list[dict[str, Tensor]]:
        """Every layer's with-prompt states at the query positions ``[b, T_q, .]``."""
        full = torch.cat([prompt.to(device).expand(q.shape[0], -1), q.to(device)], 1)
        with adapter.recording(model, torch.arange(p, full.shape[1], device=device)) as rec:
            model.base_model(input_ids=full, use_cache=False)
        return [{k: r[k] for k in ("s", "out")} for r in rec]  # all the fits read

    # the targets do not depend on the fit: computed once and kept (m x T_q x layers x 2 d numbers)
    cache = [targets(q) for q in batches]
    deltas: dict[str, Delta] = {}
    fits = []
    readers: dict[str, list] = {}
    for i in progress_bar(range(n_layers), progress, desc="thought_patch", unit="layer"):
        sites = adapter.sites(model, i)
        fit: dict[str, Any] = {"layer": i, "ridge": float(ridge)}

        def anchors(current: dict[str, Delta]):
            """Per batch, layer ``i``'s no-prompt states under the patch ``current``."""
            patch = Patch(current, None, {"static": True, "inputs": readers}) if current else None
            for q, rec_c in zip(batches, cache):
                with adapter.recording(model, torch.arange(q.shape[1], device=device), every=True) as rec:
                    with _hooked(model, patch, True, True) if patch is not None else contextlib.nullcontext():
                        model.base_model(input_ids=q.to(device), use_cache=False)
                yield rec_c[i], rec[i]

        if inputs and sites.input_site is not None:
            key = f"{sites.input_site}{INPUT_SUFFIX}"
            acc = _accumulate(((r0["s"].flatten(0, -2), (rc["s"] - r0["s"]).flatten(0, -2)) for rc, r0 in anchors(deltas)),
                              distributed, solver)
            d, solved_rank, cond = _solve(acc, ridge, False, f"layer {i} input side")
            fit.update(n=acc.n, input_residual=_residual(acc, d), input_rank=solved_rank, input_condition=cond)
            readers[key] = [[name, param_layout(model, name)] for name in sites.inputs]
            deltas.update(_cut({key: _factor(d).to(_dtype(model))}, rank))
        if output is not None and sites.output is not None:
            kind, name = sites.output[:2]
            if kind == "matrix+scale":
                raise UnsupportedModelError(f"layer {i}: the output side of a {kind!r} site (a norm after the MLP) is "
                                            "not linear in the weights; fit the input side only (output=None)")
            fit.update(_fit_output(model, i, kind, name, anchors(deltas), deltas, output, ridge, distributed, solver))
            deltas.update(_cut(deltas, rank))
        fits.append(LayerFit(**{"n": 0, **fit}))
    if not deltas:
        raise InputError("nothing was fitted")
    meta = {"model": {**adapter.describe(model), "fingerprint": _io.fingerprint(model)}, "static": True,
            "inputs": readers, "thought": {"mode": mode, "ridge": float(ridge), "inputs": inputs, "output": output,
                                           "rank": rank, "solver": solver, "prompt_len": p, "positions": fits[0].n}}
    return ThoughtPatch(Patch(deltas, None, meta), fits)


def _fit_output(model: nn.Module, i: int, kind: str, name: str, pairs_source, deltas: dict, output: str, ridge: float,
                distributed: bool, solver: str) -> dict:
    from .thought import _solve_output

    """``dW h' (+ db) ~ out_C - out_0`` on layer ``i``'s output matrix; adds to ``deltas``."""
    module = model.get_submodule(name.rpartition(".")[0])
    affine = kind == "bias"  # "matrix" and "gated" sites have no bias: a linear fit
    if output == "vector" and not affine:
        raise InputError(f"layer {i}: {name.rpartition('.')[0]} has no bias for a thought vector; use output='affine'")

    def pairs():
        for rc, r0 in pairs_source:
            t = (rc["out"] - r0["out"]).flatten(0, -2)  # [N, d]  what the layer still misses
            if kind == "gated":  # the matrix's output is scaled by sigmoid(gate): fit t / gate
                t = t / torch.sigmoid(r0["gate"].flatten(0, -2).to(t.dtype))
            x = r0["hidden"].flatten(0, -2) if output == "affine" else t.new_zeros(t.shape[0], 0)
            yield (torch.cat([x, x.new_ones(x.shape[0], 1)], 1) if affine else x), t

    return _solve_output(pairs(), i, module, name, output, affine, deltas, ridge, distributed, solver)


def _dtype(model: nn.Module) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype
