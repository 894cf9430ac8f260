"""``Patch``: the mapping ``parameter name -> delta`` and its files.

A ``Patch`` holds one delta per patched parameter of a model, keyed by the name that
``model.named_parameters()`` gives it, or per patched module input, keyed ``"<module>:input"``
(a rank-1 change ``s -> s + D s`` of what the module reads: the input side of a Hugging Face
model's MLP, equal to ``W + W D`` on every matrix reading it, ``meta["inputs"]``). Every delta is batched over the same two leading dims
``[batch, query]`` -- one patch per (sequence, query position) -- and is either a ``LowRank``
(``lowrank.py``) for a matrix, or a dense tensor ``[batch, query, *param.shape]`` for a vector
(a bias or a norm scale).

Where a patch acts in the no-context pass is explicit, ``patch.acts``:

* ``"everywhere"``: each (batch, query) patch belongs to its own no-context sequence and acts
  on all of it (all context removed; also a static patch summed over queries);
* ``"at_positions"``: patch ``[b, q]`` acts at position ``patch.positions[q]`` of sequence ``b``
  only (a chunk removed from the middle).

``meta`` is a flat JSON-able record of how the patch was made (model fingerprint, query, removed
chunk, dtype); combining patches keeps it flat (``terms`` counts the token patches summed).

Files: ``save_patch`` / ``load_patch`` write safetensors (``name.u``, ``name.v`` or ``name``) with
``meta``, ``positions`` and a checksum as JSON metadata. No pickle.
"""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Union

import torch
from torch import Tensor, nn

from tokenpatch import files
from tokenpatch.errors import FileFormatError, InputError
from tokenpatch.lowrank import LowRank

__all__ = ["Patch", "Delta", "save_patch", "load_patch", "PATCH_FORMAT"]

PATCH_FORMAT = "tokenpatch.patch/1"
# A key ``"<module>:input"`` holds a change of that module's input, ``s -> s + D s`` with ``D`` a
# ``LowRank`` [d, d]: the same as ``W + W D`` on every matrix that reads it (listed in
# ``meta["inputs"]``), without forming ``W D`` (``arch.Sites.input_site``).
INPUT_SUFFIX = ":input"

Delta = Union[LowRank, Tensor]


def _common_meta(patches: list["Patch"], keys: tuple[str, ...]) -> dict[str, Any]:
    """The metadata ``keys`` all ``patches`` agree on; patches of different models raise."""
    models = [p.meta.get("model") for p in patches]
    if any(m != models[0] for m in models):
        raise InputError("cannot combine patches computed for different models (or with and without a model record)")
    return {k: patches[0].meta[k] for k in keys if k in patches[0].meta and all(p.meta.get(k) == patches[0].meta[k] for p in patches)}


def _lead(delta: Delta) -> tuple[int, ...]:
    if isinstance(delta, LowRank):
        return delta.lead
    return tuple(delta.shape[:2])


class Patch(Mapping):
    """``parameter name -> delta``, all deltas batched over ``[batch, query]``.

    ``patch["blocks.0.mlp.fc_in.weight"]`` is one delta; ``patch[b, q]`` (ints or slices) is the
    sub-patch of those batch and query indices, leading dims kept. ``a + b`` sums two patches
    (low-rank terms stack), ``patch.sum("query")`` sums over queries into one static patch,
    ``Patch.stack`` concatenates along a leading dim, ``.dense()`` materialises.
    """

    def __init__(self, deltas: Mapping[str, Delta], positions=None, meta: dict | None = None):
        """``positions``: ``None`` (or empty) for a patch acting everywhere, else one no-context
        position per query (the patch acts at positions)."""
        self._deltas: dict[str, Delta] = dict(deltas)
        if not self._deltas:
            raise InputError("a Patch needs at least one delta")
        leads = {name: _lead(d) for name, d in self._deltas.items()}
        lead = next(iter(leads.values()))
        bad = {n: l for n, l in leads.items() if l != lead or len(l) != 2}
        if bad:
            raise InputError(f"every delta must lead with the same [batch, query] dims; got {leads}")
        dtypes = {d.dtype for d in self._deltas.values()}
        if len(dtypes) != 1:
            raise InputError(f"deltas of one Patch must share a dtype, got {dtypes}")
        self.lead: tuple[int, int] = lead  # (batch, query)
        positions = () if positions is None else tuple(int(p) for p in positions)
        if positions and (len(positions) != lead[1] or len(set(positions)) != len(positions) or min(positions) < 0):
            raise InputError(f"positions {positions} must be {lead[1]} distinct non-negative ints")
        self.positions: tuple[int, ...] = positions  # empty when the patch acts everywhere
        self.meta: dict[str, Any] = dict(meta or {})

    @property
    def acts(self) -> Literal["everywhere", "at_positions"]:
        """Where the patch acts in the no-context pass (module docstring)."""
        return "at_positions" if self.positions else "everywhere"

    def where(self) -> str:
        """``"everywhere"`` or ``"at positions [..]"``, for messages."""
        return f"at positions {list(self.positions)}" if self.positions else "everywhere"

    # ----------------------------------------------------------------- mapping interface
    def __getitem__(self, key):
        if isinstance(key, str):
            return self._deltas[key]
        return self._index(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._deltas)

    def __len__(self) -> int:
        return len(self._deltas)

    def __repr__(self) -> str:
        parts = []
        for name, d in self._deltas.items():
            desc = f"LowRank(rank={d.rank}, {d.shape[0]}x{d.shape[1]})" if isinstance(d, LowRank) else f"dense{tuple(d.shape[2:])}"
            parts.append(f"  {name}: {desc}")
        return f"Patch(batch={self.lead[0]}, query={self.lead[1]}, dtype={self.dtype}, acts {self.where()},\n" + "\n".join(parts) + "\n)"

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._deltas.values())).dtype

    # ----------------------------------------------------------------- derived patches
    def _index(self, key) -> "Patch":
        if not isinstance(key, tuple):
            key = (key,)
        if len(key) > 2:
            raise InputError(f"a Patch has two leading dims [batch, query]; got index {key}")
        key = key + (slice(None),) * (2 - len(key))
        slices = []
        for k, size in zip(key, self.lead):  # ints keep their dim as size 1
            if not isinstance(k, slice):
                if isinstance(k, bool) or (isinstance(k, Tensor) and k.dtype == torch.bool):
                    raise InputError(f"a Patch is indexed by ints or slices, not {k!r}")
                k = operator.index(k)
                if not -size <= k < size:
                    raise IndexError(f"index {k} is out of range for a Patch dim of size {size}")
                k = slice(k % size, k % size + 1)
            if not range(size)[k]:
                raise InputError(f"index {key} selects no patch from [batch, query] = {list(self.lead)}")
            slices.append(k)
        key = tuple(slices)
        if self.acts == "at_positions":  # queries acting together: keep every query up to some position
            chosen = set(self.positions[key[1]])
            if chosen != {p for p in self.positions if p <= max(chosen)}:
                raise InputError(
                    f"these patches act together (a chunk was removed; each query's patch assumes the patches of the "
                    f"queries before it), so a subset must keep every query up to its last position; "
                    f"{sorted(chosen)} of {sorted(self.positions)} does not. Read one query's factors with "
                    f"patch[name].u[:, q], or compute it alone with token_patch(..., query=q)"
                )
        deltas = {n: d.index(key) if isinstance(d, LowRank) else d[key] for n, d in self._deltas.items()}
        positions = self.positions[key[1]]
        meta = dict(self.meta)  # keep the record true to the sub-patch
        meta["batch_index"] = meta.get("batch_index", list(range(self.lead[0])))[key[0]]
        meta["batch"] = len(meta["batch_index"])
        if "query" in meta:
            meta["query"] = meta["query"][key[1]]
        return Patch(deltas, positions, meta)

    def map(self, fn) -> "Patch":
        """Apply ``fn`` to every factor / dense tensor (e.g. ``lambda t: t.double()``)."""
        deltas = {n: LowRank(fn(d.u), fn(d.v)) if isinstance(d, LowRank) else fn(d) for n, d in self._deltas.items()}
        return Patch(deltas, self.positions, self.meta)

    def to(self, *args, **kwargs) -> "Patch":
        return self.map(lambda t: t.to(*args, **kwargs))

    def dense(self) -> dict[str, Tensor]:
        """Materialise every delta: ``{name: [batch, query, *param.shape]}``."""
        return {n: d.dense() if isinstance(d, LowRank) else d for n, d in self._deltas.items()}

    def norms(self) -> dict[str, Tensor]:
        """Frobenius (or Euclidean) norm of every delta, ``{name: [batch, query]}``, from factors."""
        return {n: d.norm() if isinstance(d, LowRank) else d.flatten(2).norm(dim=-1) for n, d in self._deltas.items()}

    def __add__(self, other: "Patch") -> "Patch":
        """Sum of two patches of the same model acting at the same place (low-rank terms stack;
        a key missing on one side counts as 0). The sum is a patch, not the token patch of any
        context; ``verify`` measures how far it is from one."""
        if not isinstance(other, Patch):
            return NotImplemented
        if self.positions != other.positions:
            raise InputError(f"cannot add patches acting at different positions: {self.positions} vs {other.positions}")
        if self.dtype != other.dtype:
            raise InputError(f"cannot add a {self.dtype} patch to a {other.dtype} one; convert one with .to(dtype)")
        meta = _common_meta([self, other], ("model", "seq_len", "query", "removed", "batch", "batch_index"))
        deltas = dict(self._deltas)
        for n, d in other._deltas.items():
            deltas[n] = deltas[n] + d if n in deltas else d
        return Patch(deltas, self.positions, {**meta, "terms": self.terms + other.terms})

    @property
    def terms(self) -> int:
        """How many token patches were summed into this one (1 for a token patch)."""
        return int(self.meta.get("terms", 1))

    def sum(self, dim: str = "query") -> "Patch":
        """Sum over ``"query"`` or ``"batch"`` (the dim is kept with size 1). Summing over
        queries gives a static patch that acts everywhere."""
        if dim not in ("batch", "query"):
            raise InputError(f"sum over 'batch' or 'query', not {dim!r}")
        i = 0 if dim == "batch" else 1
        deltas = {n: d.sum(i) if isinstance(d, LowRank) else d.sum(i, keepdim=True) for n, d in self._deltas.items()}
        positions = () if dim == "query" else self.positions
        drop = ("query", "removed") if dim == "query" else ("batch", "batch_index")
        meta = {k: v for k, v in self.meta.items() if k not in drop}
        terms = self.terms * self.lead[0 if dim == "batch" else 1]
        return Patch(deltas, positions, {**meta, "summed_over": dim, "terms": terms})

    @staticmethod
    def stack(patches: list["Patch"], dim: str = "batch") -> "Patch":
        """Concatenate patches of one model with the same keys along ``"batch"`` (same queries,
        same positions) or ``"query"`` (same batch; only patches acting everywhere: patches acting
        at positions act together and come whole from one ``token_patch`` call)."""
        if not patches:
            raise InputError("Patch.stack needs at least one patch")
        if dim not in ("batch", "query"):
            raise InputError(f"stack along 'batch' or 'query', not {dim!r}")
        first = patches[0]
        if any(list(p) != list(first) for p in patches):
            raise InputError("Patch.stack needs patches with the same parameter names")
        if len({p.dtype for p in patches}) > 1:
            raise InputError("Patch.stack needs patches of one dtype")
        other = 1 if dim == "batch" else 0
        if len({p.lead[other] for p in patches}) > 1:
            raise InputError(f"Patch.stack along {dim} needs the same {('batch', 'query')[other]} size, got "
                             f"{[list(p.lead) for p in patches]}")
        for n in first:
            shapes = {(d.rank, d.shape) if isinstance(d, LowRank) else tuple(d.shape[2:]) for d in (p[n] for p in patches)}
            if len(shapes) > 1:
                raise InputError(f"Patch.stack: {n} has different (rank, shape) across patches: {shapes}")
        if dim == "query":
            if any(p.acts == "at_positions" for p in patches):
                raise InputError(
                    "patches acting at given positions (a chunk removed) act together and cannot be stacked "
                    "along query; compute all the queries in one token_patch call"
                )
            positions = ()
            meta = _common_meta(patches, ("model", "seq_len", "removed", "batch", "batch_index"))
            if all("query" in p.meta for p in patches):
                meta["query"] = sum((list(p.meta["query"]) for p in patches), [])
        else:
            positions = first.positions
            if any(p.positions != positions for p in patches):
                raise InputError("Patch.stack along batch needs patches acting at the same positions")
            meta = _common_meta(patches, ("model", "seq_len", "query", "removed"))
            meta["batch"] = sum(p.lead[0] for p in patches)
        i = 0 if dim == "batch" else 1
        deltas = {}
        for n in first:
            ds = [p[n] for p in patches]
            if isinstance(ds[0], LowRank):
                deltas[n] = LowRank(torch.cat([d.u for d in ds], i), torch.cat([d.v for d in ds], i))
            else:
                deltas[n] = torch.cat(ds, i)
        return Patch(deltas, positions, meta)

    def check_model(self, model: nn.Module, cached: bool = True) -> None:
        """Raise unless every key names a parameter of ``model`` of the right shape, and (when the
        patch records one) the model's weights are the ones the patch was computed from
        (``tokenpatch._io.fingerprint``; ``cached=False`` re-hashes every weight). Once a model
        passes, later checks against the same unchanged model cost a few integer reads per parameter."""
        digest = files.fingerprint(model, cached)
        seen = self.__dict__.get("_checked")
        if cached and seen is not None and seen[0]() is model and seen[1] == digest:
            return
        params = dict(model.named_parameters())
        readers = self.meta.get("inputs", {})
        for name, d in self._deltas.items():
            if name.endswith(INPUT_SUFFIX):  # a change of a module's input: the module exists, its readers fit
                module = name[: -len(INPUT_SUFFIX)]
                try:
                    model.get_submodule(module)
                except AttributeError:
                    raise InputError(f"patch names the input of {module!r}, which is not a module of "
                                     f"{type(model).__name__}") from None
                for reader, layout in readers.get(name, []):
                    width = None if reader not in params else params[reader].shape[-1 if layout == "out_in" else 0]
                    if width is None or not isinstance(d, LowRank) or d.shape != (width, width):
                        raise InputError(f"patch input change {name} ({d.shape if isinstance(d, LowRank) else 'dense'}) "
                                         f"does not fit {reader} of this model")
                continue
            if name not in params:
                raise InputError(f"patch names {name!r}, which is not a parameter of {type(model).__name__}")
            shape = tuple(params[name].shape)
            got = d.shape if isinstance(d, LowRank) else tuple(d.shape[2:])
            if got != shape:
                raise InputError(f"patch delta for {name} has shape {got}, the parameter is {shape}")
        want = self.meta.get("model", {}).get("fingerprint")
        if want is not None and want != digest:
            raise InputError(
                f"this patch was computed for another model (fingerprint {want}, this model "
                f"{digest}); a token patch is exact only for the weights it came from"
            )
        self._checked = (weakref.ref(model), digest)


# --------------------------------------------------------------------------------- files


def save_patch(patch: Patch, path: str | os.PathLike) -> None:
    """Write ``patch`` to ``path``: safetensors, ``name.u``/``name.v`` or ``name``, JSON meta."""
    tensors: dict[str, Tensor] = {}
    for name, d in patch.items():
        if isinstance(d, LowRank):
            tensors[f"{name}.u"], tensors[f"{name}.v"] = d.u, d.v
        else:
            tensors[name] = d
    kinds = {n: "lowrank" if isinstance(d, LowRank) else "dense" for n, d in patch.items()}
    doc = {"kinds": kinds, "positions": list(patch.positions) or None, "meta": patch.meta}
    files.write_file(path, tensors, PATCH_FORMAT, doc)


def load_patch(path: str | os.PathLike, model: nn.Module | None = None) -> Patch:
    """Read a patch written by ``save``. With ``model``, also check it belongs to that model."""
    tensors, doc = files.read_file(path, PATCH_FORMAT)
    kinds = doc.get("kinds")
    if not isinstance(kinds, dict):
        raise FileFormatError(f"{path}: patch metadata has no 'kinds' table")
    deltas: dict[str, Delta] = {}
    expected = set()
    for name, kind in kinds.items():
        if kind == "lowrank":
            keys = (f"{name}.u", f"{name}.v")
        elif kind == "dense":
            keys = (name,)
        else:
            raise FileFormatError(f"{path}: unknown delta kind {kind!r} for {name}")
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise FileFormatError(f"{path}: tensors {missing} are missing")
        expected.update(keys)
        deltas[name] = LowRank(tensors[keys[0]], tensors[keys[1]]) if kind == "lowrank" else tensors[keys[0]]
    extra = set(tensors) - expected
    if extra:
        raise FileFormatError(f"{path}: unexpected tensors {sorted(extra)}")
    try:
        patch = Patch(deltas, doc.get("positions"), doc.get("meta"))
    except InputError as exc:
        raise FileFormatError(f"{path}: inconsistent patch: {exc}") from exc
    if model is not None:
        try:
            patch.check_model(model, cached=False)
        except InputError as exc:
            raise FileFormatError(f"{path}: {exc}") from exc
    return patch
