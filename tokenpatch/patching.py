"""The algorithm: ``token_patch`` gives every layer's patch from one with-context pass.

For a model with layers ``0..L-1`` (``docs/deep-models.md`` has the derivation):

1. one with-context forward pass gives every layer's input ``h^l`` at every position;
2. the *no-context pass* runs beside it, layer by layer (``plans.py`` says which: each query
   alone, or the sequence ``C \\ Y`` with a chunk removed). Its hidden state at every query is
   replaced by the with-context one before each layer after the first, because the patched layers
   below reproduce it exactly (before the first layer it is the real no-context embedding);
3. at each layer, ``(m_C, s_C)`` from the with-context pass and ``(m_0, s_0)`` from the no-context
   pass at the query give the layer's patch (``solve.py``): a rank-1 patch of every matrix reading
   the MLP input, plus the output-side term of residual blocks.

So all layers' patches for all queries cost one forward pass, the post-attention part of each
layer once more per query (a lone token's attention output ``W_o v`` reuses the value vector the
full pass computed), and one matrix-vector product per patched matrix, layer and query; nothing
of size ``d_out x d_in`` is formed (``benchmarks/patch_cost.py`` measures it).

Where a patch acts (``Patch.acts``): in alone mode every (batch, query) patch owns a length-1
no-context sequence and acts on all of it (``"everywhere"``). With a chunk removed, patch
``[b, q]`` acts at the query's position in ``C \\ Y`` only (``"at_positions"``); context
positions keep the original weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import files, offload, solve
from tokenpatch.arch import Sites, adapter_for, weight_layout
from tokenpatch.arch.outputs import stored
from tokenpatch.arch.record import LayerRecord
from tokenpatch.errors import InputError, UnsupportedModelError, ZeroAnchorError
from tokenpatch.patch import INPUT_SUFFIX, Delta, Patch
from tokenpatch.plans import Plan, made_on, make_plan, refuse_padded_queries, strip
from tokenpatch.progress import progress_bar

__all__ = ["token_patch", "strip_context", "layer_patch", "take"]


def strip_context(model: nn.Module, inputs: Any, query: Any = -1, remove: Any = None, *, keep_bos: bool = False) -> Any:
    """The no-context inputs a patch from ``token_patch(model, inputs, query, remove, keep_bos=...)`` runs on.

    Default ``remove``: every query alone, ``[batch * query, 1, ...]`` batch-major, matching the
    flattened ``[batch, query]`` patch. With a chunk removed: ``[batch, len(C \\ Y), ...]``. For a
    language model, a dict of the forward's keyword arguments (``input_ids``, ``position_ids``: each
    token keeps its original position).
    """
    adapter = adapter_for(model)
    inputs = adapter.check_inputs(model, inputs)
    return strip(adapter, inputs, _plan(adapter, inputs, query, remove, keep_bos))


def _plan(adapter, inputs: Any, query: Any, remove: Any, keep_bos: bool):
    """The plan of ``query`` / ``remove``; ``keep_bos``: remove everything but the first token and the
    queries. Padding is refused the same way in every mode (``refuse_padded_queries``)."""
    seq_len, pad = adapter.seq_len(inputs), adapter.padding(inputs)
    if not keep_bos:
        plan = make_plan(seq_len, query, remove)
        refuse_padded_queries(pad, plan.query)
        return plan
    if remove is not None:
        raise InputError("keep_bos=True removes all context but the first token; do not pass remove as well")
    queries = make_plan(seq_len, query).query
    refuse_padded_queries(pad, queries)
    if pad is not None and bool(pad[:, 0].any()):
        rows = [int(b) for b in pad[:, 0].nonzero()[:, 0]]
        raise InputError(
            f"keep_bos=True keeps position 0, which is padding in batch rows {rows[:5]} (a left-padded row "
            "starts later): pass rows of one length without padding, one call per length"
        )
    removed = [0 < p and p not in queries for p in range(seq_len)]
    if not any(removed[: max(queries)]):  # what a query never saw is no context of it
        raise InputError(
            f"keep_bos=True: there is no context to remove (up to the last query, the positions are the first "
            f"token and the queries {list(queries)}): pass a longer prompt, or drop keep_bos"
        )
    return make_plan(seq_len, query, torch.tensor(removed))  # a boolean mask


def take(t: Tensor, positions: list[int]) -> Tensor:
    """``t[:, positions]``, without a copy when ``positions`` is every position in order."""
    return t if positions == list(range(t.shape[1])) else t[:, positions]


def layer_patch(
    model,
    sites: Sites,
    ctx,
    anchor,
    layer: int,
    labels,
    out_c: Tensor | None = None,
    gate_c: Tensor | None = None,
    down_c: Tensor | None = None,
) -> dict[str, Delta]:
    """The layer's deltas from its with-context record ``ctx`` (``LayerRecord`` at the queries: ``m, s,
    hidden``, and what the output kind ``needs``: ``out``, ``gate``, ``p``) and ``anchor = (m_0, s_0)``,
    each ``[batch, query, ...]``; ``labels[q]`` names query ``q`` in errors (its position). The input
    side is the minimal change of the MLP input (``Sites.input_site``) or a rank-1 patch of each matrix
    reading it; the output side is the output kind's own (``OutputSite.token_deltas``, ``arch.outputs``).
    A tuple ``(m, s, hidden)`` with ``out_c``, ``gate_c`` and ``down_c`` is read as that record."""
    rec = (
        ctx
        if isinstance(ctx, LayerRecord)
        else LayerRecord(m=ctx[0], s=ctx[1], hidden=ctx[2], out=out_c, gate=gate_c, p=down_c)
    )
    m_c, s_c, (m_0, s_0) = rec.m, rec.s, anchor
    deltas: dict[str, Delta] = {}
    acts_on = "the MLP input without context"
    name = ""
    try:
        if sites.input_site is not None:  # one change of the MLP input, shared by every matrix reading it
            name = f"{sites.input_site}{INPUT_SUFFIX}"
            dtype = solve.work_dtype(s_c, s_0)
            deltas[name] = solve.minimal_patch(s_c.to(dtype) - s_0.to(dtype), s_0)
        for name in () if sites.input_site is not None else sites.inputs:
            module = model.get_submodule(name.rpartition(".")[0])
            layout = weight_layout(module, name)
            w = offload.value(model, name)  # an offloaded weight: its data
            deltas[name] = stored(solve.input_patch(w, s_c, s_0, layout=layout), layout)
        if sites.output is not None:
            acts_on, name = sites.output.acts_on, sites.output.name
            deltas.update(sites.output.token_deltas(model, m_c, m_0, rec))
    except ZeroAnchorError as exc:
        where = [(b, labels[q]) for b, q in exc.index]
        raise ZeroAnchorError(
            f"layer {layer}: no minimal patch of {name} exists at (batch, query position) {where[:5]}: "
            f"the vector it acts on ({acts_on}) is zero, yet the context changes what it must produce",
            where,
        ) from None
    except InputError as exc:
        raise InputError(f"layer {layer}, {name}: {exc} (are the model's weights and activations finite?)") from None
    return deltas


@torch.no_grad()
def token_patch(
    model: nn.Module,
    inputs: Any,
    query: Any = -1,
    remove: Any = None,
    *,
    keep_bos: bool = False,
    progress: bool | None = None,
) -> Patch:
    """Exact token patches of every layer, for every sequence and query position.

    ``inputs``: ``[batch, pos, d]`` embeddings for our models (token ids ``[batch, pos]`` for
    language models). ``query``: an int (default ``-1``, the last position), a list of ints, a
    slice or ``"all"``. ``remove``: ``None`` removes all context before each query; a slice, a
    list of indices (``[i - 1]``) or a boolean mask ``[pos]`` removes that chunk ``Y`` (shared by the
    batch) instead. ``keep_bos``: keep the first token (a language model's BOS, which many heads
    attend to) and remove the rest of the context: the no-context sequence is the first token
    followed by the queries. A query that is padding is refused in every mode (pad on the left), and
    ``keep_bos`` on a row whose position 0 is padding.
    ``progress``: a bar per layer (``None``: only on a terminal, once the call takes over a second).

    Returns a ``Patch`` with deltas ``[batch, query, ...]`` such that the model without the
    removed context and with the patch reproduces, at each query, the with-context hidden state
    of every layer and the output (``verify`` checks it). Per layer (``docs/patch-theorem.md``,
    ``docs/deep-models.md``): ``dW = W (s_C - s_0) s_0^T / |s_0|^2`` on each matrix reading the
    MLP input, plus ``m_C - m_0`` on the output bias (or rank-1 on the output matrix) for
    residual blocks. Raises ``ZeroAnchorError`` (naming layer, parameter and position) where no
    patch exists.

    With a chunk removed and several queries, a sequence's patches act together: the no-context
    pass runs every query with its patch, so a later query's anchor sees the earlier queries
    patched (``functional_call`` runs them the same way). Ask for one query per call for patches
    that stand alone.
    """
    adapter = adapter_for(model)
    with adapter.fixed(model):  # the module map looked up once for the whole call
        inputs = adapter.check_inputs(model, inputs)
        batch = adapter.batch_size(inputs)
        plan = _plan(adapter, inputs, query, remove, keep_bos)
        check_own_weights(model, adapter)
        patch = _patch(model, adapter, inputs, plan, batch, progress)
        # token ids: the patch keeps a fingerprint of the no-context tokens it runs on (None for embeddings)
        return patch.replace(tokens=made_on(adapter, inputs, plan, batch))


def check_own_weights(model: nn.Module, adapter) -> None:
    """Refuse a model whose layers share a parameter the patch writes (one ``nn.Module`` object used
    by two layers): each layer's patch is a delta of its own weights."""
    owner: dict[int, int] = {}
    for i in range(adapter.n_layers(model)):
        sites = adapter.sites(model, i)
        for name in (*sites.inputs, *(() if sites.output is None else sites.output.names)):
            j = owner.setdefault(id(model.get_parameter(name)), i)
            if j != i:
                raise UnsupportedModelError(
                    f"layers {j} and {i} share one module ({name} is layer {j}'s parameter): each layer's patch "
                    "changes its own weights; give every layer its own copy (copy.deepcopy)"
                )


def provenance(model: nn.Module, adapter, batch: int, dtype: torch.dtype) -> dict:
    """How a patch of ``model`` was made, for its ``meta``: the model record and fingerprint, the batch
    size, the dtype of the states it came from."""
    return {
        "model": {**adapter.describe(model), "fingerprint": files.fingerprint(model)},
        "batch": batch,
        "model_dtype": str(dtype).removeprefix("torch."),
    }


def assemble(model: nn.Module, adapter, deltas: dict[str, Delta], plan: Plan, batch: int, dtype: torch.dtype) -> Patch:
    """The token patch of ``plan`` from its deltas: where it acts, its plan, the matrices reading each
    input change (``Patch.readers``) and its provenance. The deltas are in ``dtype``, the one the model
    computed in (the math runs in at least float32: a bfloat16 model's patch is cast back)."""
    patch = Patch(
        deltas,
        plan.positions if plan.mode == "chunk" else None,
        provenance(model, adapter, batch, dtype),
        plan=plan,
        readers=input_readers(model, adapter),
    )
    return patch if patch.dtype == dtype else patch.to(dtype)


def _patch(model: nn.Module, adapter, inputs, plan, batch: int, progress) -> Patch:
    """``token_patch`` from the adapter's two passes, ``trace`` (with context) and ``anchors`` (without).

    Each query alone, where the adapter gets its anchors from the with-context states
    (``adapter.alone_anchor``): one pass, each layer's patch made as the layer finishes and its
    states dropped. Otherwise the with-context pass records every layer's states at the queries, the
    no-context pass every layer's anchors; then the patches, layer by layer."""
    q = list(plan.query)
    alone = adapter.alone_anchor(model) if plan.mode == "alone" else None
    if alone is not None:
        deltas: dict[str, Delta] = {}
        dtypes = []
        bar = iter(progress_bar(range(adapter.n_layers(model)), progress, desc="token_patch", unit="layer"))

        def on_layer(i: int, states: dict) -> None:
            deltas.update(recorded_patch(model, adapter, i, states, alone(i, states), plan.query))
            dtypes.append(states.out.dtype)
            next(bar, None)

        adapter.trace(model, inputs, q, on_layer)
        for _ in bar:  # closes the bar
            pass
        return assemble(model, adapter, deltas, plan, batch, dtypes[0])
    rec = adapter.trace(model, inputs, q)  # per layer h, m, s, hidden, out  [B, Q, .]
    kept = list(plan.kept) if plan.mode == "chunk" else None
    anchors = adapter.anchors(model, inputs, q, rec, kept)  # per layer (m_0, s_0)  [B, Q, .]
    deltas = recorded_deltas(model, adapter, rec, anchors, plan.query, progress)
    return assemble(model, adapter, deltas, plan, batch, rec[0].out.dtype)


def recorded_patch(model: nn.Module, adapter, i: int, states: LayerRecord, anchor, labels) -> dict[str, Delta]:
    """Layer ``i``'s deltas from its recorded with-context ``states`` and its ``anchor`` (``[B, Q, .]``)."""
    return layer_patch(model, adapter.sites(model, i), states, anchor, i, labels)


def recorded_deltas(
    model: nn.Module, adapter, rec: list[dict], anchors: list, labels, progress=False
) -> dict[str, Delta]:
    """Every layer's deltas from recorded with-context states ``rec`` and ``anchors`` (``[B, Q, .]``)."""
    deltas: dict[str, Delta] = {}
    for i in progress_bar(range(len(rec)), progress, desc="token_patch", unit="layer"):
        deltas.update(recorded_patch(model, adapter, i, rec[i], anchors[i], labels))
    return deltas


def input_readers(model: nn.Module, adapter) -> dict[str, list[list[str]]]:
    """``{"<module>:input": [[parameter, layout], ...]}``: what each input-site delta changes
    (``Patch.readers``; ``apply`` writes ``W + W D`` into each of them)."""
    out = {}
    for i in range(adapter.n_layers(model)):
        sites = adapter.sites(model, i)
        if sites.input_site is not None:
            out[f"{sites.input_site}{INPUT_SUFFIX}"] = [[n, param_layout(model, n)] for n in sites.inputs]
    return out


def param_layout(model: nn.Module, name: str) -> str:
    """A weight's layout (``arch.weight_layout``; stacked experts: ``[E, out, in]`` or ``[E, in, out]``)."""
    return weight_layout(model.get_submodule(name.rpartition(".")[0]), name)
