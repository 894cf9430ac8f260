"""Implicit learning dynamics: the token patches of every context prefix, in one pass.

For a sequence whose query ``x`` (at position ``query``) follows context tokens ``c_1..c_N``,
*prefix i* is the sequence ``[c_1..c_i, x]`` (``docs/dynamics.md``). Two updates per prefix:

* ``traj.patch(i)``: the token patch of prefix ``i`` with all of its context removed (the fixed
  anchor of *Learning without training*: the query alone). Equal to
  ``tp.token_patch(model, inputs[:, [0..i-1] + [query]])``; ``i = 0`` is the zero patch.
* ``traj.step(i)``, ``i >= 1``: the one-token-removal increment that takes prefix ``i - 1`` to
  prefix ``i``, anchored at the prefix-``(i-1)`` state: ``tp.token_patch`` of prefix ``i`` with
  the token ``c_i`` removed (``remove=[i - 1]``), acting at the query.

One pass gives them all, with ``token_patch``'s own deltas (``recorded_patch``) on the rows
``Adapter.prefixes`` records (``arch.prefixes``): row ``i`` is the query read after ``c_1..c_i``. On our
models by causality the context tokens' hidden states at every layer are those of the full pass
whatever the prefix; only the query's state differs. So each layer runs the context once and ``N + 1``
*virtual query rows*, row ``i`` reading ``c_1..c_i`` and itself: attention reuses the context's keys
and values, a recurrent layer steps once from its state after ``c_i``. No per-prefix forward pass, no
dense matrix.

A language model runs the prefixes as rows of left-padded batches of its own forward. Where the
rotary scaling changes with the length (``rope_parameters`` of type ``longrope`` or ``dynamic``,
``arch.rotary``) a key depends on the length of the forward that rotated it, so the prefixes run in
groups of one rotation regime, each padded to its own longest prefix (longrope: two groups, either
side of ``original_max_position_embeddings``; dynamic: the prefixes shorter than
``max_position_embeddings``, then one per longer prefix), and each is exactly ``tp.token_patch`` of
the prefix. ``transformers`` keeps a dynamic rotation's frequencies from the longest forward since
the last one shorter than ``max_position_embeddings``: the equality holds for a prefix run on a
model in that fresh state (after a short forward), as tokenpatch's own passes run.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch.arch import adapter_for
from tokenpatch.errors import InputError
from tokenpatch.patch import Delta, Patch
from tokenpatch.patching import input_readers, provenance, recorded_patch
from tokenpatch.plans import Plan
from tokenpatch.progress import progress_bar

__all__ = ["Trajectory", "trajectory"]


@dataclass(frozen=True)
class Trajectory:
    """Patches of every context prefix of a batch of sequences.

    ``patches``: every delta with leading dims ``[batch, N + 1]``, index ``i`` = prefix ``i``;
    ``steps``: the same for the one-token-removal increments (``None`` unless asked; index 0 is
    zero). ``query``: the query's position in the inputs (``N`` context tokens precede it).
    """

    patches: Patch
    steps: Patch | None
    query: int
    meta: dict

    @property
    def n_context(self) -> int:
        return self.query

    def _prefix(self, i: Any) -> int:
        i = operator.index(i)
        if not 0 <= i <= self.query:
            raise InputError(
                f"prefix {i} does not exist: the query follows {self.query} context tokens (0..{self.query})"
            )
        return i

    def _prefix_patch(self, deltas: Patch, i: int, removed: list[int] | None) -> Patch:
        """Index ``i`` of ``deltas``, as the token patch of prefix ``i`` (``removed``: the chunk removed)."""
        plan = Plan.from_meta({"seq_len": i + 1, "query": [i], "removed": removed})
        return Patch(
            {n: _at(d, i) for n, d in deltas.items()},
            plan.positions if removed else None,
            {**self.meta, "prefix": i},
            plan=plan,
            readers=deltas.readers,
        )

    def patch(self, i: int) -> Patch:
        """The token patch of prefix ``i`` (all its context removed): a ``Patch`` ``[batch, 1]`` that
        ``verify`` / ``apply`` / ``save_patch`` take like any other, for ``prefix_inputs(inputs, i)``."""
        i = self._prefix(i)
        return self._prefix_patch(self.patches, i, None)

    def step(self, i: int) -> Patch:
        """The increment from prefix ``i - 1`` to prefix ``i``: the token patch of prefix ``i`` with
        ``c_i`` removed, acting at the query (position ``i - 1`` of the shorter sequence)."""
        if self.steps is None:
            raise InputError("this trajectory has no increments; call tp.trajectory(..., steps=True)")
        i = self._prefix(i)
        if i == 0:
            raise InputError("step(i) takes prefix i - 1 to prefix i: i starts at 1")
        return self._prefix_patch(self.steps, i, [i - 1])

    def prefix_inputs(self, inputs: Tensor, i: int) -> Tensor:
        """``inputs[:, [0..i-1] + [query]]``: the prefix-``i`` sequence ``patch(i)`` belongs to."""
        i = self._prefix(i)
        return inputs[:, list(range(i)) + [self.query]]


def _at(d: Delta, i: int) -> Delta:
    return dl.index(d, (slice(None), slice(i, i + 1)))


def _zero_first(deltas: dict[str, Delta]) -> dict[str, Delta]:
    """Prefix 0 has no context: its patch is exactly zero (the out-side factor and dense deltas)."""
    return {n: dl.zeroed_at(d, (slice(None), 0)) for n, d in deltas.items()}


def _query_position(query: Any, seq_len: int) -> int:
    try:
        if isinstance(query, bool):
            raise TypeError
        q = operator.index(query)  # ints, numpy integers, integer 0-d tensors
    except TypeError:
        raise InputError(f"trajectory takes one query position (an int), got {query!r}") from None
    if not -seq_len <= q < seq_len:
        raise InputError(f"query position {q} is outside the sequence of length {seq_len}")
    q %= seq_len
    if q == 0:
        raise InputError("the query is the first token: there is no context before it to follow")
    return q


@torch.no_grad()
def trajectory(
    model: nn.Module, inputs: Any, query: int = -1, *, steps: bool = False, progress: bool | None = None
) -> Trajectory:
    """Token patches of every context prefix at every layer, from one pass (module docstring).

    ``inputs [batch, pos, d]`` (token ids ``[batch, pos]`` for a language model, unpadded); ``query``: the
    position whose output the patches reproduce (the context is every token before it; later tokens are
    ignored). ``steps=True`` also computes the one-token-removal increments. The prefix rows come from
    ``Adapter.prefixes`` (``arch.prefixes``), their deltas from ``recorded_patch``, as ``token_patch``'s.
    Cost on our models: one forward pass over the context plus, per layer, the ``N + 1`` virtual query
    rows, whose anchors (each row alone) share their value vectors (``benchmarks/trajectory.py``).
    """
    adapter = adapter_for(model)
    inputs = adapter.check_inputs(model, inputs)
    q = _query_position(query, adapter.seq_len(inputs))
    batch, n = adapter.batch_size(inputs), q + 1
    parts: dict[int, tuple[dict, dict]] = {}  # first prefix of a chunk -> its deltas, its increments
    dtype = None
    with adapter.fixed(model):  # the module map looked up once for the whole call
        for group in _regime_groups(adapter.length_scaling(model), n):
            rows = adapter.prefixes(model, inputs, q, group, steps)
            for i, chunk, rec, anchor, step in progress_bar(rows, progress, desc="trajectory", unit="layer"):
                deltas, increments = parts.setdefault(chunk.start, ({}, {}))
                deltas.update(recorded_patch(model, adapter, i, rec, anchor, list(chunk)))
                if step is not None:  # anchored at the row read one context token earlier
                    increments.update(recorded_patch(model, adapter, i, rec, step, list(chunk)))
                dtype = rec.out.dtype
        order = sorted(parts)
        meta = provenance(model, adapter, batch, dtype)
        record = {**meta, "trajectory": {"query": q, "n_context": q}}
        readers = input_readers(model, adapter)

    def joined(k: int) -> Patch:  # the chunks' deltas along the prefix dim, prefix 0 exactly zero
        deltas = {name: _cat([parts[a][k][name] for a in order]) for name in parts[order[0]][k]}
        patch = Patch(_zero_first(deltas), None, record, readers=readers)
        return patch if patch.dtype == dtype else patch.to(dtype)  # in the model's dtype, as token_patch's

    return Trajectory(joined(0), joined(1) if steps else None, q, meta)


def _regime_groups(scaling, n: int) -> list[range]:
    """The prefixes ``0..n-1`` (lengths ``1..n``) as runs of one rotation regime, shortest first (a
    regime is a run of lengths: ``arch.rotary``); one run without a length-dependent scaling."""
    if scaling is None:
        return [range(n)]
    groups: list[range] = []
    for i in range(n):
        if groups and scaling.regime(groups[-1].start + 1) == scaling.regime(i + 1):
            groups[-1] = range(groups[-1].start, i + 1)
        else:
            groups.append(range(i, i + 1))
    return groups


def _cat(parts: list[Delta]) -> Delta:
    """The groups' deltas joined along the prefix dim."""
    if len(parts) == 1:
        return parts[0]
    return dl.cat(parts, 1)
