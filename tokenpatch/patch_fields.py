"""What the fields of a ``Patch`` need beyond the class: the 0.2 metadata they replace, and how the
fields of several patches combine (``+``, ``Patch.stack``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenpatch.errors import InputError
from tokenpatch.plans import Plan

__all__ = [
    "INPUT_SUFFIX",
    "Readers",
    "BEHAVIOUR_KEYS",
    "split_behaviour",
    "checked_readers",
    "merged_readers",
    "same",
    "common_meta",
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
