"""Thought patches: one static weight update that stands in for a prompt (``docs/thought-patches.md``).

A token patch is exact but belongs to one query. A *thought patch* is one update, fitted over
calibration queries ``q_1..q_m`` read after the same prompt, that the model uses on queries it
has never seen. Per layer, with the MLP input ``s_C`` (with the prompt) and the anchor ``s_0``
(without it) at every calibration position ``j`` (``n`` of them in all):

**Input side.** Every matrix ``W`` reading ``s`` gets ``dW = W D``, the ridge least-squares fit of
``dW s_0j = W (s_Cj - s_0j)``:

    D = (Delta S^T / n) (S S^T / n + lambda I)^-1        S = [s_0j], Delta = [s_Cj - s_0j]   (d_in x d_in)

(the minimiser over all ``dW`` of ``sum_j |dW s_0j - W Delta_j|^2 + n lambda |dW|_F^2`` is ``W D``, so
one ``D`` serves ``fc_in`` or a gated MLP's ``gate`` and ``up`` alike). With ``lambda = 0`` and fewer
positions than dimensions it is the minimum-norm interpolant ``Delta S^+``; one query gives
exactly the token patch ``W Delta s_0^T / |s_0|^2``.

**Output side** (residual blocks). With the input patch in place the MLP hidden state is ``h'_j``;
what the layer still misses before its output is ``t_j = (m_Cj + f(h_Cj)) - (m_0j + f(h'_j))``
(``f`` the output matrix, ``m`` the residual value). ``output="affine"`` fits
``dW_out h'_j + db ~ t_j`` by ridge least squares (intercept not penalised), a static update of the
output matrix and bias; ``"vector"`` only the constant ``db = mean_j t_j`` (the *thought vector*);
an output site without a bias takes the linear fit ``dW_out h'_j ~ t_j``.

**Deep models.** ``mode="sequential"`` (default) fits layer by layer on the states of the model
already patched below: anchors are the patched model's own states, targets the with-prompt ones.
``mode="teacher"`` fits every layer on the with-prompt states (as the token patch does), in two
passes, but its deeper fits see states the patched model does not produce.

**Streaming.** Only sums are kept: ``S S^T`` and ``Delta S^T`` (``d_in x d_in``), the scalar ``sum_j |Delta_j|^2`` for
the residual, and their output-side counterparts (``d_hidden + 1`` square), in float64, so memory is independent of the
number of queries. Calibration batches are recomputed from the inputs when needed (sequential
mode: two passes per layer). The solve is a Cholesky factorisation; a rank-deficient or
ill-conditioned system warns with its condition number and takes the minimum-norm solution
(the ``lambda -> 0+`` ridge limit) from an eigendecomposition, never NaN.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from tokenpatch.arch import adapter_for
from tokenpatch.deprecation import renamed_keywords
from tokenpatch.errors import InputError, caller_stacklevel
from tokenpatch.patch import Patch
from tokenpatch.run import hooked
from tokenpatch.thought.calibration import DEFAULTS, sample_calibration
from tokenpatch.thought.engine import batched, fit
from tokenpatch.thought.fit import LayerFit, ThoughtPatch, calibration_batches
from tokenpatch.thought.lstsq import COND_WARN, ThoughtWarning

__all__ = [
    "ThoughtPatch",
    "LayerFit",
    "thought_patch",
    "compress",
    "evaluate_thought_patch",
    "ThoughtWarning",
    "COND_WARN",
]


# What ``thought_patch`` samples when a language model's calibration is left out (``sample_calibration``).
SELF_CALIBRATION = DEFAULTS


@renamed_keywords(queries="calibration")
@torch.no_grad()
def thought_patch(
    model: nn.Module,
    prompt: Tensor,
    calibration: Any = None,
    *,
    ridge: float | Literal["gcv"] = 0.0,
    mode: Literal["sequential", "teacher"] = "sequential",
    inputs: bool = True,
    output: Literal["affine", "vector"] | None = "affine",
    batch_size: int = 4096,
    rank: int | None = None,
    solver: Literal["normal", "qr"] = "normal",
    cache_bytes: int = 2**30,
    distributed: bool = False,
    progress: bool | None = None,
    keep_bos: bool = False,
    layers: Any = None,
    start: Any = None,
    norm_steps: int = 0,
) -> ThoughtPatch:
    """Fit one static patch that stands in for ``prompt`` (module docstring).

    ``prompt [P, ...]`` (or ``[1, P, ...]``): the context to drop, as model inputs (embeddings
    ``[P, d_in]`` for our models). ``calibration``: the calibration inputs ``[m, T_q, ...]``, each read
    after the prompt, every position fitted; or a re-iterable of such batches (``queries=`` is its
    0.2 name); left out on a language model, the prompted model writes them itself
    (``sample_calibration(model, prompt)``: 64 continuations of 32 tokens at temperature 0.7, seed 0;
    call it to choose others), each begun with the token ids ``start`` if given: for a few-shot
    prompt, how its demonstrations begin (``tokenizer(demonstration_start(text))``, e.g. ``"Q:"``), so
    that the model writes new demonstrations rather than whatever it would put after the prompt. ``ridge``: ``lambda`` of the
    per-position mean objective, or ``"gcv"``: chosen for each layer and side by generalised
    cross-validation from the fit's own sums (``lstsq.py``; the choices are in ``fits``). ``inputs`` / ``output``: which sides to fit. ``rank``: keep every
    matrix delta at its top ``rank`` singular directions *during* the fit, so that the output side
    and the layers above fit on top of the truncated update (``ThoughtPatch.truncate`` cuts after
    the fit instead, and the layers above never see it). ``solver``: ``"normal"`` accumulates the
    normal equations (fastest); ``"qr"`` a streamed QR factor of the data (about 3x the least-squares
    work, rounding amplified by the square root of the condition number instead of all of it, and
    exact training residuals). The states of the
    calibration positions (with the prompt and without) are kept between layers while they fit in
    ``cache_bytes`` and recomputed otherwise (memory then independent of the number of queries). ``distributed=True``: this
    process holds one shard of the calibration inputs and every process of the default
    ``torch.distributed`` group calls ``thought_patch`` with the same arguments (launch with
    ``torchrun``); the per-layer sums are all-reduced before each solve, so every process gets the
    fit of all the shards together. ``keep_bos=True`` keeps the prompt's first token (a language
    model's BOS, which the heads attend to) in front of every query in the no-prompt pass too;
    ``layers`` (indices, e.g. ``range(4, 12)``) fits only that band and leaves the others unpatched;
    ``norm_steps``: Gauss-Newton steps that refine the output side through a norm after the MLP
    (Gemma 2/3) on the error of the norm's output itself (``thought.through_norm``; no effect on a
    layer without one); ``fits`` records the relative output error before and after them.
    Returns a ``ThoughtPatch``; its patch's ``meta["thought"]["fits"]`` records the ``LayerFit``s too
    (provenance that ``save_patch`` keeps).
    """
    if mode not in ("sequential", "teacher"):
        raise InputError(f"mode must be 'sequential' or 'teacher', got {mode!r}")
    if output not in ("affine", "vector", None):
        raise InputError(f"output must be 'affine', 'vector' or None, got {output!r}")
    if ridge != "gcv" and (isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge >= 0):
        raise InputError(f"ridge must be a number >= 0 or 'gcv' (chosen per layer and side), got {ridge!r}")
    if not inputs and output is None:
        raise InputError("nothing to fit: inputs=False and output=None")
    if solver not in ("normal", "qr"):
        raise InputError(f"solver must be 'normal' or 'qr', got {solver!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise InputError(f"rank must be None or an int >= 1, got {rank!r}")
    if isinstance(norm_steps, bool) or not isinstance(norm_steps, int) or norm_steps < 0:
        raise InputError(f"norm_steps must be an int >= 0, got {norm_steps!r}")
    if norm_steps and distributed:
        raise InputError("norm_steps > 0 needs every calibration position in one process: use distributed=False")
    adapter = adapter_for(model)
    if not isinstance(prompt, Tensor):
        raise InputError(
            f"prompt must be a tensor: token ids [P] or model inputs [P, d_in], got {type(prompt).__name__}"
        )
    tokens = not prompt.is_floating_point()  # a language model's prompt: token ids
    _check_prompt(prompt, 2 if tokens else 3)
    if batched(prompt).ndim != (2 if tokens else 3):
        raise InputError(
            "prompt must be token ids [P] (or [1, P]) or model inputs [P, d_in] (or [1, P, d_in]), got shape "
            f"{tuple(prompt.shape)}"
        )
    sampled = None
    if calibration is None:
        if not tokens:
            raise InputError(
                "thought_patch: calibration inputs [m, T_q, d_in] are needed (only a language model writes its own)"
            )
        sampled = dict(SELF_CALIBRATION)
        calibration = sample_calibration(model, prompt, start=start, progress=progress, **sampled)
        if start is not None:
            sampled["start"] = [int(t) for t in torch.as_tensor(start).reshape(-1)]
    elif start is not None:
        raise InputError("thought_patch: start= begins the continuations it samples; calibration was given")
    _check_calibration(calibration)
    fitted = fit(
        model,
        adapter,
        prompt,
        calibration_batches(calibration, batch_size),
        ridge=ridge,
        mode=mode,
        inputs=inputs,
        output=output,
        rank=rank,
        solver=solver,
        cache_bytes=cache_bytes,
        distributed=distributed,
        progress=progress,
        keep_bos=keep_bos,
        layers=layers,
        norm_steps=norm_steps,
    )
    meta = dict(fitted.patch.meta)
    meta["thought"] = {**meta["thought"], "fits": [f.to_dict() for f in fitted.fits]}
    if sampled is not None:
        meta["thought"]["calibration"] = {"self_generated": True, **sampled}
    # fitted with the prompt's first token in front of every query: it runs on sequences that begin with it
    prefix = (int(torch.as_tensor(prompt).reshape(-1)[0]),) if keep_bos else ()
    return ThoughtPatch(fitted.patch.replace(meta=meta, prefix=prefix), fitted.fits)


def _check_prompt(prompt: Any, ndim: int) -> None:
    """One prompt, not empty: ``[P, ...]`` or ``[1, P, ...]`` (``ndim``: the batched form's dims)."""
    if not isinstance(prompt, Tensor):
        return  # lists and the like: read (and checked) where they are used
    if prompt.ndim == ndim and prompt.shape[0] != 1:
        raise InputError(
            f"thought_patch: one prompt per thought patch ([P] or [1, P]), got {prompt.shape[0]} rows "
            f"{tuple(prompt.shape)}: call it once per prompt"
        )
    if prompt.numel() == 0:
        raise InputError(
            f"thought_patch: the prompt is empty (shape {tuple(prompt.shape)}): there is nothing to compress"
        )


def _check_calibration(calibration: Any) -> None:
    """Calibration inputs as a tensor of at least one query of one position, or batches of them."""
    if isinstance(calibration, Mapping):
        raise InputError(
            "thought_patch: calibration must be inputs [m, T_q] (a tensor, or a list of batches), got a "
            f"{type(calibration).__name__} with keys {sorted(map(str, calibration))[:3]}: pass tokenizer(...)['input_ids']"
        )
    listed = isinstance(calibration, (list, tuple))
    for batch in calibration if listed else [calibration]:
        if isinstance(batch, Tensor) and (batch.ndim < 2 or batch.numel() == 0):
            raise InputError(
                "thought_patch: calibration must hold at least one query of one position ([m, T_q], m, T_q >= 1), "
                f"got shape {tuple(batch.shape)}"
            )
    if listed and not calibration:
        raise InputError("thought_patch: calibration is an empty list: pass at least one batch of queries")


def compress(model: nn.Module, prompt: Tensor, calibration: Any, **options) -> Patch:
    """Deprecated: ``tp.thought_patch(model, prompt, calibration, **options).patch``, the same patch
    with the same fit diagnostics in its metadata."""
    warnings.warn(
        "tp.compress is deprecated; use tp.thought_patch(model, prompt, calibration, ...).patch",
        DeprecationWarning,
        stacklevel=caller_stacklevel(),
    )
    return thought_patch(model, prompt, calibration, **options).patch


@renamed_keywords(queries="inputs")
@torch.no_grad()
def evaluate_thought_patch(
    model: nn.Module,
    prompt: Tensor,
    inputs: Tensor,
    patches: Patch | Mapping[str, Patch],
    targets: Tensor | None = None,
    batch_size: int = 4096,
    reference: Tensor | None = None,
) -> dict:
    """How well static patches stand in for ``prompt`` on held-out ``inputs [m, T_q, ...]`` (each read
    after the prompt; ``queries=`` is the 0.2 name).

    Outputs at every position of ``inputs`` of: the model with the prompt, without it, and without it
    under each patch (``patches``: one, named ``"thought_patch"``, or ``name -> Patch``). Returns
    ``{"mse_to_context": {name: mean squared difference to the with-prompt outputs}, "gap_closed":
    {name: 1 - that / the no-prompt model's}, "task_mse": {...}}``, where the names are the patches'
    and ``"no_prompt"``; ``task_mse`` (with ``targets`` shaped like the outputs) adds
    ``"with_prompt"``. ``reference``: the with-prompt outputs if already known (``[m, T_q, d_out]``,
    as the ``"with_prompt"`` entry of the return value), to evaluate several patches on one test set
    without running the prompt again."""
    patches = {"thought_patch": patches} if isinstance(patches, Patch) else dict(patches)
    taken = {"with_prompt", "no_prompt"} & set(patches)
    if taken:
        raise InputError(f"evaluate_thought_patch: a patch may not be named {sorted(taken)[0]!r} (a reserved key)")
    adapter = adapter_for(model)
    prompt = adapter.check_inputs(model, prompt if prompt.ndim == 3 else prompt[None])
    p = prompt.shape[1]
    outs: dict[str, list[Tensor]] = {k: [] for k in ["with_prompt", "no_prompt", *patches]}
    for q in inputs.split(batch_size):
        q = adapter.check_inputs(model, q)
        if reference is None:
            outs["with_prompt"].append(
                adapter.run(model, torch.cat([prompt.expand(q.shape[0], -1, -1), q], 1))[0][:, p:]
            )
        outs["no_prompt"].append(adapter.run(model, q)[0])
        for name, patch in patches.items():
            patch.check_model(model)
            with hooked(model, patch, True, True):
                outs[name].append(adapter.run(model, q)[0])
    if reference is not None:
        if reference.shape != torch.Size([sum(o.shape[0] for o in outs["no_prompt"]), *outs["no_prompt"][0].shape[1:]]):
            raise InputError(f"reference {tuple(reference.shape)} is not the with-prompt outputs of these inputs")
        outs["with_prompt"] = [reference]
    cat = {k: torch.cat(v).double() for k, v in outs.items()}
    ref = cat["with_prompt"]
    mse = {k: float(((v - ref) ** 2).mean()) for k, v in cat.items() if k != "with_prompt"}
    res = {
        "with_prompt": cat["with_prompt"],
        "mse_to_context": mse,
        "gap_closed": {k: 1 - v / mse["no_prompt"] if mse["no_prompt"] > 0 else float("nan") for k, v in mse.items()},
    }
    if targets is not None:
        t = targets.double().reshape(ref.shape)
        res["task_mse"] = {k: float(((v - t) ** 2).mean()) for k, v in cat.items()}
    return res
