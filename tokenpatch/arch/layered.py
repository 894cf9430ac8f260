"""The two passes of an adapter written for the layer-by-layer methods (``embed``, ``mix``, ``finish``).

``tp.token_patch`` reads every model through one pair of passes, ``Adapter.trace`` (the with-context
record at the queries) and ``Adapter.anchors`` (``(m_0, s_0)`` of the no-context pass). Our models and
the Hugging Face families record them with hooks during the model's own forward. An adapter that
implements only ``embed``, ``mix`` and ``finish`` (the interface of earlier versions, deprecated: it is
refused from the next release) gets them from here, layer by layer:

* ``trace``: ``h^0 = embed(inputs)``; per layer ``(m, s) = mix(h)``, ``(hidden, out) = finish(m, s)``,
  recorded at the queries, ``h = out``;
* ``anchors``: each query alone, ``mix`` of its with-context layer input as a sequence of its own
  (before the first layer, the no-context embedding where it depends on the position); or, with a
  chunk removed, the kept sequence layer by layer, its states at the queries replaced by the
  with-context ones before each layer after the first (the patched layers below reproduce them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tokenpatch.arch.record import LayerRecord

__all__ = ["trace", "anchors"]


def trace(adapter, model, inputs: Any, query: list[int], on_layer: Callable | None = None) -> list[LayerRecord]:
    """Per layer the with-context ``LayerRecord`` (``h, m, s, hidden, out``) at ``query`` ``[B, Q, .]``."""
    h = adapter.embed(model, inputs)  # [B, T, d]
    rec = []
    for i in range(adapter.n_layers(model)):
        m, s = adapter.mix(model, i, h)
        hidden, out = adapter.finish(model, i, m, s)
        r = LayerRecord(h=h[:, query], m=m[:, query], s=s[:, query], hidden=hidden[:, query], out=out[:, query])
        if on_layer is not None:
            on_layer(i, r)
        rec.append(r)
        h = out
    return rec


def anchors(
    adapter, model, inputs: Any, query: list[int], rec: list[LayerRecord], kept: list[int] | None = None
) -> list[tuple[Tensor, Tensor]]:
    """Per layer ``(m_0, s_0)`` ``[B, Q, .]``: each query alone (``kept=None``), or the kept positions as one
    sequence."""
    batch, n_q = rec[0].h.shape[:2]
    if kept is None:
        out = []
        for i, r in enumerate(rec):
            h = r.h.reshape(batch * n_q, 1, -1)  # [B*Q, 1, d]  each query its own sequence
            if i == 0 and adapter.position_dependent_embedding:
                h = adapter.embed(model, adapter.strip(inputs, torch.tensor(query), True))
            m, s = adapter.mix(model, i, h)
            out.append((m.reshape(batch, n_q, -1), s.reshape(batch, n_q, -1)))
        return out
    at = [kept.index(q) for q in query]  # the queries in the kept sequence
    h = adapter.embed(model, adapter.strip(inputs, torch.tensor(kept), False))  # [B, K, d]
    out = []
    for i, r in enumerate(rec):
        if i > 0:
            h = h.clone()
            h[:, at] = r.h.to(h.dtype)
        m, s = adapter.mix(model, i, h)
        out.append((m[:, at], s[:, at]))
        h = adapter.finish(model, i, m, s)[1]
    return out
