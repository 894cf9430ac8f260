"""``Patch``: the mapping ``parameter name -> delta``, and what the patch is for, as fields.

A ``Patch`` holds one delta per patched parameter of a model, keyed by the name that
``model.named_parameters()`` gives it, or per patched module input, keyed ``"<module>:input"``
(a rank-1 change ``s -> s + D s`` of what the module reads: the input side of a Hugging Face
model's MLP, equal to ``W + W D`` on every matrix reading it). Every delta is batched over the same
two leading dims ``[batch, query]`` -- one patch per (sequence, query position) -- and is either a
``LowRank`` (``lowrank.py``) for a matrix (stacked experts' output matrices ``[E, out, in]`` as the
one matrix ``[out, E * in]``, ``lowrank.matrix_shape``), or a dense tensor ``[batch, query,
*param.shape]`` for a vector (a bias or a norm scale).

How the patch runs is its type, never its metadata. Fields, all carried by ``+``, ``.sum``,
``Patch.stack`` and indexing (each by its row of one table, ``patch_combine.FIELD_RULES``), ``.map``
and the patch files; the deltas by the delta protocol (``deltas.py``, dense and ``LowRank`` alike):

* ``positions``: empty for a patch acting **everywhere** (each ``[b, q]`` patch on its own
  no-context sequence; also a static patch), else one no-context position per query: patch
  ``[b, q]`` acts **at position** ``positions[q]`` of sequence ``b`` only (a chunk removed);
* ``plan``: the ``Plan`` (queries, removed context, sequence length) it was computed for, or
  ``None``; ``functional_call`` checks the no-context length against it, ``verify`` defaults to it;
* ``plans``: where the rows were made for different plans (``Patch.stack``) or a row for several
  (``a + b``: a patch of no single input), per batch row the plans it was made for (``plan`` is
  then ``None``); ``functional_call`` refuses to leave out position ids any of them needs;
* ``tokens``: per ``[b, q]`` a fingerprint (int64, 0: unchecked) of the no-context token ids that
  patch was made for (``plans.token_digests``); ``functional_call`` refuses other tokens;
* ``prefix``: token ids every sequence it runs on must begin with (a ``keep_bos`` thought patch's BOS);
* ``static``: one update for any input (a thought patch): it runs on any no-context inputs;
* ``readers``: for each ``"<module>:input"`` delta, the matrices that read that input, with their
  layouts (``apply`` writes ``W + W D`` into each);
* ``rows``: the rows of the batch it was computed from, or ``None``.

``meta`` is provenance only (model record and fingerprint, dtype, fit diagnostics); combining
patches keeps the entries they agree on. Files: ``patch_files.py``.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch.deltas import Delta
from tokenpatch.errors import InputError, caller_stacklevel
from tokenpatch.lowrank import LowRank, check_finite
from tokenpatch.patch_combine import CARRIED, combined
from tokenpatch.patch_fields import (
    BEHAVIOUR_KEYS,
    INPUT_SUFFIX,
    Readers,
    check_against_model,
    check_plan,
    check_plans,
    check_tokens,
    checked_readers,
    row_plans,
    split_behaviour,
)
from tokenpatch.plans import Plan

__all__ = ["Patch", "Delta", "LowRank", "Readers", "INPUT_SUFFIX", "BEHAVIOUR_KEYS", "split_behaviour"]

# A key ``"<module>:input"`` (``INPUT_SUFFIX``) holds a change of that module's input, ``s -> s + D s``
# with ``D`` a ``LowRank`` [d, d]: the same as ``W + W D`` on every matrix that reads it
# (``Patch.readers``), without forming ``W D`` (``arch.Sites.input_site``). ``Delta = LowRank | Tensor``,
# handled through one protocol (``deltas.py``).


class Patch(Mapping):
    """``parameter name -> delta``, all deltas batched over ``[batch, query]``, with the fields that
    say how it runs (module docstring).

    ``patch["blocks.0.mlp.fc_in.weight"]`` is one delta; ``patch[b, q]`` (ints or slices) is the
    sub-patch of those batch and query indices, leading dims kept. ``a + b`` sums two patches
    (low-rank terms stack), ``patch.sum("query")`` sums over queries into one patch acting
    everywhere, ``Patch.stack`` concatenates along a leading dim, ``.dense()`` materialises.
    """

    def __init__(
        self,
        deltas: Mapping[str, Delta],
        positions=None,
        meta: dict | None = None,
        *,
        plan: Plan | None = None,
        static: bool = False,
        readers: Readers | None = None,
        rows=None,
        plans=(),
        tokens=None,
        prefix=(),
    ):
        """``positions``: ``None`` (or empty) for a patch acting everywhere, else one no-context
        position per query (the patch acts at positions). A ``meta`` holding 0.2's behaviour keys
        (``static``, ``inputs``, ``query``, ...) still works, with a ``DeprecationWarning``."""
        self._deltas: dict[str, Delta] = dict(deltas)
        if not self._deltas:
            raise InputError("a Patch needs at least one delta")
        leads = {name: dl.lead(d) for name, d in self._deltas.items()}
        lead = next(iter(leads.values()))
        if any(l != lead or len(l) != 2 for l in leads.values()):
            raise InputError(f"every delta must lead with the same [batch, query] dims; got {leads}")
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, d in self._deltas.items():
            by_dtype.setdefault(d.dtype, []).append(name)
        if len(by_dtype) != 1:
            held = "; ".join(
                f"{str(t).removeprefix('torch.')}: {', '.join(n[:2])}"
                + (f" and {len(n) - 2} more" if len(n) > 2 else "")
                for t, n in by_dtype.items()
            )
            raise InputError(
                f"deltas of one Patch must share a dtype, got {held} (a model whose parameters mix dtypes, "
                "as transformers' from_pretrained keeps some modules in float32: cast it whole, model.to(dtype))"
            )
        self.lead: tuple[int, int] = lead  # (batch, query)
        positions = () if positions is None else tuple(int(p) for p in positions)
        if positions and (len(positions) != lead[1] or len(set(positions)) != len(positions) or min(positions) < 0):
            raise InputError(f"positions {positions} must be {lead[1]} distinct non-negative ints")
        self.positions: tuple[int, ...] = positions  # empty when the patch acts everywhere
        meta = dict(meta or {})
        if any(k in meta for k in BEHAVIOUR_KEYS):
            warnings.warn(
                f"Patch(meta=...) with {sorted(k for k in BEHAVIOUR_KEYS if k in meta)} is deprecated: "
                "pass plan=, static=, readers=, rows= (meta is provenance only)",
                DeprecationWarning,
                stacklevel=caller_stacklevel(),
            )
            meta, old = split_behaviour(meta)
            plan, static = plan or old.get("plan"), static or old.get("static", False)
            readers, rows = readers or old.get("readers"), rows if rows is not None else old.get("rows")
        if plan is not None:
            check_plan(plan, lead, positions)
        plans = check_plans(plans, lead, positions)
        if plan is not None and plans:
            raise InputError("a Patch has one plan for every row (plan=) or plans per row (plans=), not both")
        self.plan: Plan | None = plan
        self.plans: tuple[tuple[Plan, ...], ...] = plans  # per row, where the rows differ (module docstring)
        self.tokens: Tensor | None = check_tokens(tokens, lead)  # [batch, query] fingerprints, 0: unchecked
        self.prefix: tuple[int, ...] = tuple(int(t) for t in prefix)
        self.static: bool = bool(static)
        inputs = {n for n in self._deltas if n.endswith(INPUT_SUFFIX)}
        self.readers: dict[str, tuple[tuple[str, str], ...]] = {
            k: v for k, v in checked_readers(readers).items() if k in inputs
        }
        if rows is not None:
            rows = tuple(int(r) for r in rows)
            if len(rows) != lead[0]:
                raise InputError(f"rows {list(rows)} must name one source row per batch row ({lead[0]})")
        self.rows: tuple[int, ...] | None = rows
        self.meta: dict[str, Any] = meta

    def _fields(self) -> dict[str, Any]:  # what a derived patch carries over (patch_combine.CARRIED)
        return {f: getattr(self, f) for f in CARRIED}

    def made_for(self) -> list[Plan]:
        """Every plan some row of the patch was made for (``plan``, or each of ``plans``), once each."""
        return list(dict.fromkeys(p for r in row_plans(self) for p in r))

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
            parts.append(f"  {name}: {dl.describe(d)}")
        kind = ", static" if self.static else (f", made for query {list(self.plan.query)}" if self.plan else "")
        return (
            f"Patch(batch={self.lead[0]}, query={self.lead[1]}, dtype={self.dtype}, acts {self.where()}{kind},\n"
            + "\n".join(parts)
            + "\n)"
        )

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self._deltas.values())).dtype

    @property
    def terms(self) -> int:
        """How many token patches were summed into this one (1 for a token patch)."""
        return int(self.meta.get("terms", 1))

    # ----------------------------------------------------------------- derived patches
    def _index(self, key) -> Patch:
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
        fields = combined("index", self, key)  # each field's rule (patch_combine.FIELD_RULES)
        return Patch({n: dl.index(d, key) for n, d in self._deltas.items()}, **fields)

    def map(self, fn) -> Patch:
        """Apply ``fn`` to every factor / dense tensor (e.g. ``lambda t: t.double()``)."""
        deltas = {n: dl.map_tensors(d, fn) for n, d in self._deltas.items()}
        lead = dl.lead(next(iter(deltas.values())))  # ``fn`` may reshape them: the fields that still fit
        return Patch(deltas, **combined("map", self, lead))

    def to(self, *args, **kwargs) -> Patch:
        return self.map(lambda t: t.to(*args, **kwargs))

    def replace(self, deltas: Mapping[str, Delta] | None = None, meta: dict | None = None, **fields) -> Patch:
        """The same patch (positions and fields) with other ``deltas``, ``meta`` or fields."""
        return Patch(
            self._deltas if deltas is None else deltas,
            self.positions,
            self.meta if meta is None else meta,
            **{**self._fields(), **fields},
        )

    def dense(self) -> dict[str, Tensor]:
        """Materialise every delta: ``{name: [batch, query, *param.shape]}``."""
        return {n: dl.dense(d) for n, d in self._deltas.items()}

    def norms(self) -> dict[str, Tensor]:
        """Frobenius (or Euclidean) norm of every delta, ``{name: [batch, query]}``, from factors (``deltas.norm``)."""
        return {n: dl.norm(d) for n, d in self._deltas.items()}

    def check_finite(self) -> None:
        """Raise ``InputError`` naming the first delta that holds NaN or inf (``lowrank.check_finite``)."""
        check_finite(self._deltas)

    def __add__(self, other: Patch) -> Patch:
        """Sum of two patches of the same model acting at the same place (low-rank terms stack;
        a key missing on one side counts as 0). The sum is a patch, not the token patch of any
        context; ``verify`` measures how far it is from one. It is static only if both are; each row is
        made for every plan its terms were (``plans``: position ids any of them needs are required),
        it keeps the rows, token fingerprints and prefix the two share, and every input change with the
        matrices that read it."""
        if not isinstance(other, Patch):
            return NotImplemented
        if self.dtype != other.dtype:
            raise InputError(f"cannot add a {self.dtype} patch to a {other.dtype} one; convert one with .to(dtype)")
        try:
            torch.broadcast_shapes(self.lead, other.lead)
        except RuntimeError:
            raise InputError(
                f"cannot add patches of [batch, query] = {list(self.lead)} and {list(other.lead)}"
            ) from None
        fields = combined("add", [self, other], tuple(torch.broadcast_shapes(self.lead, other.lead)))
        deltas = dict(self._deltas)
        for n, d in other._deltas.items():
            deltas[n] = dl.add(deltas[n], d) if n in deltas else d
        return Patch(deltas, **fields)

    def sum(self, dim: str = "query") -> Patch:
        """Sum over ``"query"`` or ``"batch"`` (the dim is kept with size 1). Summing over
        queries gives a patch that acts everywhere."""
        if dim not in ("batch", "query"):
            raise InputError(f"sum over 'batch' or 'query', not {dim!r}")
        i = ("batch", "query").index(dim)
        fields = combined("sum", self, dim)  # over queries: acts everywhere, no plan, no token fingerprints
        return Patch({n: dl.sum_over(d, i) for n, d in self._deltas.items()}, **fields)

    @staticmethod
    def stack(patches: list[Patch], dim: str = "batch") -> Patch:
        """Concatenate patches of one model with the same keys along ``"batch"`` (same queries,
        same positions) or ``"query"`` (same batch; only patches acting everywhere: patches acting
        at positions act together and come whole from one ``token_patch`` call). Each row keeps the
        plan it was made for (``plans`` where the rows' differ) and its token fingerprints."""
        if not patches or dim not in ("batch", "query"):
            raise InputError(f"Patch.stack needs at least one patch and dim 'batch' or 'query', got {dim!r}")
        first = patches[0]
        if any(list(p) != list(first) or p.dtype != first.dtype for p in patches):
            raise InputError("Patch.stack needs patches with the same parameter names and dtype")
        other = 1 if dim == "batch" else 0
        if len({p.lead[other] for p in patches}) > 1:
            raise InputError(
                f"Patch.stack along {dim} needs the same {('batch', 'query')[other]} size, got "
                f"{[list(p.lead) for p in patches]}"
            )
        for n in first:
            shapes = {dl.signature(p[n]) for p in patches}
            if len(shapes) > 1:
                raise InputError(f"Patch.stack: {n} has different (rank, shape) across patches: {shapes}")
        fields = combined("stack", patches, dim)  # each row keeps its plans (patch_combine.FIELD_RULES)
        i = 0 if dim == "batch" else 1
        return Patch({n: dl.cat([p[n] for p in patches], i) for n in first}, **fields)

    def check_model(self, model: nn.Module, cached: bool = True) -> None:
        """Raise unless every key names a parameter of ``model`` of the right shape, and (when the patch
        records them) the model's weights and config are the ones it was computed from (``files.fingerprint``,
        ``cached=False`` re-hashing every weight; ``files.check_config``). Once a model passes, later checks
        cost a few integer reads and one read of a few values per parameter, and one attribute read per
        config field."""
        check_against_model(self, model, cached)
