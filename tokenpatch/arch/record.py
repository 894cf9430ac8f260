"""``LayerRecord``: what one layer's pass recorded, at the positions asked for, as named fields.

The names follow ``docs/patch-theorem.md``: a layer reads ``h``, its mixer (attention) gives the
residual value ``m`` the MLP output is added to, the MLP reads ``s`` (the MLP input, after its norm),
its output matrix reads ``hidden``, and the layer gives ``out``. Where a layer's output side needs
more, the record has it: ``p`` (the input of a norm after the MLP: the output matrix's output
``W hidden``, or the whole block's where experts add theirs, or that plus the routed experts' where the
norm follows a block with shared experts), ``gate`` (a shared expert's gate logit), ``v`` (the
attention's values, every position: the lone token's anchor reads them), ``sum`` (the input of a norm
after the MLP's add), ``first`` (``[B, Q]``, whether a query is the first real token of its row).
Every field is ``[B, Q, .]`` unless said.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from tokenpatch.errors import caller_stacklevel

__all__ = ["LayerRecord", "FIELDS", "NamedSite"]


@dataclass
class LayerRecord:
    """One layer's recorded states (module docstring); a field not recorded is ``None``."""

    h: Tensor | None = None
    m: Tensor | None = None
    s: Tensor | None = None
    hidden: Tensor | None = None
    out: Tensor | None = None
    p: Tensor | None = None
    gate: Tensor | None = None
    v: Tensor | None = None
    sum: Tensor | None = None
    first: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        """The recorded fields by name (those not ``None``)."""
        return {f.name: t for f in dataclasses.fields(self) if (t := getattr(self, f.name)) is not None}

    def replace(self, **changes) -> LayerRecord:
        """A copy with ``changes`` (field -> tensor)."""
        return dataclasses.replace(self, **changes)

    def only(self, names) -> LayerRecord:
        """A record of the fields ``names`` only (those recorded)."""
        return LayerRecord(**{n: getattr(self, n) for n in names})

    def map(self, fn) -> LayerRecord:
        """``fn`` applied to every recorded field."""
        return LayerRecord(**{n: fn(t) for n, t in self.tensors().items()})

    @classmethod
    def cat(cls, records, dim: int = 0) -> LayerRecord:
        """The fields of ``records`` (each recording the same fields) joined along ``dim``."""
        names = records[0].tensors()
        return cls(**{n: torch.cat([getattr(r, n) for r in records], dim) for n in names})

    # The dicts this record replaces were read by key: kept for one release, with a DeprecationWarning.
    def _by_key(self, key: str):
        warnings.warn(
            f"reading a layer record by key ({key!r}) is deprecated: read its field (record.{key})",
            DeprecationWarning,
            stacklevel=caller_stacklevel() + 1,
        )
        return getattr(self, key, None)

    def __getitem__(self, key: str) -> Tensor:
        value = self._by_key(key)
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: str, default=None):
        value = self._by_key(key)
        return default if value is None else value

    def __contains__(self, key: str) -> bool:
        return self._by_key(key) is not None


FIELDS = tuple(f.name for f in dataclasses.fields(LayerRecord))


@dataclass(frozen=True)
class NamedSite:
    """A named site of a layer, a row of its table of sites (our blocks: ``ICLAdapter``; a Hugging Face
    design: ``Family.sites``): the ``LayerRecord`` field ``field`` is the input (``output=False``) or
    the output of module ``module`` (a name under the layer; ``""``: the layer itself).

    ``first``: read before every hook registered earlier (before a patch's input change: ``m`` and
    ``s`` as the layer computes them). ``every``: recorded at every position, without a copy (the
    values, read by a lone token's anchor). ``plus_h``: the field is the layer input plus this (a
    parallel block's ``m = h + A(h)``). ``experts``: the chosen experts' weighted hidden states, from
    the stacked-experts module's arguments (``arch.experts.scattered_hiddens``). ``adds``: a term of the
    field another site of the layer records, added to it (LongCat-Flash's shortcut, part of ``m``)."""

    field: str
    module: str
    output: bool
    first: bool = False
    every: bool = False
    plus_h: bool = False
    experts: bool = False
    adds: bool = False
