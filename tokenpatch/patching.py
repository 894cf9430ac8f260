"""Model-level token patches: ``token_patch``, ``verify``, ``apply``, ``functional_call``.

The algorithm (science/token_patches.md, section 4.3), for a model with layers ``1..L``:

1. one with-context forward pass gives every layer's input ``h^l`` at every position;
2. the *no-context pass* runs beside it, layer by layer. When all context before a query is
   removed (the default) each query is a sequence of its own; when a chunk ``Y`` is removed it is
   the sequence ``C \\ Y``. Its hidden state at every query position is replaced by the
   with-context one before each layer ``l >= 2``, because the patched layers below reproduce it
   exactly (at layer 1 it is the real no-context embedding);
3. at each layer, ``(m_C, s_C)`` from the with-context pass and ``(m_0, s_0)`` from the no-context
   pass at the query give the layer's patch (``solve.py``): a rank-1 patch of every matrix reading
   the MLP input, plus the output-side term of residual blocks.

So all layers' patches for all queries cost one forward pass, the post-attention part of each
layer once more per query (a lone token's attention output ``W_o v`` reuses the value vector the
full pass computed), and one matrix-vector product per patched matrix, layer and query; nothing
of size ``d_out x d_in`` is formed (``benchmarks/patch_cost.py`` measures it).

Where a patch acts (``Patch.positions``): by default every (batch, query) patch owns a
one-token no-context sequence and acts on all of it. With a chunk removed, patch ``[b, q]`` acts
at the query's position in ``C \\ Y`` only; context positions keep the original weights. That is
what ``functional_call`` and ``verify`` run; ``apply`` (which writes weights, so acts everywhere)
accepts only single patches of the first kind.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import _io, solve
from .arch import Sites, adapter_for, weight_layout
from .delta import Delta, LowRank, Patch
from .errors import InputError, UnsupportedModelError, ZeroAnchorError

__all__ = [
    "Plan",
    "make_plan",
    "token_patch",
    "strip_context",
    "verify",
    "Verification",
    "LayerError",
    "apply",
    "functional_call",
]


# ------------------------------------------------------------------------------ query plans


@dataclass(frozen=True)
class Plan:
    """Which positions are queries and which context is removed, for sequences of ``seq_len``.

    ``query``: with-context positions whose outputs the patch reproduces, in patch order.
    ``kept``: positions of ``C \\ Y`` when a chunk is removed; ``None`` when every query keeps
    only itself (all context before it removed).
    """

    seq_len: int
    query: tuple[int, ...]
    kept: tuple[int, ...] | None = None

    @property
    def positions(self) -> tuple[int, ...] | None:
        """Query positions in the no-context sequence (``None``: each query alone)."""
        if self.kept is None:
            return None
        where = {p: i for i, p in enumerate(self.kept)}
        return tuple(where[q] for q in self.query)

    def describe(self) -> dict:
        removed = None if self.kept is None else sorted(set(range(self.seq_len)) - set(self.kept))
        return {"seq_len": self.seq_len, "query": list(self.query), "removed": removed}

    @classmethod
    def from_meta(cls, meta: dict) -> "Plan":
        removed = meta.get("removed")
        kept = None if removed is None else tuple(p for p in range(meta["seq_len"]) if p not in set(removed))
        return cls(meta["seq_len"], tuple(meta["query"]), kept)


def _as_int(q: Any) -> int:
    if not isinstance(q, bool) and not (isinstance(q, Tensor) and q.dtype == torch.bool):
        try:
            return operator.index(q)  # ints, numpy integers, integer 0-d tensors
        except TypeError:
            pass
    raise InputError(f"query positions must be integers, got {q!r}")


def _removed_mask(seq_len: int, remove: Any) -> list[bool] | None:
    """``remove`` (None, a slice, or a boolean mask ``[seq_len]``) as a list of bools."""
    if remove is None:
        return None
    if isinstance(remove, slice):
        chosen = set(range(seq_len)[remove])
        removed = [p in chosen for p in range(seq_len)]
    else:
        mask = torch.as_tensor(remove)
        if mask.dtype != torch.bool:
            raise InputError(f"remove must be a slice or a boolean mask of length {seq_len}, got dtype {mask.dtype}")
        if mask.shape != (seq_len,):
            raise InputError(f"remove mask has shape {tuple(mask.shape)}; the sequence has {seq_len} positions")
        removed = mask.tolist()
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
        if hasattr(query, "tolist"):  # tensors and arrays
            query = query.tolist()
        positions = [_as_int(q) for q in query] if isinstance(query, (list, tuple, range)) else [_as_int(query)]
    if not positions:
        raise InputError(f"query {query!r} selects no position of a sequence of length {seq_len}")
    for q in positions:
        if not -seq_len <= q < seq_len:
            raise InputError(f"query position {q} is outside the sequence of length {seq_len}")
    out = [q % seq_len for q in positions]
    if len(set(out)) != len(out):
        raise InputError(f"query positions repeat: {out}")
    return out


def make_plan(seq_len: int, query: Any = -1, remove: Any = None) -> Plan:
    """Normalise ``query`` and ``remove`` (see ``token_patch``) into a ``Plan``; clear errors."""
    removed = _removed_mask(seq_len, remove)
    kept = list(range(seq_len)) if removed is None else [p for p in range(seq_len) if not removed[p]]
    query = _query_positions(seq_len, query, kept)
    if removed is not None:
        inside = [q for q in query if removed[q]]
        if inside:
            raise InputError(f"query positions {inside} lie inside the removed chunk")
    return Plan(seq_len, tuple(query), None if removed is None else tuple(kept))


# ------------------------------------------------------------------------------ token_patch


def strip_context(model: nn.Module, inputs: Any, query: Any = -1, remove: Any = None) -> Any:
    """The no-context inputs a patch from ``token_patch(model, inputs, query, remove)`` runs on.

    Default ``remove``: every query alone, ``[batch * query, 1, ...]`` batch-major, matching the
    flattened ``[batch, query]`` patch. With a chunk removed: ``[batch, len(C \\ Y), ...]``.
    """
    adapter = adapter_for(model)
    plan = make_plan(adapter.seq_len(inputs), query, remove)
    return _strip(adapter, inputs, plan)


def _strip(adapter, inputs, plan: Plan):
    if plan.kept is None:
        return adapter.strip(inputs, torch.tensor(plan.query), separate=True)
    return adapter.strip(inputs, torch.tensor(plan.kept), separate=False)


def _take(t: Tensor, positions: list[int]) -> Tensor:
    """``t[:, positions]``, without a copy when ``positions`` is every position in order."""
    return t if positions == list(range(t.shape[1])) else t[:, positions]


def _gather(t: Tensor, plan: Plan, batch: int) -> Tensor:
    """No-context tensor ``t`` -> values at the queries ``[batch, query, ...]``."""
    if plan.kept is None:
        return t.reshape(batch, len(plan.query), *t.shape[2:])  # each query was its own sequence
    return t[:, list(plan.positions)]


def _math_weight(model: nn.Module, name: str) -> tuple[Tensor, str]:
    """A weight as the matrix applied to inputs (``[out, in]``) and its storage layout."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    layout = weight_layout(module, name)
    w = getattr(module, attr)
    return (w if layout == "out_in" else w.T), layout


def _stored(delta: LowRank, layout: str) -> LowRank:
    """Factors ``(out-side, in-side)`` of the math, in the parameter's storage layout."""
    return delta if layout == "out_in" else LowRank(delta.v, delta.u)


def _layer_patch(model, sites: Sites, ctx, anchor, layer: int, plan: Plan) -> dict[str, Delta]:
    """The layer's deltas from with-context ``ctx = (m, s, hidden)`` and ``anchor = (m, s)``,
    each ``[batch, query, ...]``."""
    (m_c, s_c, hidden_c), (m_0, s_0) = ctx, anchor
    deltas: dict[str, Delta] = {}
    acts_on = "the MLP input without context"
    try:
        for name in sites.inputs:
            w, layout = _math_weight(model, name)
            deltas[name] = _stored(solve.input_patch(w, s_c, s_0), layout)
        if sites.output is not None:
            kind, name = sites.output
            if kind == "bias":
                deltas[name] = solve.output_shift(m_c, m_0)
            else:
                acts_on = "the MLP hidden state with context"
                deltas[name] = _stored(solve.output_patch(m_c, m_0, hidden_c), _math_weight(model, name)[1])
    except ZeroAnchorError as exc:
        where = [(b, plan.query[q]) for b, q in exc.index]
        raise ZeroAnchorError(
            f"layer {layer}: no minimal patch of {name} exists at (batch, query position) {where[:5]}: "
            f"the vector it acts on ({acts_on}) is zero, yet the context changes what it must produce",
            where,
        ) from None
    except InputError as exc:
        raise InputError(f"layer {layer}, {name}: {exc} (are the model's weights and activations finite?)") from None
    return deltas


@torch.no_grad()
def token_patch(model: nn.Module, inputs: Any, query: Any = -1, remove: Any = None, *, progress: bool = True) -> Patch:
    """Exact token patches of every layer, for every sequence and query position.

    ``inputs``: ``[batch, pos, d]`` embeddings for our models (token ids ``[batch, pos]`` for
    language models). ``query``: an int (default ``-1``, the last position), a list of ints, a
    slice or ``"all"``. ``remove``: ``None`` removes all context before each query; a slice or
    a boolean mask ``[pos]`` removes that chunk ``Y`` (shared by the batch) instead.

    Returns a ``Patch`` with deltas ``[batch, query, ...]`` such that the model without the
    removed context and with the patch reproduces, at each query, the with-context hidden state
    of every layer and the output (``verify`` checks it). Per layer (science 2.1-2.2, 3, 4.3):
    ``dW = W (s_C - s_0) s_0^T / |s_0|^2`` on each matrix reading the MLP input, plus
    ``m_C - m_0`` on the output bias (or rank-1 on the output matrix) for residual blocks.
    Raises ``ZeroAnchorError`` (naming layer, parameter and position) where no patch exists.

    With a chunk removed and several queries, a sequence's patches act together: the no-context
    pass runs every query with its patch, so a later query's anchor sees the earlier queries
    patched (``functional_call`` runs them the same way). Ask for one query per call for patches
    that stand alone.
    """
    adapter = adapter_for(model)
    inputs = adapter.check_inputs(model, inputs)
    batch = adapter.batch_size(inputs)
    plan = make_plan(adapter.seq_len(inputs), query, remove)
    q = list(plan.query)
    h = adapter.embed(model, inputs)  # [B, T, d]      with context
    shared = plan.kept is None and not adapter.position_dependent_embedding
    h0 = None if shared else adapter.embed(model, _strip(adapter, inputs, plan))  # [B*Q, 1, d] or [B, T', d]
    deltas: dict[str, Delta] = {}
    n_layers = adapter.n_layers(model)
    for i in tqdm(range(n_layers), desc="token_patch", unit="layer", disable=not progress, delay=1.0):
        if plan.kept is None and (i > 0 or shared):
            # each query alone, on its with-context state: share the full pass's work
            (m_c, s_c), anchor = adapter.mix_with_alone(model, i, h, q)
        else:
            m_c, s_c = adapter.mix(model, i, h)
            m_0, s_0 = adapter.mix(model, i, h0)
            anchor = (_gather(m_0, plan, batch), _gather(s_0, plan, batch))
        hidden_c, out_c = adapter.finish(model, i, m_c, s_c)
        ctx = (_take(m_c, q), _take(s_c, q), _take(hidden_c, q))  # each [B, Q, .]
        deltas.update(_layer_patch(model, adapter.sites(model, i), ctx, anchor, i, plan))
        if plan.kept is not None and i + 1 < n_layers:
            # next no-context states: unpatched at context positions, with-context at the queries
            # (the patched layer reproduces them exactly)
            h0 = adapter.finish(model, i, m_0, s_0)[1].clone()
            h0[:, list(plan.positions)] = out_c[:, q]
        h = out_c
    meta = {
        "model": {**adapter.describe(model), "fingerprint": _io.fingerprint(model)},
        **plan.describe(),
        "batch": batch,
        "model_dtype": str(h.dtype).removeprefix("torch."),
    }
    return Patch(deltas, plan.positions, meta)


# ------------------------------------------------------------------------------ applying


@contextlib.contextmanager
def _hooked(model: nn.Module, patch: Patch) -> Iterator[None]:
    """Forward hooks that add each delta's contribution ``u (v . x)`` (and dense bias deltas)
    to the outputs of the patched modules; removed on exit, exceptions included."""
    by_module: dict[str, dict[str, Delta]] = {}
    for name, delta in patch.items():
        module_name, _, attr = name.rpartition(".")
        by_module.setdefault(module_name, {})[attr] = delta
    handles = []
    try:
        for module_name, deltas in by_module.items():
            module = model.get_submodule(module_name)
            if set(deltas) - {"weight", "bias"} or (
                isinstance(deltas.get("weight"), Tensor) or isinstance(deltas.get("bias"), LowRank)
            ):
                raise UnsupportedModelError(
                    f"cannot apply deltas {sorted(deltas)} to {module_name} ({type(module).__name__}): "
                    "functional_call supports low-rank weight and dense bias deltas of linear layers"
                )
            layout = weight_layout(module, module_name) if "weight" in deltas else "out_in"
            handles.append(module.register_forward_hook(_make_hook(deltas, layout, patch.positions, module_name)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _make_hook(deltas: dict[str, Delta], layout: str, positions, module_name: str):
    """Hook adding ``u (v . x) + db`` to a linear module's output, per (batch, query) patch."""
    w, b = deltas.get("weight"), deltas.get("bias")
    lead = w.lead if w is not None else tuple(b.shape[:2])
    if w is not None:  # factors on the input and output side of the weight
        w_in, w_out = (w.v, w.u) if layout == "out_in" else (w.u, w.v)  # [B, Q, r, in], [B, Q, r, out]
    pos = None if positions is None else torch.tensor(positions)

    def work(x: Tensor) -> torch.dtype:  # low-rank terms in at least float32, cast once at the end
        return torch.promote_types(torch.promote_types(x.dtype, (w if w is not None else b).dtype), torch.float32)

    def flat(t: Tensor, n: int) -> Tensor:  # [B, Q, ...] -> [N, ...]: sequence b*Q + q gets patch [b, q]
        if lead[0] == 1 and lead[0] * lead[1] != n:  # one batch row of patches repeats over the batch
            t = t.expand(n // lead[1], *t.shape[1:])
        return t.flatten(0, 1)

    def everywhere(x: Tensor, out: Tensor) -> Tensor:  # patch [b, q] acts on all of sequence b*Q + q
        n = x.shape[0]
        if not (lead[0] * lead[1] == n or (lead[0] == 1 and n % lead[1] == 0)):
            raise InputError(
                f"{module_name}: the patch holds {lead[0]} x {lead[1]} (batch x query) patches, one per no-context "
                f"sequence, but the input batch is {n} (tokenpatch.strip_context gives the right inputs)"
            )
        dt = work(x)
        xs = x.reshape(n, -1, x.shape[-1]).to(dt)  # [N, T, in]
        delta = torch.zeros((), dtype=dt, device=out.device)
        if w is not None:
            coef = xs @ flat(w_in, n).to(xs).transpose(-1, -2)  # [N, T, r]
            delta = coef @ flat(w_out, n).to(xs)  # [N, T, out]
        if b is not None:
            delta = delta + flat(b, n).to(device=out.device, dtype=dt)[:, None, :]  # [N, 1, out]
        return (out.reshape(n, -1, out.shape[-1]) + delta).to(out.dtype).reshape(out.shape)

    def at_positions(x: Tensor, out: Tensor) -> Tensor:  # patch [b, q] acts at position positions[q]
        n = x.shape[0]
        if lead[0] not in (1, n) or x.ndim != 3 or x.shape[1] <= max(positions):
            raise InputError(
                f"{module_name}: the patch acts at positions {list(positions)} of {lead[0]} no-context sequence(s) "
                f"[batch, pos, d], got input {tuple(x.shape)} (tokenpatch.strip_context gives the right inputs)"
            )
        where, dt = pos.to(x.device), work(x)
        xs = x[:, where].to(dt)  # [N, Q, in]
        delta = torch.zeros((), dtype=dt, device=out.device)
        if w is not None:
            coef = torch.einsum("nqi,nqri->nqr", xs, w_in.to(xs).expand(n, -1, -1, -1))  # [N, Q, r]
            delta = torch.einsum("nqr,nqro->nqo", coef, w_out.to(xs).expand(n, -1, -1, -1))  # [N, Q, out]
        if b is not None:
            delta = delta + b.to(device=out.device, dtype=dt).expand(n, -1, -1)  # [N, Q, out]
        patched = out[:, where].to(dt) + delta.expand(n, len(positions), out.shape[-1])
        return out.index_copy(1, where, patched.to(out.dtype))

    run = everywhere if positions is None else at_positions

    def hook(module, args, out):
        return run(args[0], out)

    return hook


def functional_call(model: nn.Module, patch: Patch, *args, **kwargs):
    """``model(*args, **kwargs)`` with ``patch`` applied in the forward, nothing mutated.

    Each patched linear computes ``W x + b + u (v . x) + db`` (factors never multiplied out).
    Inputs as ``strip_context`` gives them: with ``patch.positions`` ``None``, input sequence
    ``b * Q + q`` uses patch ``[b, q]`` at every position (a single patch broadcasts to any
    batch); otherwise patch ``[b, q]`` acts at position ``positions[q]`` of sequence ``b``.
    Differentiable with respect to the model's parameters and the patch factors.

    The deltas ride on forward hooks registered for this call and removed afterwards (also on
    error): weights are never touched, but another thread running the same model meanwhile
    would see the patch. (``torch.func.functional_call`` substitutes whole parameters, which
    would mean materialising ``W + u v^T`` per patch, and cannot vary them along the batch.)
    """
    return _patched_run(None, model, patch, *args, **kwargs)


@contextlib.contextmanager
def apply(model: nn.Module, patch: Patch) -> Iterator[nn.Module]:
    """Context manager: write ``W + delta`` into the model's weights; restore them bit-exactly
    on exit, also when the body raises.

    Only a single patch (``patch.lead == (1, 1)``, e.g. ``patch[b, q]``) acting everywhere can be
    written into weights; position-specific patches (a chunk removed from the middle of a deep
    model) need ``functional_call``. The delta is materialised here, cast to the weight's dtype.
    """
    if patch.lead != (1, 1):
        raise InputError(
            f"apply() writes one set of weights but the patch holds {patch.lead[0]} x {patch.lead[1]} "
            "(batch x query) patches; pick one with patch[b, q], or use functional_call"
        )
    if patch.positions is not None:
        raise InputError(
            f"this patch acts only at position {patch.positions[0]} of the no-context sequence (a chunk "
            "was removed mid-sequence); written into weights it would change the context tokens too. "
            "Use functional_call"
        )
    patch.check_model(model)
    params = dict(model.named_parameters())
    saved: dict[str, Tensor] = {}
    try:
        with torch.no_grad():
            for name, delta in patch.items():
                p = params[name]
                saved[name] = p.detach().clone()
                dense = delta.dense()[0, 0] if isinstance(delta, LowRank) else delta[0, 0]
                p.add_(dense.to(device=p.device, dtype=p.dtype))
        yield model
    finally:
        with torch.no_grad():
            for name, original in saved.items():
                params[name].copy_(original)


# ------------------------------------------------------------------------------ verify


@dataclass(frozen=True)
class LayerError:
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

    per_layer: list[LayerError]
    dtype: str
    n: int = 0  # number of (batch, query) pairs compared
    meta: dict = field(default_factory=dict)

    @property
    def max_abs(self) -> float:
        return max(e.max_abs for e in self.per_layer)

    @property
    def max_rel(self) -> float:
        return max(e.max_rel for e in self.per_layer)

    @property
    def max_rel_unfloored(self) -> float:
        return max(e.max_rel_unfloored for e in self.per_layer)

    def ok(self, tol: float = 1e-4) -> bool:
        """Every site's max relative error is at most ``tol``."""
        return self.max_rel <= tol

    def table(self) -> str:
        rows = [f"{'site':>10}  {'max abs':>10}  {'max rel':>10}  {'(unfloored)':>11}"]
        rows += [f"{e.name:>10}  {e.max_abs:10.2e}  {e.max_rel:10.2e}  {e.max_rel_unfloored:11.2e}" for e in self.per_layer]
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "n": self.n, "max_abs": self.max_abs, "max_rel": self.max_rel,
                "max_rel_unfloored": self.max_rel_unfloored,
                "per_layer": [asdict(e) for e in self.per_layer], "meta": self.meta}

    def __str__(self) -> str:
        return f"Verification({self.dtype}, {self.n} queries, max abs {self.max_abs:.2e}, max rel {self.max_rel:.2e})"


def _error(name: str, got: Tensor, ref: Tensor) -> LayerError:
    ref = ref.double().reshape(*ref.shape[:2], -1)  # [B, Q, F]
    diff = got.double().reshape(ref.shape) - ref
    ref_norm = ref.norm(dim=-1)  # [B, Q]
    rms = ref_norm.square().mean().sqrt()
    err = diff.norm(dim=-1)  # [B, Q]
    floored = err / (torch.maximum(ref_norm, rms) if rms > 0 else torch.ones_like(ref_norm))
    plain = torch.where(ref_norm > 0, err / ref_norm.clamp_min(torch.finfo(torch.float64).tiny), err)
    return LayerError(name, float(diff.abs().max()), float(floored.max()), float(plain.max()))


@torch.no_grad()
def verify(model: nn.Module, inputs: Any, patch: Patch, query: Any = None, remove: Any = None) -> Verification:
    """Run the with-context pass and the patched no-context pass; compare at every query.

    ``query`` / ``remove`` default to the ones recorded in the patch; the patch must hold one
    row per input sequence. Sites: the output hidden state of each layer (``layer 0 .. L-1``)
    and the model output (``output``; a bare ``Block`` has only this one). Both passes are the
    model's own forward; the patched one goes through ``functional_call``.
    """
    adapter = adapter_for(model)
    inputs = adapter.check_inputs(model, inputs)
    seq_len, batch = adapter.seq_len(inputs), adapter.batch_size(inputs)
    if query is None and remove is None and "query" in patch.meta:
        plan = Plan.from_meta(patch.meta)
        if plan.seq_len != seq_len:
            raise InputError(f"the patch was made for sequences of length {plan.seq_len}, inputs have {seq_len}")
    else:
        plan = make_plan(seq_len, -1 if query is None else query, remove)
        made = {k: patch.meta[k] for k in ("seq_len", "query", "removed") if k in patch.meta}
        if made and made != {k: plan.describe()[k] for k in made}:
            raise InputError(f"the patch was made for {made}, not for {plan.describe()}")
    if patch.lead != (batch, len(plan.query)):  # each row's patch is checked against that row
        rows = patch.meta.get("batch_index")
        hint = f" (it holds the patches of rows {rows} of the batch it was made from)" if rows is not None else ""
        raise InputError(f"patch holds [batch, query] = {list(patch.lead)} patches{hint}; inputs and query give "
                         f"[{batch}, {len(plan.query)}]")
    if patch.positions != plan.positions:
        raise InputError(f"the patch acts at positions {patch.positions} but this query/remove needs {plan.positions}")
    out_c, hid_c = adapter.run(model, inputs)
    out_0, hid_0 = _patched_run(adapter, model, patch, _strip(adapter, inputs, plan))
    q = list(plan.query)
    errors = [_error(f"layer {i}", _gather(g, plan, batch), r[:, q]) for i, (g, r) in enumerate(zip(hid_0, hid_c))]
    errors.append(_error("output", _gather(out_0, plan, batch), out_c[:, q]))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Verification(errors, dtype, batch * len(q), plan.describe())


def _patched_run(adapter, model, patch: Patch, *args, **kwargs):
    """``adapter.run`` (or the plain forward when ``adapter`` is None) under ``patch``'s hooks."""
    patch.check_model(model)
    with _hooked(model, patch):
        return model(*args, **kwargs) if adapter is None else adapter.run(model, *args, **kwargs)
