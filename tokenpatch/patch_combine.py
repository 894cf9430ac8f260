"""How the fields of ``Patch``es combine: one table (``FIELD_RULES``), one row per field, says what each
becomes under ``a + b``, ``patch.sum(dim)``, ``Patch.stack(patches, dim)``, ``patch[b, q]`` and ``.map``; ``Patch``
reads it (``combined``) and holds no rule of its own. The deltas combine through ``deltas.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenpatch.errors import InputError
from tokenpatch.patch_fields import folded, row_plans
from tokenpatch.plans import Plan

__all__ = ["FieldRule", "FIELD_RULES", "CARRIED", "combined", "merged_readers", "same", "common_meta", "query_plans"]


def merged_readers(patches: list) -> dict[str, tuple[tuple[str, str], ...]]:
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for p in patches:
        for key, pairs in p.readers.items():
            if out.setdefault(key, pairs) != pairs:
                raise InputError(
                    f"cannot combine patches whose input change {key} is read by different matrices: "
                    f"{out[key]} vs {pairs}"
                )
    return out


def same(values: list):
    """The common value of ``values``, or ``None`` where they differ."""
    return values[0] if all(v == values[0] for v in values) else None


def common_meta(patches: list) -> dict[str, Any]:
    """The provenance every one of ``patches`` agrees on; patches of different models raise."""
    models = [p.meta.get("model") for p in patches]
    if any(m != models[0] for m in models):
        raise InputError("cannot combine patches computed for different models (or with and without a model record)")
    first = patches[0].meta
    return {k: v for k, v in first.items() if all(k in p.meta and p.meta[k] == v for p in patches)}


def query_plans(plans: list[tuple[Plan, ...]]) -> tuple[Plan, ...]:
    """One row's plans when its patches are stacked along query (``alone`` mode, each row of one plan):
    the queries joined; ``()`` where no one plan results."""
    if any(len(p) != 1 for p in plans):
        return ()
    plans = [p[0] for p in plans]
    query = sum((list(p.query) for p in plans), [])
    if len({(p.seq_len, p.mode) for p in plans}) == 1 and plans[0].mode == "alone" and len(set(query)) == len(query):
        return (Plan(plans[0].seq_len, tuple(query)),)
    return ()


def _widened(plan: Plan, queries: int) -> Plan:
    """A one-query plan added to each of ``queries`` patches (``+`` broadcasts): its query, repeated."""
    return plan if len(plan.query) == queries else Plan(plan.seq_len, plan.query * queries, plan.mode, plan.kept)


# --------------------------------------------------------------------------- how each field combines
#
# One row per field (or pair of fields computed together): what it becomes in ``a + b`` (``add(terms,
# lead)``, ``lead`` the sum's broadcast ``[batch, query]``), ``patch.sum(dim)`` (``sum(patch, dim)``),
# ``Patch.stack(patches, dim)`` (``stack(patches, dim)``) and ``patch[b, q]`` (``index(patch, key)``, ``key``
# two slices), and ``patch.map(fn)`` (``map(patch, lead)``). Each returns ``{field: value}``, or raises
# ``InputError`` where the patches cannot combine. ``Patch`` reads this table (``combined``) for every field
# but its deltas; a new field is one row here.


def _sum_plans(patches: list, lead: tuple[int, int]) -> dict[str, Any]:
    """Each row of a sum made for every plan its terms were made for (terms broadcast to ``lead``)."""
    batch = lead[0]
    rows = [tuple(tuple(_widened(p, lead[1]) for p in r) for r in row_plans(p)) for p in patches]
    rows = [r * batch if len(r) == 1 and batch > 1 else r for r in rows]
    plan, plans = folded(tuple(sum((r[b] for r in rows), ()) for b in range(batch)))
    return {"plan": plan, "plans": plans}


def _sum_tokens(patches: list, lead: tuple[int, int]) -> dict[str, Any]:
    """The token fingerprints where every term agrees (0, unchecked, elsewhere; none if a term has none)."""
    return _agreed([p.tokens for p in patches], lead)


def _agreed(tokens: list, lead: tuple[int, int]) -> dict[str, Any]:
    if any(t is None for t in tokens):
        return {"tokens": None}
    tokens = [t.expand(lead) for t in tokens]
    kept = tokens[0].clone()
    for t in tokens[1:]:
        kept = torch.where(kept == t, kept, torch.zeros((), dtype=kept.dtype))
    return {"tokens": kept}


def _sum_plans_over_batch(patch) -> dict[str, Any]:
    """The one row of ``patch.sum("batch")``: made for every plan some row was made for."""
    plan, plans = folded((sum(row_plans(patch), ()),))
    return {"plan": plan, "plans": plans}


def _sum_tokens_over_batch(patch) -> dict[str, Any]:
    """The one row of ``patch.sum("batch")``: the fingerprints every row agrees on."""
    rows = None if patch.tokens is None else list(patch.tokens.split(1))
    return _agreed(rows or [None], (1, patch.lead[1]))


def _stack_plans(patches: list, dim: str) -> dict[str, Any]:
    if dim == "batch":
        plan, plans = folded(sum((row_plans(p) for p in patches), ()))
    else:
        per_row = [row_plans(p) for p in patches]
        plan, plans = folded(tuple(query_plans([r[b] for r in per_row]) for b in range(patches[0].lead[0])))
    return {"plan": plan, "plans": plans}


def _stack_tokens(patches: list, dim: str) -> dict[str, Any]:
    tokens = [p.tokens for p in patches]
    if all(t is None for t in tokens):
        return {"tokens": None}
    i = ("batch", "query").index(dim)  # a patch without fingerprints: its entries are unchecked (0)
    return {
        "tokens": torch.cat(
            [torch.zeros(p.lead, dtype=torch.int64) if t is None else t for p, t in zip(patches, tokens)], i
        )
    }


def _index_plans(patch, key: tuple[slice, slice]) -> dict[str, Any]:
    plans = tuple(tuple(Plan(p.seq_len, p.query[key[1]], p.mode, p.kept) for p in r) for r in row_plans(patch))
    plan, plans = folded(plans[key[0]])
    return {"plan": plan, "plans": plans}


def _map_plans(patch, lead: tuple[int, int]) -> dict[str, Any]:
    """The plan where it still has the queries, the per-row plans where they still have the rows."""
    plan = patch.plan if patch.plan is not None and len(patch.plan.query) == lead[1] else None
    return {"plan": plan, "plans": patch.plans if len(patch.plans) == lead[0] and plan is None else ()}


def _add_positions(patches: list, lead) -> dict[str, Any]:
    a, b = (p.positions for p in patches)
    if a != b:
        raise InputError(f"cannot add patches acting at different positions: {a} vs {b}")
    return {"positions": a}


def _stack_positions(patches: list, dim: str) -> dict[str, Any]:
    if dim == "query":
        if any(p.acts == "at_positions" for p in patches):
            raise InputError(
                "patches acting at given positions (a chunk removed) act together and cannot be stacked "
                "along query; compute all the queries in one token_patch call"
            )
        return {"positions": ()}
    if any(p.positions != patches[0].positions for p in patches):
        raise InputError("Patch.stack along batch needs patches acting at the same positions")
    return {"positions": patches[0].positions}


def _index_positions(patch, key: tuple[slice, slice]) -> dict[str, Any]:
    """Queries acting together (a chunk removed): a subset keeps every query up to some position."""
    if patch.acts == "at_positions":
        chosen = set(patch.positions[key[1]])
        if chosen != {p for p in patch.positions if p <= max(chosen)}:
            raise InputError(
                f"these patches act together (a chunk was removed; each query's patch assumes the patches of the "
                f"queries before it), so a subset must keep every query up to its last position; "
                f"{sorted(chosen)} of {sorted(patch.positions)} does not. Read one query's factors with "
                f"patch[name].u[:, q], or compute it alone with token_patch(..., query=q)"
            )
    return {"positions": patch.positions[key[1]]}


def _stack_rows(patches: list, dim: str) -> dict[str, Any]:
    rows = [p.rows for p in patches]
    if dim == "batch":
        return {"rows": sum(rows, ()) if None not in rows else None}
    return {"rows": same(rows)}


def _sum_meta(patch, dim: str) -> dict[str, Any]:
    terms = patch.terms * patch.lead[("batch", "query").index(dim)]
    return {"meta": {**patch.meta, "summed_over": dim, "terms": terms}}


@dataclass(frozen=True)
class FieldRule:
    """How ``fields`` of a ``Patch`` combine: ``add``, ``sum``, ``stack``, ``index`` (table above); ``map``:
    what still fits where ``Patch.map``'s function gave the deltas other leading dims ``lead``."""

    fields: tuple[str, ...]
    add: Callable[[list, tuple[int, int]], dict[str, Any]]
    sum: Callable[[Any, str], dict[str, Any]]
    stack: Callable[[list, str], dict[str, Any]]
    index: Callable[[Any, tuple[slice, slice]], dict[str, Any]]
    map: Callable[[Any, tuple[int, int]], dict[str, Any]]  # ``patch.map(fn)`` to leading dims ``lead``


def _kept(field: str) -> Callable[..., dict[str, Any]]:
    """The field as it is (one patch's, or the first's)."""
    return lambda p, _: {field: getattr(p[0] if isinstance(p, list) else p, field)}


FIELD_RULES: tuple[FieldRule, ...] = (
    # where it acts: the same positions; a query sum or a query stack acts everywhere
    FieldRule(
        ("positions",),
        add=_add_positions,
        sum=lambda p, dim: {"positions": () if dim == "query" else p.positions},
        stack=_stack_positions,
        index=_index_positions,
        map=_kept("positions"),
    ),
    # the plans each row was made for: a sum's rows made for all its terms', none once summed over queries
    FieldRule(
        ("plan", "plans"),
        add=_sum_plans,
        sum=lambda p, dim: {"plan": None, "plans": ()} if dim == "query" else _sum_plans_over_batch(p),
        stack=_stack_plans,
        index=_index_plans,
        map=_map_plans,
    ),
    # token fingerprints: kept where the terms agree, joined by a stack, none once summed over queries
    FieldRule(
        ("tokens",),
        add=_sum_tokens,
        sum=lambda p, dim: {"tokens": None} if dim == "query" else _sum_tokens_over_batch(p),
        stack=_stack_tokens,
        index=lambda p, key: {"tokens": None if p.tokens is None else p.tokens[key]},
        map=lambda p, lead: {"tokens": p.tokens if p.tokens is not None and tuple(p.tokens.shape) == lead else None},
    ),
    # the tokens every sequence must begin with: kept where all agree
    FieldRule(
        ("prefix",),
        add=lambda ps, _: {"prefix": same([p.prefix for p in ps]) or ()},
        sum=_kept("prefix"),
        stack=lambda ps, _: {"prefix": same([p.prefix for p in ps]) or ()},
        index=_kept("prefix"),
        map=_kept("prefix"),
    ),
    # one update for any input: only if every term is
    FieldRule(
        ("static",),
        add=lambda ps, _: {"static": all(p.static for p in ps)},
        sum=_kept("static"),
        stack=lambda ps, _: {"static": all(p.static for p in ps)},
        index=_kept("static"),
        map=_kept("static"),
    ),
    # the matrices reading each input change: merged, the same where two name one input
    FieldRule(
        ("readers",),
        add=lambda ps, _: {"readers": merged_readers(ps)},
        sum=_kept("readers"),
        stack=lambda ps, _: {"readers": merged_readers(ps)},
        index=_kept("readers"),
        map=_kept("readers"),
    ),
    # the source rows: shared by a sum, none once summed over the batch, joined by a batch stack
    FieldRule(
        ("rows",),
        add=lambda ps, _: {"rows": same([p.rows for p in ps])},
        sum=lambda p, dim: {"rows": None if dim == "batch" else p.rows},
        stack=_stack_rows,
        index=lambda p, key: {"rows": (p.rows or tuple(range(p.lead[0])))[key[0]]},
        map=lambda p, lead: {"rows": p.rows if p.rows is not None and len(p.rows) == lead[0] else None},
    ),
    # provenance: what the terms agree on (patches of different models raise), and how many token patches
    FieldRule(
        ("meta",),
        add=lambda ps, _: {"meta": {**common_meta(ps), "terms": sum(p.terms for p in ps)}},
        sum=_sum_meta,
        stack=lambda ps, _: {"meta": common_meta(ps)},
        index=_kept("meta"),
        map=_kept("meta"),
    ),
)
CARRIED = tuple(f for rule in FIELD_RULES for f in rule.fields if f not in ("positions", "meta"))


def combined(op: str, *args) -> dict[str, Any]:
    """Every field of the patch ``op`` (``"add"``, ``"sum"``, ``"stack"``, ``"index"``, ``"map"``) makes of ``args``,
    read from ``FIELD_RULES``: keyword arguments of ``Patch``."""
    out: dict[str, Any] = {}
    for rule in FIELD_RULES:
        out.update(getattr(rule, op)(*args))
    return out
