"""The thought-patch fit, one engine for every model (``tp.thought_patch`` calls ``fit``; ``front.py`` has
the math, ``docs/thought-patches.md``), layer by layer over the adapter's named sites:

* **targets**: the calibration queries read after the prompt (``Adapter.prompted``: the prompt's work is
  done once: a language model's keys and values cached, our layers' context states kept), every layer
  recorded at once per batch; kept while they fit in ``cache_bytes`` (``Targets``), recomputed otherwise;
* **anchors**: the queries without the prompt (after the prompt's first token with ``keep_bos``) under
  the static patch fitted so far, recorded at the layer being fitted. This pass runs one layer at a
  time (``Adapter.layer_calls``: each layer called with the arguments the model's own forward gave it,
  captured once): the stream entering layer ``l`` is kept (sequential mode: the output of layer
  ``l - 1`` under its fitted patch; teacher mode: the with-prompt states), so a layer costs a few layer
  forwards, not a forward up to it: one for the input side, one for the output side (a post-MLP norm's
  scale is fitted from that pass too); the next layer's stream is written from it
  (``lm_output.next_streams``), not run again.

Calibration inputs of different lengths are padded on the right into a few batches; causal layers
keep padding from reaching any real token, and only real positions are fitted.

Input side: ``D`` with ``D s_0 ~ s_C - s_0`` (ridge), stored as the input change ``"<mlp>:input"``
(``s -> s + D s``, i.e. ``W + W D`` on every matrix reading the MLP input: the gate, the up projection, a
router and its experts) where the layer names its MLP (``Sites.input_site``), else as ``W D`` on each
matrix reading it. Output side, with the input change in place: the output kind's own fit
(``OutputSite.fit_pairs``, ``lm_output.fit_output``): ``dW h' (+ db) ~ t``, ``t = out_C - out_0`` what
the layer still misses; through a norm after the MLP (Gemma 2/3) its direction, then the norm's scale
(``lm_output.fit_norm``; ``docs/prompt-compression.md`` §2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch.arch import weight_layout
from tokenpatch.arch.hf_calls import call_layer, carries
from tokenpatch.arch.hooks import output_tensor
from tokenpatch.arch.record import LayerRecord
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch import INPUT_SUFFIX, Delta
from tokenpatch.patching import param_layout
from tokenpatch.progress import progress_bar
from tokenpatch.run import hooked
from tokenpatch.thought.fit import LayerFit, ThoughtPatch, cut_rank, provenance, ridge_setting, static_patch
from tokenpatch.thought.lm_output import STREAM_KEYS, fit_norm, fit_output, next_streams
from tokenpatch.thought.lstsq import accumulate, factor, residual, solve

__all__ = ["fit", "Targets", "TARGET_KEYS", "batched"]

TARGET_KEYS = ("s", "out", "sum")  # what the fits read of the with-prompt pass (sum: Sites.sum_norm)


def batched(x: Tensor) -> Tensor:
    """One prompt as a batch of one: token ids ``[P]`` -> ``[1, P]``, embeddings ``[P, d]`` -> ``[1, P, d]``."""
    return x[None] if x.ndim == (1 if not x.is_floating_point() else 2) else x


class Targets:
    """The with-prompt records of the calibration batches, per batch every layer's (``prompted``). Kept
    when all of them fit in ``cache_bytes`` (measured on the first batch), else recomputed at each use:
    memory then does not grow with the number of calibration queries."""

    def __init__(self, prompted: Callable, batches: list[Tensor], cache_bytes: float):
        first = prompted(batches[0])
        per_row = sum(t.numel() * t.element_size() for r in first for t in r.tensors().values()) / len(batches[0])
        self.prompted, self.batches = prompted, batches
        self.cached = per_row * sum(len(q) for q in batches) <= cache_bytes
        self.kept = [first, *(prompted(q) for q in batches[1:])] if self.cached else None

    def __getitem__(self, b: int) -> list[LayerRecord]:
        return self.kept[b] if self.cached else self.prompted(self.batches[b])


class Streams:
    """The no-prompt pass entering the current layer, per batch ``(stream [b, T, d], each layer's call, the
    layer below's whole output where the current layer's call reads it)`` (``Adapter.layer_calls``; a
    ``Carried`` argument: ZAYA's router state), under the patch of the layers below. Kept and moved up a
    layer at a time (``advance``), or, where the targets are not kept either (``keep=False``), recomputed at each use
    from the inputs through the patched layers below: memory then does not grow with the queries."""

    def __init__(self, adapter, model: nn.Module, inputs: list[Tensor], keep: bool):
        self.adapter, self.model, self.inputs = adapter, model, inputs
        self.layers = adapter.layers(model)
        self.kept = [(*adapter.layer_calls(model, a), None) for a in inputs] if keep else None
        self.layer, self.patch = 0, None

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, b: int) -> tuple[Tensor, list, Any]:
        if self.kept is not None:
            return self.kept[b]
        h, calls = self.adapter.layer_calls(self.model, self.inputs[b])
        below = None
        with hooked(self.model, self.patch, True, True) if self.patch is not None else contextlib.nullcontext():
            for j in range(self.layer):
                below = call_layer(self.layers[j], h, calls[j], below)
                h = output_tensor(below)
        return h, calls, below

    def advance(self, streams: list[Tensor] | None, patch) -> None:
        """To the next layer: its input ``streams`` where they are kept (``None``: not needed, teacher mode);
        ``patch``, every layer's so far."""
        if self.kept is not None and streams is not None:
            kept = zip(streams, self.kept)
            self.kept = [(h, calls, self._below(old, calls, below, patch)) for h, (old, calls, below) in kept]
        self.layer, self.patch = self.layer + 1, patch

    def _below(self, h: Tensor, calls: list, below: Any, patch) -> Any:
        """The current layer's whole output on its input ``h`` (``below``: its own call's) under ``patch``, where
        the next layer's call reads it (one more pass of the layer), else ``None``."""
        i = self.layer
        if i + 1 >= len(calls) or not carries(calls[i + 1]):
            return None
        with hooked(self.model, patch, True, True) if patch is not None else contextlib.nullcontext():
            return call_layer(self.layers[i], h, calls[i], below)


def fit(
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
    cache_bytes: float = 2**30,
    keep_bos: bool = False,
    layers: Any = None,
    norm_steps: int = 0,
) -> ThoughtPatch:
    """``thought_patch`` (its arguments checked there): ``prompt`` ``[P, ...]`` or ``[1, P, ...]``, ``batches``
    of calibration inputs ``[b, T_q, ...]``. ``keep_bos``: the prompt's first token stays in front of the
    queries in the no-prompt pass. ``layers``: the layers fitted (default all). Returns a ``ThoughtPatch``."""
    adapter.check_model(model)
    if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise InputError(
            "distributed=True needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    prompt = batched(prompt)  # [1, P, ...]
    n_layers, p = adapter.n_layers(model), prompt.shape[1]
    if keep_bos and p < 2:
        raise InputError("keep_bos=True needs a prompt of at least 2 tokens (the first is kept)")
    if keep_bos and mode == "teacher":
        raise InputError("keep_bos=True is for mode='sequential' (teacher mode reads the with-prompt states)")
    fitted = sorted(set(range(n_layers) if layers is None else (int(i) for i in layers)))
    if not fitted or fitted[0] < 0 or fitted[-1] >= n_layers:
        raise InputError(f"layers must be a non-empty set of layer indices in [0, {n_layers}), got {layers!r}")
    head = prompt[:, :1] if keep_bos else prompt[:, :0]  # [1, 0 or 1, ...]  kept in the no-prompt pass
    batches, valid = _batches(batches)
    # a rotation that changes with the length (longrope, dynamic) rotates a whole batch as its longest
    # row: each batch holds rows of one regime, with the prompt and without (arch.rotary)
    scaling = adapter.length_scaling(model)
    if scaling is not None:
        batches, valid = _by_regime(
            batches, valid, lambda n: (scaling.regime(p + n), scaling.regime(head.shape[1] + n))
        )
    keys = TARGET_KEYS + (("h",) if mode == "teacher" else ())
    targets = Targets(adapter.prompted(model, prompt, keys), batches, cache_bytes)
    # the no-prompt pass, one layer at a time: each batch's stream entering the next layer (under the
    # patch of the layers below) and the arguments the model gives each layer, captured once
    alone = [torch.cat([head.expand(len(q), *head.shape[1:]).to(q.device), q], 1) for q in batches]
    streams = Streams(adapter, model, alone, targets.cached)
    deltas: dict[str, Delta] = {}
    fits = []
    readers: dict[str, list] = {}
    for i in progress_bar(range(fitted[-1] + 1), progress, desc="thought_patch", unit="layer"):
        layer = streams.layers[i]

        def run(current: dict[str, Delta], record: bool, kept: list | None = None):
            """Per batch, layer ``i`` on its stream under ``current``, layer ``i``'s own deltas (the
            stream already carries those of the layers below): its recorded states at the query
            positions (``record``), or its output. ``kept``: also keep each batch's states at every
            position with the layer's output, from which ``next_streams`` writes the next stream."""
            patch = static_patch(current, {}, {k: readers[k] for k in current if k in readers}) if current else None
            for b, v in enumerate(valid):
                h, calls, below = streams[b]
                if mode == "teacher":  # every layer fitted on the with-prompt states
                    if carries(calls[i]):
                        raise UnsupportedModelError(
                            f"mode='teacher': layer {i} reads the layer below's output beside its hidden states (a router "
                            "state), whose with-prompt value is not recorded; use mode='sequential'"
                        )
                    h = targets[b][i].h
                at = torch.arange(head.shape[1], alone[b].shape[1], device=h.device)  # the query positions
                # the patch's hooks first: a recording hook on a patched module then sees the patched output
                with hooked(model, patch, True, True) if patch is not None else contextlib.nullcontext():
                    with (
                        adapter.recording(model, at, every=True)
                        if record
                        else contextlib.nullcontext([None] * (i + 1)) as rec
                    ):
                        out = output_tensor(call_layer(layer, h, calls[i], below))
                if not record:
                    yield out
                    continue
                if kept is not None:
                    kept.append((rec[i].only(STREAM_KEYS), out))
                r0 = rec[i].map(lambda t: t[:, head.shape[1] :])  # [b, T_q, .]  the query positions
                yield targets[b][i], r0, v.to(h.device)

        mine: dict[str, Delta] = {}  # layer i's deltas
        moved = None  # the next layer's input, where the output side's pass wrote it
        if i in fitted:
            sites = adapter.sites(model, i)
            fit: dict[str, Any] = {"layer": i, "ridge": ridge_setting(ridge)}
            if inputs and sites.inputs:
                acc = accumulate(((r0.s[v], (rc.s - r0.s)[v]) for rc, r0, v in run(mine, True)), distributed, solver)
                d, solved_rank, cond, lam, parts = solve(acc, ridge, False, f"layer {i} input side")
                fit.update(
                    n=acc.n,
                    input_residual=residual(acc, d, lam),
                    input_rank=solved_rank,
                    input_condition=cond,
                    input_ridge=lam,
                )
                mine.update(cut_rank(_input_deltas(model, sites, d, parts, readers), rank))
            if output is not None and sites.output is not None:
                site = sites.output
                kept = [] if i < fitted[-1] and mode == "sequential" and streams.kept is not None else None
                pairs = run(mine, True, kept)
                if site.norm is not None:  # read twice: the fit, then the norm's scale on its directions
                    pairs = list(pairs)
                fit.update(fit_output(model, i, site, pairs, mine, output, ridge, distributed, solver))
                mine.update(cut_rank(mine, rank))
                if site.norm is not None:  # a norm after the MLP: its scale, fitted on the directions
                    fit.update(fit_norm(model, site, pairs, mine, fit["output_ridge"], norm_steps, rank, distributed))
                if kept is not None:  # the next layer's input from the output side's pass: no third pass
                    moved = next_streams(model, site, mine, kept, sites.sum_norm)
            fits.append(LayerFit(**{"n": 0, **fit}))
            deltas.update(mine)
        if i < fitted[-1]:
            if streams.kept is not None and mode == "sequential" and moved is None:
                moved = list(run(mine, False))  # the next layer's input, this layer patched
            streams.advance(moved, static_patch(deltas, {}, readers) if deltas else None)
    if not deltas:
        raise InputError("nothing was fitted: the layers fitted have no input sites and no output sites")
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
    return ThoughtPatch(static_patch(deltas, meta, readers or None), fits)


def _input_deltas(model: nn.Module, sites, d: Tensor, parts, readers: dict) -> dict[str, Delta]:
    """The input side ``D``: one input change ``"<mlp>:input"`` where the layer names its MLP (its readers
    recorded in ``readers``; in the dtype of the matrices reading it), else ``dW = W D`` on every matrix
    reading the MLP input, factored."""
    if sites.input_site is not None:
        key = f"{sites.input_site}{INPUT_SUFFIX}"
        readers[key] = [[name, param_layout(model, name)] for name in sites.inputs]
        return {key: factor(d, parts).to(model.get_parameter(sites.inputs[0]).dtype)}
    out = {}
    for name in sites.inputs:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        w = getattr(module, attr).detach().double()
        layout = weight_layout(module, name)
        math = (w if layout == "out_in" else w.T) @ d  # [out, in]
        out[name] = factor(math if layout == "out_in" else math.T).to(getattr(module, attr).dtype)
    return out


def _batches(batches: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The calibration batches and, per batch, its real positions ``[b, T]``: as given where they share one
    length, else right-padded (``_right_padded``)."""
    if len({q.shape[1] for q in batches}) == 1:
        return list(batches), [torch.ones(q.shape[:2], dtype=torch.bool) for q in batches]
    return _right_padded(batches, max(256, *(q.shape[0] for q in batches)))


def _right_padded(batches: list[Tensor], rows: int, waste: float = 0.25) -> tuple[list[Tensor], list[Tensor]]:
    """Calibration inputs of any lengths as few batches of up to ``rows`` rows, padded on the right
    (zeros), and per batch the real positions ``[b, T]``. Causal layers: padding after a token never
    reaches it, so no mask is needed; the fits read the real positions only. Rows are taken shortest
    first, and a batch is closed before its padding would exceed ``waste`` of its real positions (one
    long query does not pad a batch of short ones to its length)."""
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
        padded = chunk[0].new_zeros(len(chunk), width, *chunk[0].shape[1:])
        real = torch.zeros(len(chunk), width, dtype=torch.bool)
        for b, r in enumerate(chunk):
            padded[b, : len(r)], real[b, : len(r)] = r, True
        out.append(padded)
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
