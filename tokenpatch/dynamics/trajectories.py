"""Implicit learning dynamics: the token patches of every context prefix, in one pass.

For a sequence whose query ``x`` (at position ``query``) follows context tokens ``c_1..c_N``,
*prefix i* is the sequence ``[c_1..c_i, x]`` (``docs/dynamics.md``). Two updates per prefix:

* ``traj.patch(i)``: the token patch of prefix ``i`` with all of its context removed (the fixed
  anchor of *Learning without training*: the query alone). Equal to
  ``tp.token_patch(model, inputs[:, [0..i-1] + [query]])``; ``i = 0`` is the zero patch.
* ``traj.step(i)``, ``i >= 1``: the one-token-removal increment that takes prefix ``i - 1`` to
  prefix ``i``, anchored at the prefix-``(i-1)`` state: ``tp.token_patch`` of prefix ``i`` with
  the token ``c_i`` removed (``remove=[i - 1]``), acting at the query.

One pass gives them all. By causality the context tokens' hidden states at every layer are those
of the full pass whatever the prefix; only the query's state differs. So each layer runs the
context once and ``N + 1`` *virtual query rows*, row ``i`` reading ``c_1..c_i`` and itself
(``Adapter.mix_prefixes``): attention reuses the context's keys and values, a recurrent layer
steps once from its state after ``c_i``. No per-prefix forward pass, no dense matrix.

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
from tokenpatch import files
from tokenpatch.arch import adapter_for
from tokenpatch.arch.rotary import forget_longest
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch import Delta, Patch
from tokenpatch.patching import layer_patch, token_patch
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

    ``inputs [batch, pos, d]``; ``query``: the position whose output the patches reproduce (the
    context is every token before it; later tokens are ignored). ``steps=True`` also computes the
    one-token-removal increments. Cost: one forward pass over the context plus, per layer, the
    ``N + 1`` virtual query rows, whose anchors (each row alone) share their value vectors
    (``benchmarks/trajectory.py``).
    """
    adapter = adapter_for(model)
    inputs = adapter.check_inputs(model, inputs)
    if adapter.traced:
        return _traced_trajectory(model, adapter, inputs, query, steps, progress)
    if adapter.position_dependent_embedding:
        raise UnsupportedModelError(
            f"tp.trajectory needs position-free embeddings; the {adapter.name} adapter has position-dependent ones"
        )
    q = _query_position(query, adapter.seq_len(inputs))
    h = adapter.embed(model, inputs)  # [B, T, d]
    batch, _, width = h.shape
    ctx = h[:, :q]  # [B, N, d]  the context, layer by layer (full pass)
    rows = h[:, q : q + 1].expand(batch, q + 1, width)  # [B, N+1, d]  the query after each prefix
    lengths = torch.arange(q + 1)  # row i reads c_1..c_i
    deltas: dict[str, Delta] = {}
    increments: dict[str, Delta] = {}
    labels = list(range(q + 1))
    for i in progress_bar(range(adapter.n_layers(model)), progress, desc="trajectory", unit="layer"):
        (m_c, s_c), anchor = adapter.mix_prefixes(model, i, ctx, rows, lengths, with_alone=True)  # [B, N+1, d]
        hidden_c, out_rows = adapter.finish(model, i, m_c, s_c)
        sites = adapter.sites(model, i)
        deltas.update(layer_patch(model, sites, (m_c, s_c, hidden_c), anchor, i, labels))
        if steps:  # anchor: the same row with c_i removed, i.e. read after c_1..c_{i-1}
            m_1, s_1 = adapter.mix_prefixes(model, i, ctx, rows[:, 1:], lengths[1:] - 1)  # [B, N, d]
            step = layer_patch(model, sites, (m_c[:, 1:], s_c[:, 1:], hidden_c[:, 1:]), (m_1, s_1), i, labels[1:])
            increments.update({n: _pad_first(d) for n, d in step.items()})
        if i + 1 < adapter.n_layers(model):
            ctx = adapter.finish(model, i, *adapter.mix(model, i, ctx))[1]
        rows = out_rows
    meta = {
        "model": {**adapter.describe(model), "fingerprint": files.fingerprint(model)},
        "batch": batch,
        "model_dtype": str(h.dtype).removeprefix("torch."),
    }
    record = {**meta, "trajectory": {"query": q, "n_context": q}}
    return Trajectory(
        Patch(_zero_first(deltas), None, record), Patch(increments, None, record) if steps else None, q, meta
    )


def _pad_first(d: Delta) -> Delta:
    """Prepend an exact zero at index 0 of the prefix dim (no step reaches prefix 0)."""
    return dl.cat([dl.zeros(dl.index(d, (slice(None), slice(None, 1)))), d], 1)


def _traced_trajectory(
    model: nn.Module, adapter, inputs: dict, query: Any, steps: bool, progress, chunk: int = 64
) -> Trajectory:
    """``trajectory`` for a language model: prefix ``i`` is the sequence ``[c_1..c_i, x]`` with the query
    at position ``i``, run by the model's own forward as one row of a left-padded batch (``chunk`` rows
    per forward pass), and patched by ``token_patch``. The increments (``steps``) are ``token_patch`` of
    the same rows with ``c_i``, the token right before the query in every row, removed.

    A forward's rotation can depend on its length (``Adapter.length_scaling``: longrope, dynamic): a
    batch of rows then rotates every row as its longest one. So the prefixes run in groups of one
    rotation ``regime``, each group padded to its own longest prefix (``_regime_groups``): every row is
    rotated as it would be alone. Without such a scaling there is one group, all ``N + 1`` prefixes."""
    if inputs["attention_mask"] is not None:
        raise InputError("tp.trajectory on a language model takes unpadded sequences (no attention mask)")
    ids = inputs["input_ids"]  # [B, T]
    q = _query_position(query, ids.shape[1])
    batch, n = ids.shape[0], q + 1
    scaling = adapter.length_scaling(model)
    bar = progress_bar(_regime_groups(scaling, n), progress, desc="trajectory", unit="group")
    parts = [_group_patches(model, ids, q, group, steps, chunk, scaling) for group in bar]
    deltas = {k: _cat([p[0][k] for p in parts]) for k in parts[0][0]}  # [B, n] each
    flat = parts[0][2]
    meta = {
        "model": {**adapter.describe(model), "fingerprint": files.fingerprint(model)},
        "batch": batch,
        "model_dtype": str(flat.dtype).removeprefix("torch."),
    }
    record = {**meta, "trajectory": {"query": q, "n_context": q}}
    increments = None
    if steps:
        increments = Patch(
            _zero_first({k: _cat([p[1][k] for p in parts]) for k in parts[0][1]}), None, record, readers=flat.readers
        )
    return Trajectory(Patch(_zero_first(deltas), None, record, readers=flat.readers), increments, q, meta)


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


def _group_patches(model: nn.Module, ids: Tensor, q: int, group: range, steps: bool, chunk: int, scaling):
    """The patches of the prefixes ``group`` (and, with ``steps``, their increments), leads ``[B, len(group)]``,
    from rows padded on the left to the group's longest prefix; and one flat ``Patch`` (its readers)."""
    batch, width = ids.shape[0], group.stop  # prefix i has i + 1 tokens
    rows = ids[:, q : q + 1, None].expand(batch, len(group), width).clone()  # padding: the query token, masked
    mask = torch.zeros_like(rows)
    for j, i in enumerate(group):  # row j: c_1..c_i, then x, right-aligned
        rows[:, j, width - 1 - i : width - 1] = ids[:, :i]
        mask[:, j, width - 1 - i :] = 1
    rows, mask = rows.reshape(-1, width), mask.reshape(-1, width)

    def patches(remove):
        forget_longest(
            model, scaling, ids.device
        )  # a "dynamic" rotation: start from a fresh model's, as each prefix alone
        parts = [
            token_patch(
                model,
                {"input_ids": rows[a : a + chunk], "attention_mask": mask[a : a + chunk]},
                remove=remove,
                progress=False,
            )
            for a in range(0, len(rows), chunk)
        ]
        flat = Patch.stack(parts, "batch") if len(parts) > 1 else parts[0]  # [B * G, 1]
        return {name: _unflat(d, batch) for name, d in flat.items()}, flat

    deltas, flat = patches(None)
    increments = {}
    if steps and width > 1:  # c_i sits right before the query in every row (prefix 0: a masked pad; its step is 0)
        removed = torch.zeros(width, dtype=torch.bool)
        removed[width - 2] = True
        increments = patches(removed)[0]
    elif steps:  # prefix 0 alone (its own regime): no token to remove, a zero step
        increments = _zero_first(deltas)
    return deltas, increments, flat


def _unflat(d: Delta, batch: int) -> Delta:
    """``[B * G, 1, ...]`` -> ``[B, G, ...]``."""
    return dl.map_tensors(d, lambda t: t.reshape(batch, -1, *t.shape[2:]))


def _cat(parts: list[Delta]) -> Delta:
    """The groups' deltas joined along the prefix dim."""
    if len(parts) == 1:
        return parts[0]
    return dl.cat(parts, 1)
