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

**Streaming.** Only sums are kept: ``S S^T``, ``Delta S^T``, ``Delta Delta^T`` (``d_in x d_in``) and their
output-side counterparts (``d_hidden + 1`` square), in float64, so memory is independent of the
number of queries. Calibration batches are recomputed from the inputs when needed (sequential
mode: two passes per layer). The solve is a Cholesky factorisation; a rank-deficient or
ill-conditioned system warns with its condition number and takes the minimum-norm solution
(the ``lambda -> 0+`` ridge limit) from an eigendecomposition, never NaN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from tokenpatch import files
from tokenpatch.progress import progress_bar
from tokenpatch.arch import Adapter, adapter_for, weight_layout
from tokenpatch.patch import Delta, LowRank, Patch
from tokenpatch.errors import InputError
from tokenpatch.run import _hooked
from tokenpatch.thought.lstsq import COND_WARN, ThoughtWarning, _accumulate, _factor, _residual, _solve

__all__ = ["ThoughtPatch", "LayerFit", "thought_patch", "compress", "evaluate_thought_patch", "ThoughtWarning",
           "COND_WARN"]



@dataclass(frozen=True)
class LayerFit:
    """Fit diagnostics of one layer (``None`` where a side was not fitted):

    * ``n``: calibration positions;
    * per side, the relative training residual ``|fit - target|_F / |target|_F`` (input side: of
      ``D s_0 ~ s_C - s_0``, in the MLP-input space). With ``solver="normal"`` it is read from the
      sums, so an exact fit reads as about ``sqrt(eps * condition)``, not 0; with ``"qr"`` it is
      exact. ``evaluate_thought_patch`` on the calibration queries measures the fit itself;
    * per side, the rank and condition number of the normal equations, and the ``lambda`` used.
    """

    layer: int
    n: int
    input_residual: float | None = None
    input_rank: int | None = None
    input_condition: float | None = None
    output_residual: float | None = None
    output_rank: int | None = None
    output_condition: float | None = None
    ridge: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ThoughtPatch:
    """``patch``: the static patch (lead ``[1, 1]``, acts everywhere, ``meta["static"]``: it runs on
    any no-prompt inputs, ``tp.functional_call(model, patch, x)`` or ``with tp.apply(model, patch)``);
    ``fits``: per-layer ``LayerFit``."""

    patch: Patch
    fits: list[LayerFit] = field(default_factory=list)

    def truncate(self, rank: int) -> Patch:
        """The patch with every matrix delta cut to its top ``rank`` singular directions (the best
        rank-``rank`` approximation in Frobenius norm: the factors are stored in SVD order)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise InputError(f"rank must be an int >= 1, got {rank!r}")
        return Patch(_cut(dict(self.patch.items()), rank), None, {**self.patch.meta, "truncated_rank": rank})

    def vector(self) -> Patch:
        """Only the dense (bias) deltas: the thought vector."""
        return _subset(self.patch, dense=True)

    def matrices(self) -> Patch:
        """Only the matrix deltas: the thought matrices."""
        return _subset(self.patch, dense=False)


def _cut(deltas: dict[str, Delta], rank: int | None) -> dict[str, Delta]:
    """Matrix deltas (factors in SVD order) cut to their top ``rank`` terms; others unchanged."""
    if rank is None:
        return dict(deltas)
    return {n: LowRank(d.u[..., :rank, :], d.v[..., :rank, :]) if isinstance(d, LowRank) else d for n, d in deltas.items()}


def _subset(patch: Patch, dense: bool) -> Patch:
    kept = {n: d for n, d in patch.items() if isinstance(d, LowRank) != dense}
    if not kept:
        raise InputError(f"this thought patch has no {'vector' if dense else 'matrix'} deltas")
    return Patch(kept, None, patch.meta)


# ---------------------------------------------------------------------------- the passes
def _batches(queries: Any, batch_size: int) -> list:
    """Calibration queries as a re-iterable of ``[b, T_q, ...]`` batches."""
    if isinstance(queries, Tensor):
        return list(queries.split(batch_size))
    if isinstance(queries, Iterable) and not isinstance(queries, (str, bytes)):
        if iter(queries) is queries:
            raise InputError("queries is a one-shot iterator; the fit reads the calibration batches more than "
                             "once: pass a tensor, a list of batches or a re-iterable loader")
        return queries
    raise InputError(f"queries must be a tensor [m, T_q, ...] or a re-iterable of such batches, got "
                     f"{type(queries).__name__}")


class _Source:
    """The states of the calibration positions at one layer, batch by batch.

    The prompt runs once: by causality its hidden states at every layer (``ctx[i]``, ``[1, P, d]``)
    are the same whatever query follows, so a query's with-prompt state at layer ``i + 1`` needs
    only its own state at layer ``i`` and ``ctx[i]``. Per batch the source keeps two states at the
    current layer, the with-prompt one ``hq`` and the patched no-prompt one ``h0`` (``[b, T_q, d]``),
    when they fit in ``cache_bytes``; otherwise it recomputes them from the inputs at every pass,
    and memory does not grow with the number of queries.
    """

    def __init__(self, model: nn.Module, prompt: Tensor, data: list, mode: str, cache_bytes: int):
        self.model, self.adapter, self.mode = model, adapter_for(model), mode
        a = self.adapter
        self.prompt = a.check_inputs(model, prompt)
        self.p = prompt.shape[1]
        h = a.embed(model, self.prompt)  # [1, P, d]
        self.ctx = []
        for i in range(a.n_layers(model)):
            self.ctx.append(h)
            h = a.finish(model, i, *a.mix(model, i, h))[1]
        self.data, self.layer, self.patch = data, 0, None
        self.rows = type(a).mix_prefixes is not Adapter.mix_prefixes  # the adapter runs virtual query rows
        width = self.ctx[0].shape[-1] * self.ctx[0].element_size()
        total = sum(q.shape[0] * (q.shape[1] if q.ndim > 2 else 1) for q in data) if isinstance(data, list) else None
        self.cached = total is not None and 2 * total * width <= cache_bytes
        self.states = [self._embed(q) for q in data] if self.cached else None

    def _embed(self, q: Tensor) -> tuple[Tensor, Tensor]:
        a, m = self.adapter, self.model
        q = a.check_inputs(m, q)
        hq = a.embed(m, torch.cat([self.prompt.expand(q.shape[0], *self.prompt.shape[1:]), q], 1))[:, self.p:]
        return hq.clone(), a.embed(m, q)  # a copy: a view would keep the prompt's rows alive in the cache

    def _teacher_mix(self, i: int, hq: Tensor) -> tuple[Tensor, Tensor]:
        """``(m_C, s_C)`` of the query positions read after the prompt, from the prompt's states."""
        if hq.shape[1] == 1 and self.rows:  # one-token queries as virtual rows after the prompt: O(b P), not O(b P^2)
            lengths = torch.full((hq.shape[0],), self.p, dtype=torch.long)
            m_c, s_c = self.adapter.mix_prefixes(self.model, i, self.ctx[i], hq.transpose(0, 1), lengths)  # [1, b, .]
            return m_c.transpose(0, 1), s_c.transpose(0, 1)
        ctx = self.ctx[i].expand(hq.shape[0], *self.ctx[i].shape[1:])
        m_c, s_c = self.adapter.mix(self.model, i, torch.cat([ctx, hq], 1))
        return m_c[:, self.p:], s_c[:, self.p:]

    def _step(self, i: int, hq: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        """Both states one layer up; the no-prompt one under the patch fitted so far."""
        a, m = self.adapter, self.model
        hq_next = a.finish(m, i, *self._teacher_mix(i, hq))[1]
        if self.mode == "teacher":
            return hq_next, hq_next
        with _hooked(m, self.patch, True, True) if self.patch is not None else contextlib.nullcontext():
            return hq_next, a.finish(m, i, *a.mix(m, i, h0))[1]

    def __iter__(self):
        """Per batch ``(m_C, s_C, m_0, s_0)`` of the current layer at the query positions."""
        for b, q in enumerate(self.data):
            if self.cached:
                hq, h0 = self.states[b]
            else:
                hq, h0 = self._embed(q)
                for i in range(self.layer):
                    hq, h0 = self._step(i, hq, h0)
            h0 = hq if self.mode == "teacher" else h0
            yield (*self._teacher_mix(self.layer, hq), *self.adapter.mix(self.model, self.layer, h0))

    def advance(self, patch: Patch | None) -> None:
        """Move to the next layer, ``patch`` (everything fitted so far) now in place below it."""
        self.patch = patch
        if self.cached:
            self.states = [self._step(self.layer, hq, h0) for hq, h0 in self.states]
        self.layer += 1


def _input_deltas(model: nn.Module, names, d: Tensor) -> dict[str, Delta]:
    """``dW = W D`` for every input matrix, as stored, factored."""
    out = {}
    for name in names:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        w = getattr(module, attr).detach().double()
        layout = weight_layout(module, name)
        math = (w if layout == "out_in" else w.T) @ d  # [out, in]
        out[name] = _factor(math if layout == "out_in" else math.T).to(getattr(module, attr).dtype)
    return out


@torch.no_grad()
def thought_patch(model: nn.Module, prompt: Tensor, queries: Any, *, ridge: float = 0.0,
                  mode: Literal["sequential", "teacher"] = "sequential", inputs: bool = True,
                  output: Literal["affine", "vector"] | None = "affine", batch_size: int = 4096,
                  rank: int | None = None, solver: Literal["normal", "qr"] = "normal", cache_bytes: int = 2**30,
                  distributed: bool = False, progress: bool | None = None, keep_bos: bool = False,
                  layers: Any = None) -> ThoughtPatch:
    """Fit one static patch that stands in for ``prompt`` (module docstring).

    ``prompt [P, ...]`` (or ``[1, P, ...]``): the context to drop, as model inputs (embeddings
    ``[P, d_in]`` for our models). ``queries``: calibration queries ``[m, T_q, ...]`` read after the
    prompt, every position fitted; or a re-iterable of such batches. ``ridge``: ``lambda`` of the
    per-position mean objective. ``inputs`` / ``output``: which sides to fit. ``rank``: keep every
    matrix delta at its top ``rank`` singular directions *during* the fit, so that the output side
    and the layers above fit on top of the truncated update (``ThoughtPatch.truncate`` cuts after
    the fit instead, and the layers above never see it). ``solver``: ``"normal"`` accumulates the
    normal equations (fastest); ``"qr"`` a streamed QR factor of the data (about 3x the least-squares
    work, rounding amplified by the square root of the condition number instead of all of it, and
    exact training residuals). The states of the
    calibration positions are kept between layers while they fit in ``cache_bytes`` and recomputed
    otherwise (memory then independent of the number of queries). ``distributed=True``: this
    process holds one shard of the calibration queries and every process of the default
    ``torch.distributed`` group calls ``thought_patch`` with the same arguments (launch with
    ``torchrun``); the per-layer sums are all-reduced before each solve, so every process gets the
    fit of all the shards together. Language models only: ``keep_bos=True`` keeps the prompt's first
    token (a BOS the heads attend to) in front of every query in the no-prompt pass too;
    ``layers`` (indices, e.g. ``range(4, 12)``) fits only that band and leaves the others unpatched.
    Returns a ``ThoughtPatch``.
    """
    if mode not in ("sequential", "teacher"):
        raise InputError(f"mode must be 'sequential' or 'teacher', got {mode!r}")
    if output not in ("affine", "vector", None):
        raise InputError(f"output must be 'affine', 'vector' or None, got {output!r}")
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge >= 0:
        raise InputError(f"ridge must be a number >= 0, got {ridge!r}")
    if not inputs and output is None:
        raise InputError("nothing to fit: inputs=False and output=None")
    if solver not in ("normal", "qr"):
        raise InputError(f"solver must be 'normal' or 'qr', got {solver!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise InputError(f"rank must be None or an int >= 1, got {rank!r}")
    adapter = adapter_for(model)
    if adapter.traced:  # a language model: token ids, the model's own forward (thought_hf.py)
        from tokenpatch.thought.hf import thought_patch_lm

        return thought_patch_lm(model, adapter, prompt, _batches(queries, batch_size), ridge=ridge, mode=mode,
                                inputs=inputs, output=output, rank=rank, solver=solver, distributed=distributed,
                                progress=progress, fit_types=(ThoughtPatch, LayerFit), keep_bos=keep_bos,
                                layers=layers)
    if keep_bos or layers is not None:
        raise InputError("keep_bos and layers are for language models (token ids); this model fits every layer")
    if not isinstance(prompt, Tensor) or prompt.ndim not in (2, 3) or (prompt.ndim == 3 and prompt.shape[0] != 1):
        raise InputError("prompt must be a tensor [P, ...] (or [1, P, ...]) of model inputs, got "
                         f"{tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__}")
    if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise InputError("distributed=True needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group, e.g. under torchrun)")
    source = _Source(model, prompt if prompt.ndim == 3 else prompt[None], _batches(queries, batch_size), mode,
                     cache_bytes)
    adapter = source.adapter
    deltas: dict[str, Delta] = {}
    fits: list[LayerFit] = []
    for i in progress_bar(range(adapter.n_layers(model)), progress, desc="thought_patch", unit="layer"):
        sites = adapter.sites(model, i)
        fit = {"layer": i, "ridge": float(ridge)}
        if inputs and sites.inputs:
            acc = _accumulate(((s_0.flatten(0, -2), (s_c - s_0).flatten(0, -2)) for _, s_c, _, s_0 in source),
                              distributed, solver)
            d, solved_rank, cond = _solve(acc, ridge, False, f"layer {i} input side")
            fit.update(n=acc.n, input_residual=_residual(acc, d), input_rank=solved_rank, input_condition=cond)
            deltas.update(_cut(_input_deltas(model, sites.inputs, d), rank))
        if output is not None and sites.output is not None:
            fit.update(_fit_output(model, adapter, i, sites.output, source, deltas, output, ridge, distributed, solver))
            deltas.update(_cut(deltas, rank))
        fits.append(LayerFit(**{"n": 0, **fit}))
        source.advance(Patch(deltas, None, {}) if deltas else None)
    if not deltas:
        raise InputError("nothing was fitted: the model has no input sites and no output sites")
    meta = {"model": {**adapter.describe(model), "fingerprint": files.fingerprint(model)}, "static": True, "thought": {
        "mode": mode, "ridge": float(ridge), "inputs": inputs, "output": output, "rank": rank, "solver": solver,
        "prompt_len": source.p,
        "positions": fits[0].n}}
    return ThoughtPatch(Patch(deltas, None, meta), fits)


def compress(model: nn.Module, prompt: Tensor, queries: Any, **options) -> Patch:
    """Prompt compression in one call: the thought patch of ``prompt`` fitted on the calibration
    ``queries`` (``thought_patch`` and its ``options``), with its fit diagnostics in the metadata.

        patch = tp.compress(model, prompt, queries)
        tp.save_patch(patch, "prompt.safetensors")           # later, elsewhere:
        out = tp.functional_call(model, tp.load_patch("prompt.safetensors"), new_queries)   # no prompt
    """
    fit = thought_patch(model, prompt, queries, **options)
    meta = dict(fit.patch.meta)
    meta["thought"] = {**meta["thought"], "fits": [f.to_dict() for f in fit.fits]}
    return Patch(dict(fit.patch.items()), None, meta)


def _fit_output(model, adapter, i: int, site, source: _Source, deltas: dict, output: str, ridge: float,
                distributed: bool, solver: str) -> dict:
    """The output side of layer ``i`` on top of its fitted input side: adds to ``deltas``, returns diagnostics."""
    kind, name = site
    module_name = name.rpartition(".")[0]
    module = model.get_submodule(module_name)
    if output == "vector" and kind != "bias":
        raise InputError(f"layer {i}: {name} is an output matrix without a bias; a thought vector needs a bias to "
                         "live in: use output='affine'")
    affine = kind == "bias"
    current = Patch(deltas, None, {}) if deltas else None

    def pairs():
        for m_c, s_c, m_0, s_0 in source:
            hidden_c = adapter.finish(model, i, m_c, s_c)[0]
            with _hooked(model, current, True, True) if current is not None else contextlib.nullcontext():
                hidden_0 = adapter.finish(model, i, m_0, s_0)[0]  # with this layer's input patch
            t = ((m_c + module(hidden_c)) - (m_0 + module(hidden_0))).flatten(0, -2)  # [N, d]  what is missing
            x = hidden_0.flatten(0, -2) if output == "affine" else t.new_zeros(t.shape[0], 0)
            yield (torch.cat([x, x.new_ones(x.shape[0], 1)], 1) if affine else x), t

    return _solve_output(pairs(), i, module, name, output, affine, deltas, ridge, distributed, solver)


def _solve_output(pairs, i: int, module: nn.Module, name: str, output: str, affine: bool, deltas: dict, ridge: float,
                  distributed: bool, solver: str) -> dict:
    """The output side's least squares on ``(features, target)`` pairs: the output matrix (``affine``
    output) and its bias (``affine`` features, intercept last) into ``deltas``; returns diagnostics."""
    module_name = name.rpartition(".")[0]
    acc = _accumulate(pairs, distributed, solver)
    a, rank, cond = _solve(acc, ridge, affine, f"layer {i} output side")
    if output == "affine":
        dw = a[:, :-1] if affine else a  # [d, d_hidden]  math layout
        layout = weight_layout(module, name)
        deltas[f"{module_name}.weight"] = _factor(dw if layout == "out_in" else dw.T).to(module.weight.dtype)
    if affine:
        deltas[name] = a[:, -1][None, None].to(module.bias.dtype)  # [1, 1, d]
    return {"n": acc.n, "output_residual": _residual(acc, a), "output_rank": rank, "output_condition": cond}


@torch.no_grad()
def evaluate_thought_patch(model: nn.Module, prompt: Tensor, queries: Tensor,
                           patches: Patch | Mapping[str, Patch], targets: Tensor | None = None,
                           batch_size: int = 4096, reference: Tensor | None = None) -> dict:
    """How well static patches stand in for ``prompt`` on ``queries [m, T_q, ...]`` (held out).

    Outputs at every query position of: the model with the prompt, without it, and without it
    under each patch (``patches``: one, or ``name -> Patch``). Returns ``{"mse_to_context": {name:
    mean squared difference to the with-prompt outputs}, "gap_closed": {name: 1 - that / the
    no-prompt model's}, "task_mse": {...}}``; ``task_mse`` (with ``targets`` shaped like the outputs)
    has the same keys plus ``"with prompt"`` and ``"no prompt"``. ``reference``: the with-prompt
    outputs if already known (``[m, T_q, d_out]``, as the ``"with_prompt"`` entry of the return
    value), to evaluate several patches on one test set without running the prompt again."""
    patches = {"thought patch": patches} if isinstance(patches, Patch) else dict(patches)
    adapter = adapter_for(model)
    prompt = adapter.check_inputs(model, prompt if prompt.ndim == 3 else prompt[None])
    p = prompt.shape[1]
    outs: dict[str, list[Tensor]] = {k: [] for k in ["with prompt", "no prompt", *patches]}
    for q in queries.split(batch_size):
        q = adapter.check_inputs(model, q)
        if reference is None:
            outs["with prompt"].append(adapter.run(model, torch.cat([prompt.expand(q.shape[0], -1, -1), q], 1))[0][:, p:])
        outs["no prompt"].append(adapter.run(model, q)[0])
        for name, patch in patches.items():
            patch.check_model(model)
            with _hooked(model, patch, True, True):
                outs[name].append(adapter.run(model, q)[0])
    if reference is not None:
        if reference.shape != torch.Size([sum(o.shape[0] for o in outs["no prompt"]), *outs["no prompt"][0].shape[1:]]):
            raise InputError(f"reference {tuple(reference.shape)} is not the with-prompt outputs of these queries")
        outs["with prompt"] = [reference]
    cat = {k: torch.cat(v).double() for k, v in outs.items()}
    ref = cat["with prompt"]
    mse = {k: float(((v - ref) ** 2).mean()) for k, v in cat.items() if k != "with prompt"}
    res = {"with_prompt": cat["with prompt"], "mse_to_context": mse, "gap_closed": {k: 1 - v / mse["no prompt"] if mse["no prompt"] > 0 else float("nan")
                                                 for k, v in mse.items()}}
    if targets is not None:
        t = targets.double().reshape(ref.shape)
        res["task_mse"] = {k: float(((v - t) ** 2).mean()) for k, v in cat.items()}
    return res
