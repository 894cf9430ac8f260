"""The output kinds: how a layer's patch absorbs its output side, ``m_C - m_0``, one class per kind.

A residual block adds its MLP's output to ``m``. With the input side patched the MLP reads its
with-context input, so the layer still misses ``m_C - m_0``; the output site absorbs it
(``docs/patch-theorem.md``, ``docs/deep-models.md``). Each kind says, for its modules:

* ``token_deltas``: the exact token patch from the recorded with-context states (``LayerRecord``) and
  the anchor ``m_0``;
* ``fit_pairs``: the thought patch's least-squares pairs ``(x, t)`` with ``dW x ~ t``, from recorded
  with-context and no-context states (``tokenpatch.thought``);
* ``stream``: the layer's output once the fitted deltas are in place, from the no-context pass's
  recorded states (the next layer's input, without a third pass);

and declares what it reads (``needs``: recorded fields beyond ``m`` and ``hidden``), whether the fit
has a bias (``affine``) and what it writes (``names``).

The kinds: ``BiasOutput`` (``m_C - m_0`` on the output bias), ``MatrixOutput`` (the rank-1
``(m_C - m_0) h_C^T / |h_C|^2`` on the output matrix), ``ScaledMatrixOutput`` (a norm after the MLP:
Gemma 2/3; ``solve.output_patch_scaled``), ``GatedOutput`` (a shared expert's output scaled by
``sigmoid(gate)``: the shift divided by it), ``ExpertsOutput`` (stacked experts read as one matrix on
the chosen experts' weighted hidden states, ``arch.experts``). Adding a kind is one class here.

``scale``: a constant the block multiplies the MLP output by (Granite's ``residual_multiplier``): the
shift a kind absorbs is ``(m_C - m_0) / scale``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from tokenpatch import offload, solve
from tokenpatch.arch.layouts import weight_layout
from tokenpatch.arch.norms import norm_eps, scale_norm
from tokenpatch.arch.record import LayerRecord
from tokenpatch.errors import UnsupportedModelError, caller_stacklevel
from tokenpatch.lowrank import LowRank

__all__ = [
    "OutputSite",
    "BiasOutput",
    "MatrixOutput",
    "ScaledMatrixOutput",
    "GatedOutput",
    "ExpertsOutput",
    "KINDS",
    "OUTPUT_KINDS",
    "stored",
]


def stored(delta: LowRank, layout: str) -> LowRank:
    """Factors ``(out-side, in-side)`` of the math, in the parameter's storage layout."""
    return delta if layout == "out_in" else LowRank(delta.v, delta.u)


def _layout(model: nn.Module, name: str) -> str:
    return weight_layout(model.get_submodule(name.rpartition(".")[0]), name)


class _ByKind(type):
    """``OutputSite(kind, name, norm=None, scale=1.0)``, the spelling of earlier versions, builds the
    class ``KINDS[kind]`` (with a ``DeprecationWarning``); the classes are built by their own name."""

    def __call__(cls, *args, **kwargs):
        if cls is not OutputSite:
            return super().__call__(*args, **kwargs)
        args = list(args)
        kind = args.pop(0) if args else kwargs.pop("kind", None)
        if kind not in KINDS:
            raise UnsupportedModelError(f"OutputSite kind {kind!r} is not one of {OUTPUT_KINDS}")
        warnings.warn(
            f"OutputSite({kind!r}, ...) is deprecated; build tokenpatch.arch.{KINDS[kind].__name__}(...)",
            DeprecationWarning,
            stacklevel=caller_stacklevel(),
        )
        return KINDS[kind](*args, **kwargs)


@dataclass(frozen=True)
class OutputSite(metaclass=_ByKind):
    """How a layer's patch absorbs its output side (module docstring); a kind is a subclass.

    ``name``: the parameter the shift goes to (a bias, or an output matrix); ``norm``: the scale of a
    norm after the MLP (``ScaledMatrixOutput`` only); ``scale``: the block's multiplier of the MLP
    output, ``residual`` its multiplier of the residual value ``m`` at that add (``out = residual m +
    scale MLP(s)``; a constant, or a ``[d]`` weight of the layer, per channel: Doge's). Indexing (``site[0]``, ``site[1:]``) reads it as the tuple ``(kind, name)`` or ``(kind,
    name, norm)`` of earlier versions; read the fields instead."""

    name: str
    norm: str | None = None
    scale: float = 1.0
    residual: float | Tensor = 1.0

    kind: ClassVar[str] = ""  # the name files and descriptions use
    needs: ClassVar[tuple[str, ...]] = ()  # recorded fields read beyond m and hidden
    affine: ClassVar[bool] = False  # the thought fit has a bias beside the matrix
    plain: ClassVar[bool] = True  # the layer adds the matrix's output as it is (no gate, norm or experts)
    acts_on: ClassVar[str] = "the MLP hidden state with context"  # what a minimal patch divides by (errors)

    def __post_init__(self):
        if self.norm is not None:
            raise UnsupportedModelError(
                f"OutputSite {self.kind!r} ({self.name}): a norm is given to ScaledMatrixOutput ('matrix+scale') only"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names the output side writes: ``(name,)`` or ``(name, norm)``."""
        return (self.name,) if self.norm is None else (self.name, self.norm)

    @property
    def module(self) -> str:
        """The output matrix's module (``name``: its weight, or its bias)."""
        return self.name.rpartition(".")[0]

    @property
    def matrix(self) -> str:
        """The tensor the thought fit changes: the output matrix's weight."""
        return f"{self.module}.weight"

    def __getitem__(self, index):
        return (self.kind, *self.names)[index]

    def __len__(self) -> int:
        return 1 + len(self.names)

    # ------------------------------------------------------------------------- what each kind computes
    def shift(self, m_c: Tensor, m_0: Tensor, rec: LayerRecord) -> Tensor:
        """What the output matrix's output must change by at each query: ``residual (m_C - m_0) / scale``."""
        if isinstance(self.residual, Tensor):  # per channel, a weight of the layer (Doge's): [d]
            shift = solve.output_shift(m_c, m_0, self.scale)
            return shift * self.residual.to(shift.device, shift.dtype)
        return solve.output_shift(m_c, m_0, self.scale / self.residual)

    def token_deltas(self, model: nn.Module, m_c: Tensor, m_0: Tensor, rec: LayerRecord) -> dict[str, Any]:
        """The exact output-side deltas ``[B, Q, ...]`` from ``m_C``, ``m_0`` and the with-context record."""
        return {
            self.name: stored(solve.minimal_patch(self.shift(m_c, m_0, rec), rec.hidden), _layout(model, self.name))
        }

    def target(self, rc: LayerRecord, r0: LayerRecord) -> Tensor:
        """What the layer still misses, ``out_C - out_0`` (the sum a norm after the MLP's add reads,
        where the layer has one), at every recorded position."""
        return rc.sum - r0.sum if rc.sum is not None else rc.out - r0.out

    def fit_pairs(self, model: nn.Module, source: Iterable) -> Iterator[tuple[Tensor, Tensor]]:
        """From ``(rc, r0, v)`` (with-context and no-context records, ``v`` the real positions ``[b, T]``),
        the pairs ``(hidden_0, t)`` ``[N, .]`` with ``dW hidden_0 ~ t``: the missing output over the
        block's factor on it."""
        for rc, r0, v in source:
            t = self.target(rc, r0)[v]  # [N, d]
            yield r0.hidden[v], self.divide(t, r0, v) / self.scale

    def divide(self, t: Tensor, r0: LayerRecord, v: Tensor) -> Tensor:
        """``t`` over what the block multiplies the matrix's output by at those positions (but ``scale``)."""
        return t

    def stream(
        self, model: nn.Module, rec: LayerRecord, out: Tensor, mine: dict, patched: Callable, sum_norm: nn.Module | None
    ) -> Tensor:
        """The layer output with ``mine`` in place, from the no-context pass's record (every position):
        ``out + scale (W' h' - W h')`` (``patched()``: a context with the site's deltas written), or the
        norm after the MLP's add on the sum."""
        down, h = model.get_submodule(self.module), rec.hidden  # [b, T, d_hidden]
        with patched():
            new = down(h)
        change = self.multiply((new - down(h)) * self.scale, rec)
        return out + change if sum_norm is None else sum_norm(rec.sum + change)

    def multiply(self, change: Tensor, rec: LayerRecord) -> Tensor:
        return change


@dataclass(frozen=True)
class BiasOutput(OutputSite):
    """``db = (m_C - m_0) / scale`` on the output bias ``name``."""

    kind: ClassVar[str] = "bias"
    affine: ClassVar[bool] = True
    acts_on: ClassVar[str] = "the MLP input without context"

    def token_deltas(self, model, m_c, m_0, rec):
        return {self.name: self.shift(m_c, m_0, rec)}


@dataclass(frozen=True)
class MatrixOutput(OutputSite):
    """The rank-1 ``(m_C - m_0) h_C^T / (scale |h_C|^2)`` on the output weight ``name``."""

    kind: ClassVar[str] = "matrix"

    @property
    def matrix(self) -> str:
        return self.name


@dataclass(frozen=True)
class GatedOutput(MatrixOutput):
    """A rank-1 patch of the output matrix ``name`` whose output the block scales by ``sigmoid(gate)``
    (a shared expert): the shift is divided by the gate."""

    kind: ClassVar[str] = "gated"
    needs: ClassVar[tuple[str, ...]] = ("gate",)
    plain: ClassVar[bool] = False

    def shift(self, m_c, m_0, rec):
        gate = torch.sigmoid(rec.gate.to(solve.work_dtype(m_c, rec.gate)))  # [B, Q, 1]
        return solve.output_shift(m_c, m_0, 1 / self.residual) / (gate * self.scale)

    def divide(self, t, r0, v):
        return t / torch.sigmoid(r0.gate[v].to(t.dtype))

    def multiply(self, change, rec):
        return change * torch.sigmoid(rec.gate.to(change.dtype))


@dataclass(frozen=True)
class ExpertsOutput(MatrixOutput):
    """The stacked output matrices ``name`` ``[E, out, in]`` of a mixture of experts, read as the one
    matrix ``[D_1 ... D_E]`` on the chosen experts' weighted hidden states ``z`` (``arch.experts``): the
    rank-1 ``(m_C - m_0) z_C^T / |z_C|^2``, split over the chosen experts."""

    kind: ClassVar[str] = "experts"
    plain: ClassVar[bool] = False

    def token_deltas(self, model, m_c, m_0, rec):  # stored [out, E * in], or its transpose ([E, in, out])
        return {
            self.name: stored(solve.minimal_patch(self.shift(m_c, m_0, rec), rec.hidden), _layout(model, self.name))
        }

    def stream(self, model, rec, out, mine, patched, sum_norm):
        delta = stored(mine[self.name].index((0, 0)), _layout(model, self.name))  # [out, E * in]
        change = delta.matvec(rec.hidden.to(delta.dtype))
        return out + (change * self.scale).to(out.dtype)


@dataclass(frozen=True)
class ScaledMatrixOutput(OutputSite):
    """A norm after the MLP (Gemma 2/3: ``out = m + g * unit(W h)``; AFMoE: ``g * unit(W h + routed)``, its
    input ``p``): a rank-1 patch of the output matrix ``name`` plus a dense delta of the norm's scale ``norm``
    (``solve.output_patch_scaled``)."""

    kind: ClassVar[str] = "matrix+scale"
    needs: ClassVar[tuple[str, ...]] = ("out", "p")
    plain: ClassVar[bool] = False

    def __post_init__(self):
        if self.norm is None:
            raise UnsupportedModelError(f"OutputSite 'matrix+scale' ({self.name}): give the norm's scale, norm=")
        if self.scale != 1.0 or self.residual != 1.0:
            raise UnsupportedModelError(f"OutputSite 'matrix+scale' ({self.name}): a norm after the MLP with a scale")

    @property
    def matrix(self) -> str:
        return self.name

    def norm_module(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.norm.rpartition(".")[0])

    def gain(self, model: nn.Module) -> Tensor:
        """The norm's scale ``g = offset + w`` ``[d]`` (Gemma's ``1 + w``)."""
        return scale_norm(self.norm_module(model), self.norm)[1] + offload.value(model, self.norm).detach()

    def token_deltas(self, model, m_c, m_0, rec):
        layout, norm = _layout(model, self.name), self.norm_module(model)
        p = rec.p
        if p is None:  # the output matrix's output as the pass computed it, else computed again
            p = solve.apply_weight(offload.value(model, self.name), rec.hidden, layout)
        down, dscale = solve.output_patch_scaled(rec.out, m_c, m_0, p, rec.hidden, self.gain(model), norm_eps(norm))
        return {self.name: stored(down, layout), self.norm: dscale}

    def fit_pairs(self, model, source):
        """``dW`` aims the norm's input ``p = W h'`` at the direction the norm must output:
        ``unit((out_C - m_0) / g) rms(p)`` (``norm_target``); the scale is fitted after it."""
        norm, g = self.norm_module(model), self.gain(model)
        for rc, r0, v in source:
            yield r0.hidden[v], norm_target(norm, g, rc.out[v] - r0.m[v], r0.p[v])

    def stream(self, model, rec, out, mine, patched, sum_norm):
        """``m + norm'(p + W' h' - W h')``: the norm's recorded input ``p`` moved by the output matrix's
        change (``p`` is more than ``W h'`` where the block adds something beside the matrix: the routed
        experts' output, AFMoE; shared experts' output matrix patched before a norm, AXK1, Kolibri)."""
        down, h = model.get_submodule(self.module), rec.hidden
        before = down(h)
        with patched():
            return rec.m + self.norm_module(model)(rec.p + (down(h) - before))


def norm_target(norm: nn.Module, scale: Tensor, want: Tensor, p: Tensor) -> Tensor:
    """The change of a post-MLP norm's input ``p`` that makes its output point along ``want``.

    ``norm(x) = g * unit(x)`` (``scale``: ``g``, the norm's offset plus its weight) and the layer needs
    ``norm(x) = want`` (``out_C - m_0``: the MLP's output and what the attention still misses). ``unit``
    has unit RMS, so only the direction of ``z = want / g`` can be met: aim ``x`` at ``z`` scaled to
    ``p``'s own RMS (the smallest move of the norm's input that does). With the norm's scale fitted
    after it, exact for one calibration position."""
    unit = scale_norm(norm)[0]
    g = scale.to(want.dtype)
    z = want / g.where(g != 0, 1)  # [..., d]  a zero-scale channel (Gemma has them) is left to the scale fit
    rms = p.square().mean(-1, keepdim=True).add(norm_eps(norm)).sqrt()
    return (unit(norm, z).to(p.dtype) * rms - p).to(want.dtype)  # [..., d]  x* - p


KINDS: dict[str, type[OutputSite]] = {
    cls.kind: cls for cls in (BiasOutput, MatrixOutput, ScaledMatrixOutput, GatedOutput, ExpertsOutput)
}
OUTPUT_KINDS = tuple(KINDS)
