"""Patch files: ``save_patch`` / ``load_patch``.

safetensors (``name.u``, ``name.v`` or ``name``) with a JSON document: the delta kinds, the
``Patch`` fields (``positions``, ``plan``, ``plans``, ``static``, ``readers``, ``rows``, ``tokens``,
``prefix``), ``meta`` and a checksum (``files.write_file``). No pickle. Files written by tokenpatch 0.2, whose behaviour sat in
``meta``, load with it read into the fields.
"""

from __future__ import annotations

import os

from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch import files
from tokenpatch.errors import FileFormatError, InputError
from tokenpatch.patch import Delta, Patch, split_behaviour
from tokenpatch.plans import Plan

__all__ = ["save_patch", "load_patch", "PATCH_FORMAT"]

PATCH_FORMAT = "tokenpatch.patch/1"


def _keys(name: str, kind: str) -> tuple[str, ...]:
    """The file's tensor names of one delta: ``name.u``, ``name.v`` (low-rank) or ``name`` (dense)."""
    return (f"{name}.u", f"{name}.v") if kind == "lowrank" else (name,)


def save_patch(patch: Patch, path: str | os.PathLike) -> None:
    """Write ``patch`` to ``path``: safetensors, ``name.u``/``name.v`` or ``name``, its fields and meta.
    A patch holding NaN or inf is refused (``Patch.check_finite``)."""
    patch.check_finite()
    tensors: dict[str, Tensor] = {}
    for name, d in patch.items():
        parts = dl.tensors(d)
        tensors.update(zip(_keys(name, dl.kind(d)), parts))
    kinds = {n: dl.kind(d) for n, d in patch.items()}
    doc = {
        "kinds": kinds,
        "positions": list(patch.positions) or None,
        "meta": patch.meta,
        "plan": None if patch.plan is None else patch.plan.describe(),
        "static": patch.static,
        "readers": {k: [list(pair) for pair in v] for k, v in patch.readers.items()},
        "rows": None if patch.rows is None else list(patch.rows),
        "plans": [[p.describe() for p in r] for r in patch.plans] or None,
        "tokens": None if patch.tokens is None else patch.tokens.tolist(),
        "prefix": list(patch.prefix) or None,
    }
    files.write_file(path, tensors, PATCH_FORMAT, doc)


def load_patch(path: str | os.PathLike, model: nn.Module | None = None) -> Patch:
    """Read a patch written by ``save_patch``. With ``model``, also check it belongs to that model.
    A file holding NaN or inf is refused (``save_patch`` never writes one)."""
    tensors, doc = files.read_file(path, PATCH_FORMAT)
    kinds = doc.get("kinds")
    if not isinstance(kinds, dict):
        raise FileFormatError(f"{path}: patch metadata has no 'kinds' table")
    deltas: dict[str, Delta] = {}
    expected = set()
    for name, kind in kinds.items():
        if kind not in dl.KINDS:
            raise FileFormatError(f"{path}: unknown delta kind {kind!r} for {name}")
        keys = _keys(name, kind)
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise FileFormatError(f"{path}: tensors {missing} are missing")
        expected.update(keys)
        deltas[name] = dl.from_tensors(kind, [tensors[k] for k in keys])
    extra = set(tensors) - expected
    if extra:
        raise FileFormatError(f"{path}: unexpected tensors {sorted(extra)}")
    meta = doc.get("meta") or {}
    try:
        if "static" in doc:  # written with the fields
            plan = doc.get("plan")
            fields = {
                "plan": None if plan is None else Plan.from_meta(plan),
                "static": bool(doc["static"]),
                "readers": doc.get("readers"),
                "rows": doc.get("rows"),
                "plans": [[Plan.from_meta(p) for p in r] for r in doc.get("plans") or ()],
                "tokens": doc.get("tokens"),
                "prefix": doc.get("prefix") or (),
            }
        else:  # tokenpatch 0.2: the behaviour was in meta
            meta, fields = split_behaviour(meta)
        patch = Patch(deltas, doc.get("positions"), meta, **fields)
    except (InputError, KeyError, TypeError, ValueError) as exc:
        raise FileFormatError(f"{path}: inconsistent patch: {exc}") from exc
    try:  # save_patch writes finite patches only: NaN or inf here is a damaged file
        patch.check_finite()
    except InputError as exc:
        raise FileFormatError(f"{path}: damaged patch file: {exc}") from exc
    if model is not None:
        try:
            patch.check_model(model, cached=False)
        except InputError as exc:
            raise FileFormatError(f"{path}: {exc}") from exc
    return patch
