"""The thought-patch fit for our own models (``ICLTransformer``, ``Block``), from embeddings
(``docs/thought-patches.md``; ``front.py`` has the math). ``thought_patch`` calls ``fit_icl``."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from tokenpatch.arch import OutputSite, adapter_for, weight_layout
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch import Delta, Patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import hooked
from tokenpatch.thought.fit import (
    LayerFit,
    ThoughtPatch,
    cut_rank,
    provenance,
    ridge_setting,
    solve_output,
    static_patch,
)
from tokenpatch.thought.lstsq import accumulate, factor, residual, solve

__all__ = ["fit_icl"]


class _Source:
    """The states of the calibration positions at one layer, batch by batch.

    The prompt runs once: by causality its hidden states at every layer (``ctx[i]``, ``[1, P, d]``)
    are the same whatever query follows, so a query's with-prompt state at layer ``i + 1`` needs
    only its own state at layer ``i`` and ``ctx[i]``. Per batch the source keeps two states at the
    current layer, the with-prompt one ``hq`` and the patched no-prompt one ``h0`` (``[b, T_q, d]``),
    when they fit in ``cache_bytes``; otherwise it recomputes them from the inputs at every pass,
    and memory does not grow with the number of calibration inputs.
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
        self.rows = a.implements("mix_prefixes")  # the adapter runs virtual query rows
        width = self.ctx[0].shape[-1] * self.ctx[0].element_size()
        total = sum(q.shape[0] * (q.shape[1] if q.ndim > 2 else 1) for q in data) if isinstance(data, list) else None
        self.cached = total is not None and 2 * total * width <= cache_bytes
        self.states = [self._embed(q) for q in data] if self.cached else None

    def _embed(self, q: Tensor) -> tuple[Tensor, Tensor]:
        a, m = self.adapter, self.model
        q = a.check_inputs(m, q)
        hq = a.embed(m, torch.cat([self.prompt.expand(q.shape[0], *self.prompt.shape[1:]), q], 1))[:, self.p :]
        return hq.clone(), a.embed(m, q)  # a copy: a view would keep the prompt's rows alive in the cache

    def _teacher_mix(self, i: int, hq: Tensor) -> tuple[Tensor, Tensor]:
        """``(m_C, s_C)`` of the query positions read after the prompt, from the prompt's states."""
        if hq.shape[1] == 1 and self.rows:  # one-token queries as virtual rows after the prompt: O(b P), not O(b P^2)
            lengths = torch.full((hq.shape[0],), self.p, dtype=torch.long)
            m_c, s_c = self.adapter.mix_prefixes(self.model, i, self.ctx[i], hq.transpose(0, 1), lengths)  # [1, b, .]
            return m_c.transpose(0, 1), s_c.transpose(0, 1)
        ctx = self.ctx[i].expand(hq.shape[0], *self.ctx[i].shape[1:])
        m_c, s_c = self.adapter.mix(self.model, i, torch.cat([ctx, hq], 1))
        return m_c[:, self.p :], s_c[:, self.p :]

    def _step(self, i: int, hq: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        """Both states one layer up; the no-prompt one under the patch fitted so far."""
        a, m = self.adapter, self.model
        hq_next = a.finish(m, i, *self._teacher_mix(i, hq))[1]
        if self.mode == "teacher":
            return hq_next, hq_next
        with hooked(m, self.patch, True, True) if self.patch is not None else contextlib.nullcontext():
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
        out[name] = factor(math if layout == "out_in" else math.T).to(getattr(module, attr).dtype)
    return out


def fit_icl(
    model: nn.Module,
    prompt: Tensor,
    batches: list,
    *,
    ridge: float | str,
    mode: str,
    inputs: bool,
    output: str | None,
    rank: int | None,
    solver: str,
    cache_bytes: int,
    distributed: bool,
    progress: bool | None,
) -> ThoughtPatch:
    """``thought_patch`` on our own models: the arguments already checked there."""
    if not isinstance(prompt, Tensor) or prompt.ndim not in (2, 3) or (prompt.ndim == 3 and prompt.shape[0] != 1):
        raise InputError(
            "prompt must be a tensor [P, ...] (or [1, P, ...]) of model inputs, got "
            f"{tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__}"
        )
    if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise InputError(
            "distributed=True needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    source = _Source(model, prompt if prompt.ndim == 3 else prompt[None], batches, mode, cache_bytes)
    adapter = source.adapter
    deltas: dict[str, Delta] = {}
    fits: list[LayerFit] = []
    for i in progress_bar(range(adapter.n_layers(model)), progress, desc="thought_patch", unit="layer"):
        sites = adapter.sites(model, i)
        fit = {"layer": i, "ridge": ridge_setting(ridge)}
        if inputs and sites.inputs:
            acc = accumulate(
                ((s_0.flatten(0, -2), (s_c - s_0).flatten(0, -2)) for _, s_c, _, s_0 in source), distributed, solver
            )
            d, solved_rank, cond, lam, _ = solve(acc, ridge, False, f"layer {i} input side")
            fit.update(
                n=acc.n,
                input_residual=residual(acc, d, lam),
                input_rank=solved_rank,
                input_condition=cond,
                input_ridge=lam,
            )
            deltas.update(cut_rank(_input_deltas(model, sites.inputs, d), rank))
        if output is not None and sites.output is not None:
            fit.update(_fit_output(model, adapter, i, sites.output, source, deltas, output, ridge, distributed, solver))
            deltas.update(cut_rank(deltas, rank))
        fits.append(LayerFit(**{"n": 0, **fit}))
        source.advance(Patch(deltas) if deltas else None)
    if not deltas:
        raise InputError("nothing was fitted: the model has no input sites and no output sites")
    meta = provenance(
        model,
        adapter,
        fits,
        mode=mode,
        ridge=ridge_setting(ridge),
        inputs=inputs,
        output=output,
        rank=rank,
        solver=solver,
        prompt_len=source.p,
    )
    return ThoughtPatch(static_patch(deltas, meta), fits)


def _fit_output(
    model,
    adapter,
    i: int,
    site: OutputSite,
    source: _Source,
    deltas: dict,
    output: str,
    ridge: float | str,
    distributed: bool,
    solver: str,
) -> dict:
    """The output side of layer ``i`` on top of its fitted input side: adds to ``deltas``, returns diagnostics."""
    name = site.name
    if not site.plain:
        raise UnsupportedModelError(
            f"layer {i}: a {site.kind!r} output site ({name}) is fitted on language models only "
            "(tp.thought_patch with a traced adapter)"
        )
    module_name = site.module
    module = model.get_submodule(module_name)
    if output == "vector" and not site.affine:
        raise InputError(
            f"layer {i}: {name} is an output matrix without a bias; a thought vector needs a bias to "
            "live in: use output='affine'"
        )
    affine = site.affine
    current = Patch(deltas) if deltas else None

    def pairs():
        for m_c, s_c, m_0, s_0 in source:
            hidden_c = adapter.finish(model, i, m_c, s_c)[0]
            with hooked(model, current, True, True) if current is not None else contextlib.nullcontext():
                hidden_0 = adapter.finish(model, i, m_0, s_0)[0]  # with this layer's input patch
            t = ((m_c + module(hidden_c)) - (m_0 + module(hidden_0))).flatten(0, -2)  # [N, d]  what is missing
            yield hidden_0.flatten(0, -2), t

    bias = name if affine else None
    return solve_output(pairs(), i, model, f"{module_name}.weight", bias, output, deltas, ridge, distributed, solver)
