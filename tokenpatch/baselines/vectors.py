"""The extraction half of the baselines (``docs/prompt-compression.md``): task vectors, function
vectors, the attention-shift steering baseline and the thought vector, from the same prompts.

Every function reads *batches*: ``{"input_ids", "attention_mask", "position_ids"}`` ``[B, T]``,
left-padded (``pad_left``), so the last position of every row is its answer position and the
query's tokens are the last ``n_query[b]`` of row ``b`` with and without the prompt alike.

* task vector (Hendel et al. 2023, *In-Context Learning Creates Task Vectors*): the residual
  stream after layer ``l`` at the last position of the prompted queries, averaged; injected by
  *replacing* that state in the prompt-free pass;
* function vector (Todd et al. 2024, *Function Vectors in Large Language Models*): heads ranked by
  their average indirect effect (AIE) on prompts with shuffled answers, the FV the sum of the top
  heads' mean outputs ``sum_h W_O[:, h] mean(z_h)``; *added* to the residual stream after layer ``l``
  at the last position;
* attention shift: per layer, the mean over query positions of ``A_C(x) - A_0(x)`` (the
  attention's residual contribution with minus without the prompt), added at every layer and
  position, the MLPs untouched;
* in-context vector (Liu et al. 2024, *In-context Vectors: Making In Context Learning More
  Effective and Controllable Through Latent Space Steering*): per demonstration, the last-position
  residual states after every layer of the demonstration with its answer minus without it,
  flattened over the layers; the top principal direction of those differences plus their mean,
  per layer; injected at every layer's MLP output, every position, by turning the output towards
  it with its norm kept (``Steering``'s ``"rotate"``);
* thought vector: the output side of a thought patch alone, a constant per layer,
  ``v_l = mean(y_C - y_0)`` over query positions where ``y_0`` already has ``v_1 .. v_{l-1}``
  (the sequential least squares with one constant feature), added to the residual stream.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from tokenpatch import offload
from tokenpatch.arch import adapter_for
from tokenpatch.arch.hf import EAGER_NAN
from tokenpatch.arch.hooks import output_tensor, registered_hooks
from tokenpatch.arch.norms import norm_eps, scale_norm
from tokenpatch.baselines.steering import (
    Steering,
    head_contribution,
    heads_set,
    n_heads,
    o_proj_modules,
    recording_heads,
    site_modules,
    stream_of,
)
from tokenpatch.errors import InputError
from tokenpatch.progress import progress_bar


def pad_left(rows: Iterable[list[int]], pad_id: int) -> dict[str, Tensor]:
    """Token id lists as one left-padded batch with its attention mask and position ids."""
    rows = [list(r) for r in rows]
    if not rows or any(not r for r in rows):
        raise InputError("pad_left needs at least one row and no empty row")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
        mask[b, width - len(r) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}


def _device(model: nn.Module) -> torch.device:
    return offload.device(model.get_input_embeddings())  # an offloaded table: where its hook runs it


def _on(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.to(_device(model)) for k, v in batch.items()}


def _states(model: nn.Module, batch: dict[str, Tensor], site: str, last: bool) -> list[Tensor]:
    """Per layer, the output of ``site`` ``[B, T, d]`` (``last``: ``[B, d]`` at the last position)."""
    modules = site_modules(model, site)
    rec: list[Tensor] = [None] * len(modules)  # type: ignore[list-item]

    def hook_for(i):
        def hook(module, args, out):
            t = stream_of(output_tensor(out).detach(), batch["input_ids"])
            rec[i] = t[:, -1] if last else t

        return hook

    with registered_hooks((m.register_forward_hook, hook_for(i)) for i, m in enumerate(modules)), torch.no_grad():
        model.base_model(**_on(model, batch), use_cache=False)
    return rec


def _query_mask(n_query: Tensor, width: int) -> Tensor:
    """``[B, width]``: True at the last ``n_query[b]`` of ``width`` right-aligned positions."""
    j = torch.arange(width)
    return j[None, :] >= (width - n_query)[:, None]


def task_vectors(model: nn.Module, prompted: dict[str, Tensor]) -> Steering:
    """Every layer's candidate task vector: the mean residual state after the layer at the last
    position of the prompted batch (prompt + dummy query). ``.only(l)`` picks layer ``l``."""
    states = _states(model, prompted, "residual", last=True)  # L x [B, d]
    return Steering(
        "residual",
        {i: s.mean(0) for i, s in enumerate(states)},
        "replace",
        "last",
        {"method": "task vector", "prompts": int(prompted["input_ids"].shape[0])},
    )


def mean_heads(model: nn.Module, prompted: dict[str, Tensor]) -> Tensor:
    """Every head's output at the last position, averaged over the prompted batch: ``[L, H, head_dim]``."""
    with recording_heads(model) as rec, torch.no_grad():
        model.base_model(**_on(model, prompted), use_cache=False)
    return torch.stack([z.mean(0) for z in rec])


def head_effects(
    model: nn.Module, corrupted: dict[str, Tensor], answers: Tensor, means: Tensor, progress: bool | None = None
) -> Tensor:
    """Average indirect effect ``[L, H]`` of every head: on the prompts with shuffled answers, the
    rise in the probability of the right first answer token when the head writes its mean output
    ``means[l, h]`` at the last position, averaged over the prompts.

    Only the last position changes, so the prompts are run once up to the last token with a KV
    cache; each head costs one forward of the last token on that cache, put back after it (``_kept``;
    not a crop: a sliding-window layer's cache cannot be cut back). A head of layer ``l`` changes nothing
    below it, so layers ``0 .. l-1`` replay what they returned in the run without an edit
    (``_replayed``) and only layers ``l ..`` run: half the layers on average."""
    batch = _on(model, corrupted)
    answers = answers.to(_device(model))
    if answers.shape != (batch["input_ids"].shape[0],):
        raise InputError(
            f"answers must hold one token id per prompt [{batch['input_ids'].shape[0]}], got {tuple(answers.shape)}"
        )
    with torch.no_grad():
        cache = model(
            input_ids=batch["input_ids"][:, :-1],
            attention_mask=batch["attention_mask"][:, :-1],
            position_ids=batch["position_ids"][:, :-1],
            use_cache=True,
            logits_to_keep=1,
        ).cache
    last = {
        "input_ids": batch["input_ids"][:, -1:],
        "attention_mask": batch["attention_mask"],
        "position_ids": batch["position_ids"][:, -1:],
    }

    def p_answer() -> Tensor:
        with torch.no_grad(), _kept(cache) as run:  # the forward appends to it
            logits = model(**last, cache=run, use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits.double().softmax(-1).gather(1, answers[:, None])[:, 0]  # [B]

    layers = adapter_for(model).layers(model)
    returned: list = [None] * len(layers)  # each layer's output in the run without an edit

    def keep(i: int):
        def hook(module, args, out):
            returned[i] = _copied(out)  # a copy: a layer above may change its input in place

        return hook

    with registered_hooks((layer.register_forward_hook, keep(i)) for i, layer in enumerate(layers)):
        base = p_answer()
    if not bool(torch.isfinite(base).all()):
        raise InputError(f"head_effects: the model's forward gives non-finite probabilities on the prompts{EAGER_NAN}")
    n_layers, heads = means.shape[:2]
    effects = torch.zeros(n_layers, heads, dtype=torch.float64)  # the probabilities are float64
    for layer in progress_bar(range(n_layers), progress, desc="head effects", unit="layer"):
        for h in range(heads):
            with heads_set(model, {(layer, h): means[layer, h]}), _replayed(layers, returned[:layer]):
                effects[layer, h] = (p_answer() - base).mean().cpu()
    return effects


APPEND_ONLY = ("DynamicLayer", "DynamicSlidingWindowLayer")  # transformers' cache layers that never write in place


@contextlib.contextmanager
def _kept(cache) -> Iterator:
    """``cache`` to run a forward on, and as it was afterwards. The layers of transformers' dynamic
    caches (``APPEND_ONLY``) replace their tensors on ``update`` (``torch.cat``, a slice) and never
    write into them: putting their attributes back restores them without copying a tensor. Any other
    cache (a static one writes in place) is copied."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer).__name__ not in APPEND_ONLY for layer in layers):
        yield copy.deepcopy(cache)
        return
    saved = [dict(vars(layer)) for layer in layers]
    try:
        yield cache
    finally:
        for layer, state in zip(layers, saved):
            vars(layer).clear()
            vars(layer).update(state)


class _Replay(nn.Module):
    """A layer that returns ``out`` (a copy) whatever it is given: what the layer it stands in for
    returned on the same input."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, *args, **kwargs):
        return _copied(self.out)


def _copied(out):
    """A layer's output (a tensor, or a tuple holding tensors) with its tensors copied."""
    if isinstance(out, Tensor):
        return out.clone()
    return type(out)(x.clone() if isinstance(x, Tensor) else x for x in out)


@contextlib.contextmanager
def _replayed(layers, outputs: list) -> Iterator[None]:
    """Layers ``0 .. len(outputs)-1`` of the ``nn.ModuleList`` ``layers`` replaced by ``_Replay`` of their
    ``outputs``, put back on exit (errors included); any other container of layers runs them all."""
    saved = list(layers)
    if not isinstance(layers, nn.ModuleList) or any(o is None for o in outputs):
        yield
        return
    try:
        for i, out in enumerate(outputs):
            layers[i] = _Replay(out)
        yield
    finally:
        for i, layer in enumerate(saved):
            layers[i] = layer


def function_vectors(
    model: nn.Module,
    prompted: dict[str, Tensor],
    corrupted: dict[str, Tensor],
    answers: Tensor,
    n_top: int = 10,
    progress: bool | None = None,
) -> Steering:
    """The function vector (the top ``n_top`` heads by AIE, their mean outputs summed through
    ``o_proj``, and through a norm after it at its mean gain: ``_norm_gain``) as a candidate at every
    layer; ``.only(l)`` picks the layer it is added after. ``meta`` keeps the ranked heads and the
    AIE table."""
    with recording_heads(model) as rec, torch.no_grad():
        model.base_model(**_on(model, prompted), use_cache=False)
    means = torch.stack([z.mean(0) for z in rec])  # [L, H, dh]
    effects = head_effects(model, corrupted, answers, means, progress)  # [L, H]
    heads = n_heads(model)
    top = effects.flatten().argsort(descending=True)[: max(1, int(n_top))]
    chosen = [(int(i) // heads, int(i) % heads) for i in top]
    fv = sum(
        head_contribution(model, layer, h, means[layer, h]) * _norm_gain(model, layer, rec[layer])
        for layer, h in chosen
    )
    return Steering(
        "residual",
        {i: fv for i in range(means.shape[0])},
        "add",
        "last",
        {
            "method": "function vector",
            "heads": [[layer, h, float(effects[layer, h])] for layer, h in chosen],
            "aie": effects.tolist(),
        },
    )


def _norm_gain(model: nn.Module, layer: int, z: Tensor) -> Tensor | float:
    """What a norm between ``o_proj`` and the residual stream (Gemma's post-attention norm, ``g *
    a / rms(a)``) multiplies a head's term by: ``g / rms(a)``, ``a`` the attention output of the
    prompted rows at the last position (its mean RMS). The heads' terms then add up to the norm's
    output, as they add up to ``o_proj``'s where no norm follows (gain 1)."""
    norm = adapter_for(model).attention_norms(model)[layer]
    if norm is None:
        return 1.0
    unit, offset = scale_norm(norm)
    with torch.no_grad():
        a = o_proj_modules(model)[layer](z.flatten(1).to(next(norm.parameters()).dtype))  # [B, d]
        rms = (a.double().square().mean(-1) + norm_eps(norm)).sqrt().mean()
        scale = offset + offload.value(norm, "weight").detach().to(a.device, torch.float64)
        return (scale / rms).to(a.dtype)  # [d]


def attention_shift(
    model: nn.Module, prompted: dict[str, Tensor], plain: dict[str, Tensor], n_query: Tensor
) -> Steering:
    """The attention-shift baseline: per layer, the mean of (attention output with the prompt) minus
    (without it) over the query positions, from one unsteered pass each."""
    with_p, without = _states(model, prompted, "attention", False), _states(model, plain, "attention", False)
    width = int(n_query.max())
    mask = _query_mask(n_query, width).to(with_p[0].device)  # [B, Tq]
    return Steering(
        "attention",
        {i: (c[:, -width:] - z[:, -width:])[mask].mean(0) for i, (c, z) in enumerate(zip(with_p, without))},
        "add",
        "all",
        {"method": "attention shift"},
    )


def thought_vector(
    model: nn.Module, prompted: dict[str, Tensor], plain: dict[str, Tensor], n_query: Tensor, skip: int = 0
) -> Steering:
    """The thought vector: per layer ``v_l = mean(y_C - y_0)`` over the query positions, ``y_0`` the
    prompt-free residual stream after layer ``l`` with ``v_0 .. v_{l-1}`` already added. One pass:
    each layer's hook solves for its own ``v_l`` from what it sees and adds it before the next layer.
    ``skip``: leading tokens (a BOS) left unsteered, as ``steer(..., where=)`` injects it."""
    targets = _states(model, prompted, "residual", False)  # L x [B, T_c, d]
    width = int(n_query.max())
    modules = site_modules(model, "residual")
    mask = _query_mask(n_query, width).to(targets[0].device)
    vectors: dict[int, Tensor] = {}
    where = (plain["position_ids"] >= skip).to(targets[0].device)  # [B, T]

    def hook_for(i):
        def hook(module, args, out):
            t = output_tensor(out)
            v = (targets[i][:, -width:] - t[:, -width:])[mask].mean(0).detach()
            vectors[i] = v
            new = torch.where(where[..., None], t + v, t)
            return new if isinstance(out, Tensor) else (new, *out[1:])

        return hook

    with registered_hooks((m.register_forward_hook, hook_for(i)) for i, m in enumerate(modules)), torch.no_grad():
        model.base_model(**_on(model, plain), use_cache=False)
    return Steering("residual", vectors, "add", "all", {"method": "thought vector"})


def in_context_vectors(
    model: nn.Module, sources: dict[str, Tensor], targets: dict[str, Tensor], strength: float = 0.1
) -> Steering:
    """The in-context vector (module docstring) of demonstration pairs: row ``b`` of ``sources`` is
    demonstration ``b`` without its answer, of ``targets`` with it. With ``d_b`` the differences of
    the last-position residual states after every layer, flattened ``[L d]``, and ``dbar`` their
    mean, ``icv = pc_1 + dbar``, ``pc_1`` the unit top principal direction of ``d_b - dbar`` (sign:
    agreeing with ``dbar``; an SVD's sign is arbitrary). Layer ``l``'s vector is ``icv_l`` scaled to
    norm ``strength`` (the ``lambda`` of the injection), at the MLP outputs."""
    if sources["input_ids"].shape[0] != targets["input_ids"].shape[0]:
        raise InputError("in_context_vectors: sources and targets must hold the same demonstrations, row by row")
    if not strength > 0:
        raise InputError(f"in_context_vectors: strength must be > 0, got {strength!r}")
    src, tgt = _states(model, sources, "residual", last=True), _states(model, targets, "residual", last=True)
    diff = torch.cat([t - s for s, t in zip(src, tgt)], -1).double()  # [B, L d]
    mean = diff.mean(0)  # [L d]
    _, _, vh = torch.linalg.svd(diff - mean, full_matrices=False)  # rows: principal directions
    top = vh[0] if vh.shape[0] else torch.zeros_like(mean)
    top = -top if float(top @ mean) < 0 else top
    icv = (top + mean).view(len(src), -1)  # [L, d]
    return Steering(
        "mlp",
        {i: (strength * v / v.norm().clamp_min(1e-30)).to(src[0].dtype) for i, v in enumerate(icv)},
        "rotate",
        "all",
        {"method": "in-context vector", "strength": float(strength), "demonstrations": int(diff.shape[0])},
    )
