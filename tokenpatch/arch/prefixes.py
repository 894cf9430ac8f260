"""The prefix rows of ``tp.trajectory``: every context prefix's query, recorded like a token patch's.

Prefix ``i`` of a sequence whose query ``x`` (at position ``q``) follows ``c_1..c_q`` is ``[c_1..c_i, x]``;
its *row* is the query read after it. ``Adapter.prefixes`` gives, layer by layer, what
``tp.token_patch`` would read of each row: the with-context ``LayerRecord`` at the query, the anchor
``(m_0, s_0)`` of the query alone, and for the increments the anchor with ``c_i`` removed (the row read
after ``c_1..c_{i-1}``). The trajectory's deltas are then the token patch's own (``patching.layer_patch``),
one engine for every model. Two ways to run the rows:

* ``padded`` (any adapter, from its ``trace`` and ``anchors``): the rows are sequences of their own,
  left-padded to the longest one of their chunk (``Adapter.prefix_inputs``), run by the model's own forward a chunk of
  rows at a time; the query is each row's last position;
* ``virtual`` (an adapter whose layers run *virtual query rows*, ``Adapter.mix_prefixes``: our models):
  by causality the context's states at every layer are those of the full pass whatever the prefix, so
  each layer runs the context once and the ``q + 1`` rows beside it, row ``i`` reading the context's
  first ``i`` positions and itself (attention reuses the context's keys and values, a recurrent layer
  steps once from its state after ``c_i``): ``O(q)`` query rows per layer, not ``O(q^2)`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from tokenpatch.arch.record import LayerRecord
from tokenpatch.arch.rotary import forget_longest
from tokenpatch.errors import UnsupportedModelError

__all__ = ["padded", "virtual", "ROWS_PER_PASS"]

ROWS_PER_PASS = 64  # padded rows per forward pass (batch rows x prefixes), at least one prefix

# one layer's prefix rows: (layer, prefixes, with-context record, anchor alone, anchor with c_i removed)
Rows = tuple[int, range, LayerRecord, tuple[Tensor, Tensor], tuple[Tensor, Tensor] | None]


def padded(adapter, model, inputs: Any, query: int, rows: range, steps: bool) -> Iterator[Rows]:
    """The rows ``rows`` as left-padded sequences of the model's own forward (module docstring), in chunks
    of prefixes; each chunk's records and anchors ``[B, len(chunk), .]``, yielded layer by layer. A
    chunk's rows share one length (its longest prefix plus the query), so a rotation that depends on
    the length (``Adapter.length_scaling``) rotates each as it would alone only where all of ``rows`` lie
    in one of its regimes: the caller groups them so. Where left padding can change what a real token
    reads (``Adapter.pads_exactly``: a recurrent layer whose biases make a pad's state nonzero), each
    chunk is one prefix, without padding. With ``steps`` the token right before the query,
    ``c_i`` in every row, is removed (a row without context removes a pad: its increment is zero anyway)."""
    scaling = adapter.length_scaling(model)
    batch = adapter.batch_size(inputs)
    per_pass = max(1, ROWS_PER_PASS // batch) if adapter.pads_exactly(model) else 1
    for a in range(rows.start, rows.stop, per_pass):
        chunk = range(a, min(a + per_pass, rows.stop))
        width = chunk.stop  # prefix i has i + 1 tokens: the chunk's longest
        seqs = adapter.prefix_inputs(model, inputs, query, chunk, width)  # [B * len(chunk), width]
        at = [width - 1]  # the query: every row's last position

        def rows_of(t: Tensor) -> Tensor:  # [B * n, 1, .] -> [B, n, .]
            return t.reshape(batch, len(chunk), *t.shape[2:])

        device = seqs["input_ids"].device
        forget_longest(model, scaling, device)  # a "dynamic" rotation as a fresh model's: each row as if alone
        rec = adapter.trace(model, seqs, at)
        alone = adapter.anchors(model, seqs, at, rec)
        steps_at = None  # per layer, the anchor of each row with c_i removed
        if steps and width > 1:
            forget_longest(model, scaling, device)
            steps_at = adapter.anchors(model, seqs, at, rec, [p for p in range(width) if p != width - 2])
        elif steps:  # prefix 0 alone: nothing to remove, its own anchor (a zero increment)
            steps_at = alone
        for i, r in enumerate(rec):
            step = None if steps_at is None else steps_at[i]
            yield (
                i,
                chunk,
                r.map(rows_of),
                tuple(rows_of(t) for t in alone[i]),
                None if step is None else tuple(rows_of(t) for t in step),
            )


def virtual(adapter, model, inputs: Any, query: int, rows: range, steps: bool) -> Iterator[Rows]:
    """All ``query + 1`` rows as virtual query rows of the adapter's layers (module docstring), layer by
    layer: ``embed``, then per layer ``mix_prefixes`` (the rows and, beside them, each row alone) and
    ``finish``, the context one layer up by ``mix`` and ``finish``. With ``steps``, row ``i`` read after
    ``c_1..c_{i-1}``; row 0, which has no ``c_0``, reads its anchor alone (a zero increment)."""
    if adapter.position_dependent_embedding:
        raise UnsupportedModelError(
            f"tp.trajectory needs position-free embeddings; the {adapter.name} adapter has position-dependent ones"
        )
    h = adapter.embed(model, inputs)  # [B, T, d]
    batch, _, width = h.shape
    ctx = h[:, :query]  # [B, N, d]  the context, layer by layer (full pass)
    hq = h[:, query : query + 1].expand(batch, len(rows), width)  # [B, N+1, d]  the query after each prefix
    lengths = torch.arange(rows.start, rows.stop)  # row i reads c_1..c_i
    n_layers = adapter.n_layers(model)
    for i in range(n_layers):
        (m, s), alone = adapter.mix_prefixes(model, i, ctx, hq, lengths, with_alone=True)  # [B, N+1, d] each
        hidden, out = adapter.finish(model, i, m, s)
        step = None
        if steps:  # the same rows read one context token earlier; row 0 (no c_0) alone
            k = int(rows.start == 0)
            shorter = adapter.mix_prefixes(model, i, ctx, hq[:, k:], lengths[k:] - 1)  # [B, N, d]
            step = tuple(torch.cat([a[:, :k], b], 1) for a, b in zip(alone, shorter))
        yield i, rows, LayerRecord(h=hq, m=m, s=s, hidden=hidden, out=out), alone, step
        if i + 1 < n_layers:
            ctx = adapter.finish(model, i, *adapter.mix(model, i, ctx))[1]
        hq = out
