"""The fields of a ``Patch`` (everything but its deltas): their checks, the 0.2 metadata they replace, the
per-row plans of combined patches, and the check against a model (``Patch.check_model``). How the fields
combine under ``+``, ``.sum``, ``Patch.stack`` and indexing: ``patch_combine.FIELD_RULES``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tokenpatch import deltas as dl
from tokenpatch import files
from tokenpatch.errors import InputError
from tokenpatch.plans import Plan

__all__ = [
    "INPUT_SUFFIX",
    "Readers",
    "BEHAVIOUR_KEYS",
    "split_behaviour",
    "checked_readers",
    "RowPlans",
    "row_plans",
    "folded",
    "check_plan",
    "check_plans",
    "check_tokens",
    "check_against_model",
]

# A key ``"<module>:input"`` holds a change of that module's input (``Patch`` docstring).
INPUT_SUFFIX = ":input"
# "<module>:input" -> ((parameter name, layout), ...): the matrices that read that input
Readers = Mapping[str, tuple[tuple[str, str], ...]]
# Metadata keys that carried behaviour in tokenpatch 0.2 (now fields; read from old records once)
BEHAVIOUR_KEYS = ("seq_len", "query", "removed", "static", "inputs", "batch_index")


def split_behaviour(meta: dict) -> tuple[dict, dict]:
    """A 0.2-style ``meta`` -> ``(provenance, fields)``: the behaviour keys become ``Patch`` fields
    (``plan``, ``static``, ``readers``, ``rows``), the rest stays provenance."""
    meta = dict(meta)
    fields: dict[str, Any] = {}
    if "query" in meta and "seq_len" in meta:
        fields["plan"] = Plan.from_meta(meta)
    for key in ("seq_len", "query", "removed"):
        meta.pop(key, None)
    if meta.pop("static", False):
        fields["static"] = True
    if "inputs" in meta:
        fields["readers"] = meta.pop("inputs")
    if "batch_index" in meta:
        fields["rows"] = meta.pop("batch_index")
    return meta, fields


def checked_readers(readers: Readers | None) -> dict[str, tuple[tuple[str, str], ...]]:
    out = {}
    for key, pairs in (readers or {}).items():
        pairs = tuple((str(name), str(layout)) for name, layout in pairs)
        if not key.endswith(INPUT_SUFFIX) or any(layout not in ("out_in", "in_out") for _, layout in pairs):
            raise InputError(
                f"readers maps '<module>{INPUT_SUFFIX}' keys to (parameter, 'out_in' | 'in_out') pairs; "
                f"got {key!r}: {pairs}"
            )
        out[key] = pairs
    return out


# --------------------------------------------------------------------------- plans of combined patches
#
# A patch's rows can be made for different plans (``Patch.stack`` of patches of different queries),
# or one row for several (``a + b`` of two such patches: a patch of no single input). ``Patch.plan`` is
# the plan of every row where there is one; otherwise ``Patch.plans`` holds, per batch row, the plans
# that row was made for (empty: none known), and the position checks take every one of them.

RowPlans = tuple[tuple[Plan, ...], ...]


def row_plans(patch) -> RowPlans:
    """Per batch row, the plans that row of ``patch`` was made for."""
    if patch.plans:
        return patch.plans
    return ((patch.plan,) if patch.plan is not None else (),) * patch.lead[0]


def folded(rows: RowPlans) -> tuple[Plan | None, RowPlans]:
    """``(plan, plans)`` fields of per-row plans: one plan when every row has that one, else the rows."""
    rows = tuple(tuple(dict.fromkeys(r)) for r in rows)  # each row's plans, once each, in order
    if rows and all(r == rows[0] and len(r) == 1 for r in rows):
        return rows[0][0], ()
    return None, (() if all(not r for r in rows) else rows)


def check_plans(plans: RowPlans, lead: tuple[int, int], positions: tuple[int, ...]) -> RowPlans:
    """``plans`` as given to ``Patch``: one tuple of plans per batch row, each of the patch's queries
    and positions (``check_plan``)."""
    plans = tuple(tuple(r) for r in plans)
    if plans and len(plans) != lead[0]:
        raise InputError(f"plans name {len(plans)} rows; the patch has {lead[0]}")
    for r in plans:
        for plan in r:
            check_plan(plan, lead, positions)
    return plans


def check_plan(plan: Plan, lead: tuple[int, int], positions: tuple[int, ...]) -> None:
    if len(plan.query) != lead[1]:
        raise InputError(f"plan {plan.describe()} has {len(plan.query)} queries, the patch {lead[1]}")
    if positions != (plan.positions if plan.mode == "chunk" else ()):
        raise InputError(f"plan {plan.describe()} does not act at positions {list(positions)}")


def check_tokens(tokens, lead: tuple[int, int]):
    """``tokens``: ``None``, or the token fingerprints ``[batch, query]`` (int64; 0: unchecked)."""
    if tokens is None:
        return None
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    if tuple(tokens.shape) != tuple(lead):
        raise InputError(f"tokens fingerprints have shape {tuple(tokens.shape)}, the patch {list(lead)}")
    return tokens


def check_against_model(patch, model: nn.Module, cached: bool = True) -> None:
    """``Patch.check_model``: every key names a parameter (or a module input read by its ``readers``)
    of ``model`` of the right shape, and the weights and config are the recorded ones."""
    digest, config = files.fingerprint(model, cached), patch.meta.get("model", {}).get("config")
    seen = patch.__dict__.get("_checked")
    if cached and seen is not None and seen[0]() is model and seen[1] == digest:
        return files.check_config(model, config)  # every time: an edited config leaves no trace
    params = dict(model.named_parameters())
    for name, d in patch.items():
        if name.endswith(INPUT_SUFFIX):  # a change of a module's input: the module exists, its readers fit
            module = name[: -len(INPUT_SUFFIX)]
            try:
                model.get_submodule(module)
            except AttributeError:
                raise InputError(
                    f"patch names the input of {module!r}, which is not a module of {type(model).__name__}"
                ) from None
            if name not in patch.readers:
                raise InputError(f"patch input change {name} names no matrices that read it (Patch.readers)")
            for reader, layout in patch.readers[name]:
                width = None if reader not in params else params[reader].shape[-1 if layout == "out_in" else -2]
                if width is None or not dl.is_lowrank(d) or d.shape != (width, width):
                    raise InputError(
                        f"patch input change {name} ({d.shape if dl.is_lowrank(d) else 'dense'}) "
                        f"does not fit {reader} of this model"
                    )
            continue
        if name not in params:
            raise InputError(f"patch names {name!r}, which is not a parameter of {type(model).__name__}")
        shape = tuple(params[name].shape)
        got, shape = dl.shape(d), dl.shape_for(d, shape)  # stacked experts: one matrix
        if got != shape:
            raise InputError(f"patch delta for {name} has shape {got}, the parameter is {shape}")
    want = patch.meta.get("model", {}).get("fingerprint")
    if want is not None and want != digest:
        raise InputError(
            f"this patch was computed for another model (fingerprint {want}, this model "
            f"{digest}); a token patch is exact only for the weights it came from"
        )
    files.check_config(model, config)
    patch._checked = (weakref.ref(model), digest)
