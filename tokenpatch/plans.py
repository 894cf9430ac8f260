"""Query plans: which positions are queries, and which context the no-context pass drops.

Two modes, named, never encoded as ``None``:

* ``"alone"`` (``remove=None``, the default): all context before each query is removed, so each
  query is a no-context sequence of its own, of length 1. The no-context inputs are
  ``[batch * query, 1, ...]``, batch-major: sequence ``b * Q + q`` belongs to patch ``[b, q]``.
* ``"chunk"`` (``remove`` = a slice, indices or a boolean mask): the chunk ``Y`` is removed and the rest,
  ``C \\ Y``, is one shorter sequence per batch row, ``[batch, len(C \\ Y), ...]``; patch
  ``[b, q]`` acts at the query's position in it.

See ``docs/deep-models.md`` for why these two no-context passes are the ones the patch reproduces.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from tokenpatch.errors import InputError

__all__ = ["Plan", "make_plan", "Mode", "refuse_padded_queries", "token_ids", "token_digests", "made_on"]

Mode = Literal["alone", "chunk"]


@dataclass(frozen=True)
class Plan:
    """Queries and removed context for sequences of ``seq_len`` positions.

    ``query``: with-context positions whose outputs the patch reproduces, in patch order.
    ``mode``: ``"alone"`` (each query keeps only itself) or ``"chunk"`` (a chunk is removed).
    ``kept``: positions of ``C \\ Y`` in chunk mode; empty in alone mode.
    """

    seq_len: int
    query: tuple[int, ...]
    mode: Mode = "alone"
    kept: tuple[int, ...] = ()

    @property
    def positions(self) -> tuple[int, ...]:
        """Query positions in the no-context sequence: all 0 in alone mode (each query is a
        length-1 sequence), their index in ``C \\ Y`` in chunk mode."""
        if self.mode == "alone":
            return (0,) * len(self.query)
        where = {p: i for i, p in enumerate(self.kept)}
        return tuple(where[q] for q in self.query)

    @property
    def stripped_len(self) -> int:
        """Length of each no-context sequence."""
        return 1 if self.mode == "alone" else len(self.kept)

    def describe(self) -> dict:
        """JSON-able record kept in a patch's metadata (``from_meta`` reads it back)."""
        removed = None if self.mode == "alone" else sorted(set(range(self.seq_len)) - set(self.kept))
        return {"seq_len": self.seq_len, "query": list(self.query), "removed": removed}

    @classmethod
    def from_meta(cls, meta: dict) -> Plan:
        removed = meta.get("removed")
        if removed is None:
            return cls(meta["seq_len"], tuple(meta["query"]))
        gone = set(removed)
        return cls(
            meta["seq_len"], tuple(meta["query"]), "chunk", tuple(p for p in range(meta["seq_len"]) if p not in gone)
        )


def _as_int(q: Any, what: str = "query positions") -> int:
    if not isinstance(q, bool) and not (isinstance(q, Tensor) and q.dtype == torch.bool):
        try:
            return operator.index(q)  # ints, numpy integers, integer 0-d tensors
        except TypeError:
            pass
    raise InputError(f"{what} must be integers, got {q!r}")


def _indices(seq_len: int, values: Any, one: str, many: str) -> list[int]:
    """``values`` (an int, ints, a tensor or array of ints) as distinct positions in ``[0, seq_len)``,
    negative ones counted from the end; ``one`` / ``many`` name them in the one-line errors."""
    if hasattr(values, "tolist"):  # tensors and arrays
        values = values.tolist()
    listed = isinstance(values, (list, tuple, range))
    positions = [_as_int(q, many) for q in values] if listed else [_as_int(values, many)]
    for q in positions:
        if not -seq_len <= q < seq_len:
            raise InputError(f"{one} {q} is outside the sequence of length {seq_len}")
    out = [q % seq_len for q in positions]
    if len(set(out)) != len(out):
        raise InputError(f"{many} repeat: {out}")
    return out


def _is_mask(remove: Any) -> bool:
    """Whether ``remove`` is a boolean mask (a bool tensor or array, or a list of bools), not indices."""
    if hasattr(remove, "dtype"):
        return str(remove.dtype) in ("torch.bool", "bool")
    return isinstance(remove, (list, tuple)) and bool(remove) and all(isinstance(r, bool) for r in remove)


def _removed_mask(seq_len: int, remove: Any) -> list[bool]:
    """``remove`` (a slice, indices, or a boolean mask ``[seq_len]``) as a list of bools."""
    if isinstance(remove, slice):
        chosen = set(range(seq_len)[remove])
    elif _is_mask(remove):
        mask = torch.as_tensor(remove)
        if mask.shape != (seq_len,):
            raise InputError(f"remove mask has shape {tuple(mask.shape)}; the sequence has {seq_len} positions")
        chosen = {p for p, r in enumerate(mask.tolist()) if r}
    else:
        chosen = set(_indices(seq_len, remove, "remove index", "remove indices"))
    removed = [p in chosen for p in range(seq_len)]
    if not any(removed):
        raise InputError(f"the removed chunk {remove!r} is empty: there is no context to turn into a patch")
    if all(removed):
        raise InputError("remove covers every position, the query included")
    return removed


def _query_positions(seq_len: int, query: Any, candidates: list[int]) -> list[int]:
    """``query`` (an int, ints, a slice or ``"all"`` = every candidate) as positions in ``[0, seq_len)``."""
    if isinstance(query, str):
        if query != "all":
            raise InputError(f"query must be an int, a list of ints, a slice or 'all', got {query!r}")
        positions = candidates
    elif isinstance(query, slice):
        positions = list(range(seq_len))[query]
    else:
        positions = query
    out = _indices(seq_len, positions, "query position", "query positions")
    if not out:
        raise InputError(f"query {query!r} selects no position of a sequence of length {seq_len}")
    return out


def make_plan(seq_len: int, query: Any = -1, remove: Any = None) -> Plan:
    """Normalise ``query`` and ``remove`` (see ``token_patch``) into a ``Plan``; clear errors."""
    if remove is None:
        return Plan(seq_len, tuple(_query_positions(seq_len, query, list(range(seq_len)))))
    removed = _removed_mask(seq_len, remove)
    kept = [p for p in range(seq_len) if not removed[p]]
    query = _query_positions(seq_len, query, kept)
    inside = [q for q in query if removed[q]]
    if inside:
        raise InputError(f"query positions {inside} lie inside the removed chunk")
    return Plan(seq_len, tuple(query), "chunk", tuple(kept))


def refuse_padded_queries(pad: Tensor | None, query) -> None:
    """The one refusal of padding at a query, whatever the mode: ``pad`` ``[batch, pos]`` is True at
    padding (``Adapter.padding``; ``None``: no padding), ``query`` the query positions. A right-padded
    row's last position is padding; left padding keeps it a token, with the row's own positions."""
    if pad is None:
        return
    rows = sorted({int(b) for b in pad[:, list(query)].nonzero()[:, 0]})
    if rows:
        raise InputError(
            f"a query position is padding in batch rows {rows[:5]}: pad on the left "
            "(tokenizer.padding_side = 'left') so the last position is a token in every row"
        )


def strip(adapter, inputs: Any, plan: Plan) -> Any:
    """The no-context inputs of ``plan``: ``[batch * query, 1, ...]`` (alone) or
    ``[batch, len(C \\ Y), ...]`` (chunk)."""
    if plan.mode == "alone":
        return adapter.strip(inputs, torch.tensor(plan.query), separate=True)
    return adapter.strip(inputs, torch.tensor(plan.kept), separate=False)


def at_queries(t: Tensor, plan: Plan, batch: int) -> Tensor:
    """A no-context tensor ``t`` (as ``strip`` lays it out) -> its values at the queries, ``[batch, query, ...]``."""
    if plan.mode == "alone":
        return t.reshape(batch, len(plan.query), *t.shape[2:])  # each query was its own sequence
    return t[:, list(plan.positions)]


# --------------------------------------------------------------------------- the tokens a patch was made for
#
# A token patch is exact on the no-context inputs of the sequence it came from, and on no other: it
# records a fingerprint of each no-context sequence's token ids (``Patch.tokens``) and ``functional_call``
# compares the inputs it is given. A fingerprint is the first 8 bytes of blake2b over the row's int64 ids,
# never 0 (0 marks an entry left unchecked: a sum of patches of different tokens keeps only the agreeing).


def token_ids(inputs: Any) -> Tensor | None:
    """The token ids ``[batch, pos]`` of a forward's inputs (an integer tensor, or a mapping's
    ``input_ids``); ``None`` for inputs of another kind (embeddings)."""
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if isinstance(ids, Tensor) and ids.ndim == 2 and not ids.dtype.is_floating_point and ids.dtype != torch.bool:
        return ids
    return None


def token_digests(ids: Tensor) -> Tensor:
    """One fingerprint per row of ``ids [N, T]``, int64 ``[N]`` (never 0)."""
    rows = ids.detach().to("cpu", torch.int64).contiguous().numpy()
    out = [int.from_bytes(hashlib.blake2b(r.tobytes(), digest_size=8).digest(), "little", signed=True) for r in rows]
    return torch.tensor([d or 1 for d in out], dtype=torch.int64)


def made_on(adapter, inputs: Any, plan: Plan, batch: int) -> Tensor | None:
    """``Patch.tokens`` of the token patch of ``plan`` on ``inputs``: per ``[b, q]`` the fingerprint of
    the no-context sequence it runs on (``strip``); ``None`` where the inputs are not token ids."""
    ids = token_ids(strip(adapter, inputs, plan))
    if ids is None:
        return None
    digests = token_digests(ids)
    if plan.mode == "alone":  # sequence b * Q + q is patch [b, q]'s
        return digests.reshape(batch, len(plan.query))
    return digests[:, None].expand(batch, len(plan.query)).clone()  # every query of row b runs on its one sequence
