"""Thought patches of Hugging Face language models (``tp.thought_patch`` dispatches here).

The same least squares as ``icl.py`` (``front.py`` has the math, ``docs/thought-patches.md``), layer by layer in
sequential mode, with both passes the model's own forward:

* **targets**: the calibration query tokens read after the prompt, ``[prompt; q]`` (positions
  ``P ..``), every layer recorded at once per batch; the prompt runs once and every query reads its
  keys and values from the cache (the same numbers as running ``[prompt; q]`` whole);
* **anchors**: the query tokens without the prompt (positions ``0 ..``; after the prompt's first
  token with ``keep_bos``), under the static patch fitted so far, recorded at the layer being
  fitted. This pass runs one decoder layer at a time: the stream entering layer ``l`` is kept (the
  output of layer ``l - 1`` under its fitted patch) and each layer is called with the arguments the
  model's own forward gave it (masks, rotary embeddings), captured once, so a layer costs a few
  layer forwards, not a forward up to it: one for the input side, one for the output side (a
  post-MLP norm's scale is fitted from that pass too); the next layer's stream is written from it
  (``lm_output.next_streams``), not run again.

Calibration inputs of different lengths are padded on the right (token 0) into a few batches;
causal attention keeps padding from reaching any real token, and only real positions are fitted.

Input side: ``D`` with ``D s_0 ~ s_C - s_0`` (ridge), stored as the input change
``"<mlp>:input"`` (``s -> s + D s``, i.e. ``W + W D`` on every matrix reading the MLP input: the
gate, the up projection, a router and its experts). Output side, with the input change in place:
``dW h' (+ db) ~ t``, ``t = out_C - out_0`` what the layer still misses, on the output matrix (and
its bias, affine). A norm after the MLP (Gemma 2/3: ``out = g * unit(W h)``) makes the output
nonlinear in ``W``: there ``dW`` aims the norm's input ``p = W h'`` at the direction the norm must
output, ``unit((out_C - m_0) / g) rms(p)``, optionally refined by ``norm_steps`` Gauss-Newton steps on
the norm's output itself (``thought.through_norm``), and the norm's scale is then fitted per channel
(``thought.lm_output``; ``docs/prompt-compression.md`` §2).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import offload
from tokenpatch.arch.hooks import output_tensor, registered_hooks
from tokenpatch.arch.record import LayerRecord
from tokenpatch.arch.rotary import forget_longest
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch import INPUT_SUFFIX, Delta
from tokenpatch.patching import param_layout
from tokenpatch.progress import progress_bar
from tokenpatch.run import hooked
from tokenpatch.thought.fit import (
    LayerFit,
    ThoughtPatch,
    cut_rank,
    provenance,
    ridge_setting,
    static_patch,
)
from tokenpatch.thought.lm_output import STREAM_KEYS, fit_norm, fit_output, next_streams
from tokenpatch.thought.lstsq import accumulate, factor, residual, solve

_TARGET_KEYS = ("s", "out", "sum")  # what the fits read of the with-prompt pass (sum: Sites.sum_norm)
TARGET_CACHE_BYTES = 2**28  # the prompt's keys and values copied per target batch, at most (about)


class _Stop(Exception):
    """Raised by a hook to end a forward once what it needs has been seen."""


def _layer_calls(
    model: nn.Module, layers: nn.ModuleList, ids: Tensor, scaling=None, device=None
) -> tuple[Tensor, list[tuple]]:
    """The first layer's input and, per layer, the other arguments the model passes it for the
    sequences ``ids`` (attention masks, position embeddings: whatever this model's forward builds),
    captured in one forward that stops after the last layer's call begins (a ``"dynamic"`` rotation
    as a fresh model's: ``arch.rotary``)."""
    forget_longest(model, scaling, device)
    calls: list[tuple] = []
    first: list[Tensor] = []

    def grab(module, args, kwargs):
        if not first:
            first.append(args[0] if args else kwargs["hidden_states"])
        calls.append((args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        if len(calls) == len(layers):
            raise _Stop

    with (
        registered_hooks([(lambda h, m=m: m.register_forward_pre_hook(h, with_kwargs=True), grab) for m in layers]),
        contextlib.suppress(_Stop),
    ):
        model.base_model(input_ids=ids, use_cache=False)
    if len(calls) != len(layers) or not first:
        raise UnsupportedModelError(f"{type(model).__name__}: its forward did not call every decoder layer once")
    return first[0], calls


def _ids(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor) and x.dtype in (torch.int64, torch.int32):
        return x
    raise InputError(
        f"{what} must be token ids (an integer tensor), got "
        f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
    )


def fit_lm(
    model: nn.Module,
    adapter,
    prompt: Tensor,
    batches: list,
    *,
    ridge: float | str,
    mode: str,
    inputs: bool,
    output: str | None,
    rank: int | None,
    solver: str,
    distributed: bool,
    progress,
    keep_bos: bool = False,
    layers: Any = None,
    norm_steps: int = 0,
) -> ThoughtPatch:
    """``thought_patch`` for a language model: ``prompt`` token ids ``[P]`` or ``[1, P]``, ``batches`` of
    calibration query ids ``[b, T_q]`` (the same length in a batch). ``keep_bos``: the prompt's first
    token stays in front of the queries in the no-prompt pass. ``layers``: the layers fitted (default
    all). Returns a ``ThoughtPatch``."""
    adapter.check_model(model)  # a causal LM in eval mode
    if mode != "sequential":
        raise UnsupportedModelError("on a language model only mode='sequential' is supported")
    prompt = _ids(prompt, "prompt")
    prompt = prompt[None] if prompt.ndim == 1 else prompt  # [1, P]
    batches = [_ids(q, "calibration") for q in batches]
    if any(q.ndim != 2 for q in batches):
        raise InputError("calibration must be token ids [m, T_q]")
    n_layers, p = adapter.n_layers(model), prompt.shape[1]
    if keep_bos and p < 2:
        raise InputError("keep_bos=True needs a prompt of at least 2 tokens (the first is kept)")
    fitted = sorted(set(range(n_layers) if layers is None else (int(i) for i in layers)))
    if not fitted or fitted[0] < 0 or fitted[-1] >= n_layers:
        raise InputError(f"layers must be a non-empty set of layer indices in [0, {n_layers}), got {layers!r}")
    head = prompt[:, :1] if keep_bos else prompt[:, :0]  # [1, 0 or 1]  kept in the no-prompt pass
    vocab = model.get_input_embeddings().num_embeddings
    for t in (prompt, *batches):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise InputError(f"token ids must lie in [0, {vocab})")
    device = offload.device(model.get_input_embeddings())  # an offloaded table: where its hook runs it
    batches, valid = _right_padded(batches, max(256, *(q.shape[0] for q in batches)))
    # a rotation that changes with the length (longrope, dynamic) rotates a whole batch as its longest
    # row: each batch holds rows of one regime, with the prompt and without (arch.rotary)
    scaling = adapter.length_scaling(model)
    if scaling is not None:
        batches, valid = _by_regime(
            batches, valid, lambda n: (scaling.regime(p + n), scaling.regime(head.shape[1] + n))
        )

    # the prompt's keys and values, computed once: every calibration query reads them from a copy
    prompt_cache = model.base_model(input_ids=prompt.to(device), use_cache=True).cache
    row_bytes = sum(t.numel() * t.element_size() for t in _cache_tensors(prompt_cache)) or 1

    def targets(q: Tensor) -> list[LayerRecord]:
        """Every layer's with-prompt states at the query positions ``[b, T_q, .]``: the queries run on
        the prompt's cache (rows at a time, so that the copies stay under ``TARGET_CACHE_BYTES``), or,
        where the prompt alone is rotated otherwise than prompt and queries (``arch.rotary``), as
        ``[prompt; q]`` whole, as the model's own forward of them does."""
        parts = []
        whole = scaling is not None and scaling.regime(p) != scaling.regime(p + q.shape[1])
        for rows in q.to(device).split(max(1, TARGET_CACHE_BYTES // row_bytes)):
            at = torch.arange(p if whole else 0, p + rows.shape[1] if whole else rows.shape[1], device=device)
            if whole:
                forget_longest(model, scaling, device)  # a "dynamic" rotation as a fresh model's
            with adapter.recording(model, at, every=not whole) as rec:
                if whole:
                    model.base_model(input_ids=torch.cat([prompt.to(device).expand(len(rows), -1), rows], 1))
                else:
                    kv = copy.deepcopy(prompt_cache)
                    kv.batch_repeat_interleave(rows.shape[0])
                    model.base_model(input_ids=rows, cache=kv, use_cache=True)
            parts.append([r.only(_TARGET_KEYS) for r in rec])  # what the fits read of this pass
        return [LayerRecord.cat([part[i] for part in parts]) for i in range(n_layers)]

    # the targets do not depend on the fit: computed once and kept (m x T_q x layers x 2 d numbers)
    cache = [targets(q) for q in batches]
    # the no-prompt pass, one layer at a time: each batch's stream entering the next layer (under the
    # patch of the layers below) and the keyword arguments the model gives each layer (masks,
    # rotary embeddings), captured once; a layer's anchors then cost one layer's forward, not i+1
    layers_ = adapter.layers(model)
    alone = [torch.cat([head.to(device).expand(q.shape[0], -1), q.to(device)], 1) for q in batches]  # [b, (1) + T_q]
    streams, calls = zip(*(_layer_calls(model, layers_, a, scaling, device) for a in alone))
    streams = list(streams)
    ats = [torch.arange(head.shape[1], a.shape[1], device=device) for a in alone]  # the query positions
    deltas: dict[str, Delta] = {}
    fits = []
    readers: dict[str, list] = {}
    bar = progress_bar(range(fitted[-1] + 1), progress, desc="thought_patch", unit="layer")
    for i in bar:
        layer = layers_[i]

        def run(current: dict[str, Delta], record: bool, kept: list | None = None):
            """Per batch, layer ``i`` on its stream under ``current``, layer ``i``'s own deltas (the
            stream already carries those of the layers below): its recorded states at the query
            positions (``record``), or its output. ``kept``: also keep each batch's states at every
            position with the layer's output, from which ``_next_streams`` writes the next stream."""
            patch = static_patch(current, {}, {k: readers[k] for k in current if k in readers}) if current else None
            for b, (v, kw) in enumerate(zip(valid, calls)):
                # the patch's hooks first: a recording hook on a patched module then sees the patched output
                with hooked(model, patch, True, True) if patch is not None else contextlib.nullcontext():
                    with (
                        adapter.recording(model, ats[b], every=True)
                        if record
                        else contextlib.nullcontext([None] * (i + 1)) as rec
                    ):
                        out = output_tensor(layer(streams[b], *kw[i][0], **kw[i][1]))
                if not record:
                    yield out
                    continue
                if kept is not None:
                    kept.append((rec[i].only(STREAM_KEYS), out))
                at = rec[i].map(lambda t: t[:, head.shape[1] :])  # [b, T_q, .]  the query positions
                yield cache[b][i], at, v.to(device)

        anchors = lambda current: run(current, True)  # noqa: E731
        mine: dict[str, Delta] = {}  # layer i's deltas
        moved = False  # whether the next layer's stream is already written
        if i in fitted:
            sites = adapter.sites(model, i)
            fit: dict[str, Any] = {"layer": i, "ridge": ridge_setting(ridge)}
            if inputs and sites.input_site is not None:
                key = f"{sites.input_site}{INPUT_SUFFIX}"
                acc = accumulate(((r0.s[v], (rc.s - r0.s)[v]) for rc, r0, v in anchors(mine)), distributed, solver)
                d, solved_rank, cond, lam, parts = solve(acc, ridge, False, f"layer {i} input side")
                fit.update(
                    n=acc.n,
                    input_residual=residual(acc, d, lam),
                    input_rank=solved_rank,
                    input_condition=cond,
                    input_ridge=lam,
                )
                readers[key] = [[name, param_layout(model, name)] for name in sites.inputs]
                mine.update(cut_rank({key: factor(d, parts).to(_dtype(model))}, rank))
            if output is not None and sites.output is not None:
                site, kept = sites.output, ([] if i < fitted[-1] else None)
                pairs = run(mine, True, kept)
                if site.norm is not None:  # read twice: the fit, then the norm's scale on its directions
                    pairs = list(pairs)
                fit.update(fit_output(model, i, site, pairs, mine, output, ridge, distributed, solver))
                mine.update(cut_rank(mine, rank))
                if site.norm is not None:  # a norm after the MLP: its scale, fitted on the directions
                    fit.update(fit_norm(model, site, pairs, mine, fit["output_ridge"], norm_steps, rank, distributed))
                if kept is not None:  # the next layer's input from the output side's pass: no third pass
                    streams, moved = next_streams(model, site, mine, kept, sites.sum_norm), True
            fits.append(LayerFit(**{"n": 0, **fit}))
            deltas.update(mine)
        if i < fitted[-1] and not moved:
            streams = list(run(mine, False))  # the next layer's input, this layer patched
    if not deltas:
        raise InputError("nothing was fitted")
    meta = provenance(
        model,
        adapter,
        fits,
        mode=mode,
        ridge=ridge_setting(ridge),
        inputs=inputs,
        output=output,
        rank=rank,
        solver=solver,
        prompt_len=p,
        keep_bos=bool(keep_bos),
        layers=fitted,
        norm_steps=norm_steps,
    )
    return ThoughtPatch(static_patch(deltas, meta, readers), fits)


def _right_padded(batches: list[Tensor], rows: int, waste: float = 0.25) -> tuple[list[Tensor], list[Tensor]]:
    """Calibration inputs of any lengths as few batches of up to ``rows`` rows, padded on the right
    (token 0), and per batch the real positions ``[b, T]``. Causal attention: padding after a
    token never reaches it, so no mask is needed; the fits read the real positions only. Rows are
    taken shortest first, and a batch is closed before its padding would exceed ``waste`` of its
    real positions (one long query does not pad a batch of short ones to its length)."""
    flat = sorted((row for q in batches for row in q), key=len)
    chunks: list[list[Tensor]] = []
    for row in flat:
        chunk = chunks[-1] if chunks else None
        real = sum(len(r) for r in chunk) + len(row) if chunk else 0
        if chunk and len(chunk) < rows and (len(chunk) + 1) * len(row) <= (1 + waste) * real:
            chunk.append(row)
        else:
            chunks.append([row])
    out, valid = [], []
    for chunk in chunks:
        width = max(len(r) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=chunk[0].dtype)
        real = torch.zeros(len(chunk), width, dtype=torch.bool)
        for b, r in enumerate(chunk):
            ids[b, : len(r)], real[b, : len(r)] = r, True
        out.append(ids)
        valid.append(real)
    return out, valid


def _by_regime(batches: list[Tensor], valid: list[Tensor], regime) -> tuple[list[Tensor], list[Tensor]]:
    """Each batch split into rows whose real lengths ``n`` share ``regime(n)``, each part cut to its
    longest row: a forward of the part is then rotated as each row's own (``arch.rotary``)."""
    out, real = [], []
    for ids, v in zip(batches, valid):
        lengths = v.sum(1).tolist()
        for key in dict.fromkeys(regime(n) for n in lengths):
            rows = [b for b, n in enumerate(lengths) if regime(n) == key]
            width = max(lengths[b] for b in rows)
            out.append(ids[rows, :width])
            real.append(v[rows, :width])
    return out, real


def _cache_tensors(cache) -> list[Tensor]:
    """The key and value tensors a Hugging Face cache holds (for its size)."""
    return [t for layer in getattr(cache, "layers", []) for t in (layer.keys, layer.values) if isinstance(t, Tensor)]


def _dtype(model: nn.Module) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype
