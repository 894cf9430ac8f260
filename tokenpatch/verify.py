"""``verify``: the patched no-context pass against the with-context pass, site by site.

The error metric and the one tolerance rule of the library live here (``docs/verification.md``).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch.arch import adapter_for
from tokenpatch.arch.norms import float32_scale_norms
from tokenpatch.errors import InputError, caller_stacklevel
from tokenpatch.patch import Patch
from tokenpatch.plans import Plan, at_queries, make_plan, refuse_padded_queries, strip
from tokenpatch.run import patched_run

__all__ = ["SiteError", "Verification", "TOLERANCES", "REAL_MODEL_RULE", "tolerance", "verify"]

# The one tolerance rule, by model dtype: (metric, bound). Equivalence is algebra, so float64
# errors are rounding (~1e-15) and an absolute bound is meaningful; in lower precision the error
# scales with the activations, so the bound is on the relative error.
# One named rule beside them: real pretrained weights in float32, per layer. The one-token patched
# pass amplifies rounding with depth (~100x by the last layer of SmolLM2-135M), so on real models the
# per-layer relative error is held to 1e-3 (tests, ``tokenpatch verify --model``, the report).
TOLERANCES: dict[str, tuple[str, float]] = {
    "float64": ("max_abs", 1e-10),
    "float32": ("max_rel", 1e-4),
    "float16": ("max_rel", 1e-2),
    "bfloat16": ("max_rel", 5e-2),
    "float32_real_model": ("max_rel", 1e-3),
}
REAL_MODEL_RULE = "float32_real_model"


def tolerance(dtype: torch.dtype | str) -> tuple[str, float]:
    """``(metric, bound)`` of the tolerance rule for a model computing in ``dtype``, or of a rule by name
    (``"float32_real_model"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in TOLERANCES:
        raise InputError(f"no tolerance is defined for {name}; known: {sorted(TOLERANCES)} (pass tol= explicitly)")
    return TOLERANCES[name]


@dataclass(frozen=True)
class SiteError:
    """Errors at one site (a layer's output hidden state, or the model output) over all
    (batch, query) pairs, computed in float64:

    ``max_abs = max |got - ref|`` (elementwise);
    ``max_rel = max_(b,q) |got - ref|_2 / max(|ref|_2, rms)``: the relative error of each query's
    vector, its denominator floored at the site's RMS vector norm ``rms = sqrt(mean_(b,q) |ref|_2^2)``
    so that a vector near zero (a scalar prediction close to 0) is measured against the site's
    typical size instead of blowing up;
    ``max_rel_unfloored = max_(b,q) |got - ref|_2 / |ref|_2``: the same without the floor (the
    absolute error where ``ref`` is exactly 0).
    """

    name: str
    max_abs: float
    max_rel: float
    max_rel_unfloored: float


@dataclass(frozen=True)
class Verification:
    """Patched no-context pass vs with-context pass, per layer output and on the model output."""

    per_layer: list[SiteError]
    dtype: str
    n: int = 0  # number of (batch, query) pairs compared
    meta: dict = field(default_factory=dict)
    # patched norms that compute in float32 whatever the model dtype (``arch.norms.float32_scale_norms``):
    # a float64 model is exact only to float32 rounding there (~1e-7 relative)
    float32_sites: tuple[str, ...] = ()

    @property
    def why(self) -> str:
        """Why a float64 model's errors are above float64 rounding, when the model says so; else ``""``."""
        if not self.float32_sites:
            return ""
        more = f" and {len(self.float32_sites) - 1} more" if len(self.float32_sites) > 1 else ""
        return (
            f"the patched norm scales of {self.float32_sites[0]}{more} compute in float32 whatever the "
            "model dtype (transformers casts them), so float64 errors there are float32 rounding (~1e-7 "
            "relative); run under `with tokenpatch.testing.float64_norms():` for float64 exactness"
        )

    @property
    def max_abs(self) -> float:
        return max(e.max_abs for e in self.per_layer)

    @property
    def max_rel(self) -> float:
        return max(e.max_rel for e in self.per_layer)

    @property
    def max_rel_unfloored(self) -> float:
        return max(e.max_rel_unfloored for e in self.per_layer)

    @property
    def target(self) -> str:
        """The tolerance rule for this dtype, in words: e.g. ``"max rel <= 1e-04"``."""
        metric, bound = tolerance(self.dtype)
        return f"{metric.replace('_', ' ')} <= {bound:g}"

    def ok(self, tol: float | None = None, rule: str | None = None) -> bool:
        """Whether the errors meet the tolerance rule of the model's dtype (``TOLERANCES``:
        float64 max abs <= 1e-10, float32 max rel <= 1e-4, ...), or the rule named ``rule`` (e.g.
        ``REAL_MODEL_RULE`` for real weights in float32); ``tol`` replaces the bound."""
        name = rule or self.dtype
        if tol is not None and name not in TOLERANCES:
            return self.max_rel <= tol
        metric, bound = tolerance(name)
        return getattr(self, metric) <= (bound if tol is None else tol)

    def table(self) -> str:
        rows = [f"{'site':>10}  {'max abs':>10}  {'max rel':>10}  {'(unfloored)':>11}"]
        rows += [
            f"{e.name:>10}  {e.max_abs:10.2e}  {e.max_rel:10.2e}  {e.max_rel_unfloored:11.2e}" for e in self.per_layer
        ]
        if self.why:
            rows.append(f"note: {self.why}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "n": self.n,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "max_rel_unfloored": self.max_rel_unfloored,
            "per_layer": [asdict(e) for e in self.per_layer],
            "meta": self.meta,
            "float32_sites": list(self.float32_sites),
        }

    def __str__(self) -> str:
        why = f"; {self.why}" if self.why else ""
        return (
            f"Verification({self.dtype}, {self.n} queries, max abs {self.max_abs:.2e}, max rel {self.max_rel:.2e}{why})"
        )


def site_error(name: str, got: Tensor, ref: Tensor) -> SiteError:
    """``SiteError`` of ``got`` against ``ref``, both ``[batch, query, ...]``."""
    ref = ref.double().reshape(*ref.shape[:2], -1)  # [B, Q, F]
    diff = got.double().reshape(ref.shape) - ref
    ref_norm = ref.norm(dim=-1)  # [B, Q]
    rms = ref_norm.square().mean().sqrt()
    err = diff.norm(dim=-1)  # [B, Q]
    floored = err / (torch.maximum(ref_norm, rms) if rms > 0 else torch.ones_like(ref_norm))
    plain = torch.where(ref_norm > 0, err / ref_norm.clamp_min(torch.finfo(torch.float64).tiny), err)
    return SiteError(name, float(diff.abs().max()), float(floored.max()), float(plain.max()))


def _plan_for(patch: Patch, seq_len: int, query: Any, remove: Any) -> Plan:
    """The plan ``verify`` checks: the patch's own record, or the one asked (which must agree)."""
    if query is None and remove is None and patch.plan is not None:
        plan = patch.plan
        if plan.seq_len != seq_len:
            raise InputError(f"the patch was made for sequences of length {plan.seq_len}, inputs have {seq_len}")
        return plan
    plan = make_plan(seq_len, -1 if query is None else query, remove)
    if patch.plan is not None and patch.plan != plan:
        raise InputError(f"the patch was made for {patch.plan.describe()}, not for {plan.describe()}")
    return plan


@torch.no_grad()
def verify(model: nn.Module, patch: Patch, inputs: Any, query: Any = None, remove: Any = None) -> Verification:
    """Run the with-context pass and the patched no-context pass; compare at every query.

    ``verify(model, patch, inputs)``: the model, then the patch, then what it runs on, as in
    ``functional_call(model, patch, ...)`` and ``apply(model, patch)``. (The 0.2 order
    ``verify(model, inputs, patch)`` still works, with a ``DeprecationWarning``.)

    ``query`` / ``remove`` default to the ones recorded in the patch; the patch must hold one
    row per input sequence. Sites: the output hidden state of each layer (``layer 0 .. L-1``)
    and the model output (``output``; a bare ``Block`` has only this one). Both passes are the
    model's own forward; the patched one goes through the hooks of ``functional_call``.
    ``result.ok()`` applies the library's tolerance rule for the model's dtype.
    """
    if not isinstance(patch, Patch) and isinstance(inputs, Patch):  # the 0.2 order
        warnings.warn(
            "tp.verify(model, inputs, patch) is deprecated: the patch comes second, as in "
            "functional_call: tp.verify(model, patch, inputs)",
            DeprecationWarning,
            stacklevel=caller_stacklevel(),
        )
        patch, inputs = inputs, patch
    if not isinstance(patch, Patch):
        raise InputError(
            f"verify(model, patch, inputs): the second argument must be a tp.Patch, got {type(patch).__name__}"
        )
    adapter = adapter_for(model)
    inputs = adapter.check_inputs(model, inputs)
    seq_len, batch = adapter.seq_len(inputs), adapter.batch_size(inputs)
    plan = _plan_for(patch, seq_len, query, remove)
    refuse_padded_queries(adapter.padding(inputs), plan.query)  # in every mode, as token_patch
    if patch.lead != (batch, len(plan.query)):  # each row's patch is checked against that row
        rows = None if patch.rows is None else list(patch.rows)
        hint = f" (it holds the patches of rows {rows} of the batch it was made from)" if rows is not None else ""
        raise InputError(
            f"patch holds [batch, query] = {list(patch.lead)} patches{hint}; inputs and query give "
            f"[{batch}, {len(plan.query)}]"
        )
    want = plan.positions if plan.mode == "chunk" else ()
    if patch.positions != want:
        raise InputError(
            f"the patch acts {patch.where()} but this query/remove needs it to act "
            f"{'at positions ' + str(list(want)) if want else 'everywhere'}"
        )
    out_c, hid_c = adapter.run(model, inputs)
    out_0, hid_0 = patched_run(lambda x: adapter.run(model, x), model, patch, strip(adapter, inputs, plan))
    q = list(plan.query)
    errors = [
        site_error(f"layer {i}", at_queries(g, plan, batch), r[:, q]) for i, (g, r) in enumerate(zip(hid_0, hid_c))
    ]
    errors.append(site_error("output", at_queries(out_0, plan, batch), out_c[:, q]))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    float32 = tuple(float32_scale_norms(model, patch)) if dtype == "float64" else ()
    return Verification(errors, dtype, batch * len(q), plan.describe(), float32)
