"""The compared methods, extracted from one task's prompt and splits (``docs/prompt-compression.md``
§2): every method becomes a ``Method`` (how it runs a batch of queries) whose settings were chosen
on the dev split, never on test. ``compare.py`` scores them.

Vectors (``tokenpatch.baselines``): the task vector and the function vector (a layer chosen on
dev), the in-context vector (a strength chosen on dev), the thought vector and the attention shift.
Patches (``tokenpatch.thought``, ``tokenpatch.baselines.baking``): the thought patch, fitted on the
calibration split's queries with their answers (ridge chosen by the dev KL to ICL, or by GCV from the
fit's own sums), at full rank and at rank r, on the demonstrations the prompted model writes itself
(no labels: ``sample_calibration``, cut by ``demonstrations``; the ridge the dev split chose for
the calibration split's fit), and the gradient baselines: prompt baking (a peft
LoRA of rank r trained on KL to the prompted model) for multiples of the thought patch's fit time,
and the hybrid (the thought patch, then baking on top).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenpatch.arch import adapter_for
from tokenpatch.baselines.baking import bake
from tokenpatch.baselines.steering import Steering, steer
from tokenpatch.baselines.vectors import (
    attention_shift,
    function_vectors,
    in_context_vectors,
    task_vectors,
    thought_vector,
)
from tokenpatch.errors import InputError
from tokenpatch.patch import Patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import apply
from tokenpatch.thought.calibration import batched, demonstration_start, demonstrations, sample_calibration
from tokenpatch.thought.front import thought_patch
from tokenpatch.workbench.methods import Encoded, Method, answer_logits

ICV_STRENGTHS = (0.01, 0.03, 0.1, 0.3, 1.0)  # the in-context vector's lambda, chosen on dev
# and its demonstration pairs, chosen with it: each query read alone against it with its answer, or (the
# authors' pairing, a text against its rewrite) the input word alone against the answer alone
ICV_PAIRINGS = {
    "query-answer": lambda enc: (enc.demo_batch(False), enc.demo_batch(True)),
    "word-word": lambda enc: (enc.word_batch(False), enc.word_batch(True)),
}
SAMPLE_LENGTH = 32  # tokens per self-written calibration continuation


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def steered(model: nn.Module, name: str, s: Steering, seconds: float, skip: int, info: dict | None = None) -> Method:
    """Steering in the queries' forward (every position but the ``skip`` leading tokens, or the last
    one) and, for every-position steering, in each generated token's (a last-position edit lives on
    in the KV cache)."""

    def prefill(batch: dict):
        return steer(model, s, (batch["position_ids"] >= skip) & (batch["attention_mask"] > 0))

    every = s.position == "all"
    return Method(
        name, False, prefill, (lambda: steer(model, s)) if every else contextlib.nullcontext, seconds, s.nbytes, info
    )


def patched(model: nn.Module, name: str, patch: Patch, seconds: float, info: dict) -> Method:
    nbytes = sum(
        t.numel() * t.element_size() for d in patch.values() for t in ((d.u, d.v) if hasattr(d, "u") else (d,))
    )
    return Method(name, False, lambda batch: apply(model, patch), lambda: apply(model, patch), seconds, nbytes, info)


def choose(
    model: nn.Module, enc: Encoded, candidates: dict[Any, Steering], name: str, progress: bool | None
) -> tuple[Any, list]:
    """The candidate that does best on the dev split: the most dev answers whose first token is ranked
    first, ties broken by the mean log-probability of that token. Returns ``(key, [[key, hits, logp]])``."""
    batch, first = enc.batch("dev", False), enc.first("dev")
    scores = []
    for key in progress_bar(list(candidates), progress, desc=f"{name} on dev", unit="candidate"):
        logp = answer_logits(model, batch, steered(model, name, candidates[key], 0.0, len(enc.prefix))).cpu()
        hits = int((logp.argmax(-1) == first).sum())
        scores.append((key, hits, float(logp.gather(1, first[:, None]).mean())))
    best = max(scores, key=lambda s: (s[1], s[2]))
    return best[0], [list(s) for s in scores]


def dev_kl(model: nn.Module, enc: Encoded, method: Method, reference) -> float:
    """``KL(p_ICL || p_method)`` at the dev queries' answer position (mean, nats)."""
    logp = answer_logits(model, enc.batch("dev", False), method)
    return float((reference.exp() * (reference - logp)).sum(-1).mean())


def _vectors(
    model: nn.Module, enc: Encoded, want, seed: int, n_heads: int, effect_prompts: int | None, progress
) -> dict[str, Method]:
    out: dict[str, Method] = {}
    skip = len(enc.prefix)
    prompted, plain = enc.batch("calibration", True, answers=True), enc.batch("calibration", False, answers=True)
    n_q = enc.n_query("calibration", answers=True)
    if want("thought_vector"):
        s, secs = timed(lambda: thought_vector(model, prompted, plain, n_q, skip))
        out["thought_vector"] = steered(model, "thought vector", s, secs, skip)
    if want("attention_shift"):
        s, secs = timed(lambda: attention_shift(model, prompted, plain, n_q))
        out["attention_shift"] = steered(model, "attention shift", s, secs, skip)
    dummy = enc.batch("calibration", True)  # the prompt and a dummy query, the answer to come
    if want("task_vector"):
        tv, secs = timed(lambda: task_vectors(model, dummy))
        (layer, scores), pick = timed(
            lambda: choose(model, enc, {i: tv.only(i) for i in tv.vectors}, "task vector", progress)
        )
        info = {"layer": layer, "dev_scores": scores, "selection_s": pick}
        out["task_vector"] = steered(model, "task vector", tv.only(layer), secs, skip, info)
    if want("function_vector"):
        corrupted = enc.batch("calibration", True, demos=enc.shuffled_demos(seed))
        first = enc.first("calibration")
        if effect_prompts is not None:  # the heads' effects measured on the first prompts only
            corrupted, first = {k: v[:effect_prompts] for k, v in corrupted.items()}, first[:effect_prompts]
        fv, secs = timed(lambda: function_vectors(model, dummy, corrupted, first, n_heads, progress))
        (layer, scores), pick = timed(
            lambda: choose(model, enc, {i: fv.only(i) for i in fv.vectors}, "function vector", progress)
        )
        info = {"layer": layer, "dev_scores": scores, "selection_s": pick, "heads": fv.meta["heads"]}
        out["function_vector"] = steered(model, "function vector", fv.only(layer), secs, skip, info)
    if want("in_context_vector"):
        ones, secs = timed(
            lambda: {k: in_context_vectors(model, *pairs(enc), 1.0) for k, pairs in ICV_PAIRINGS.items()}
        )
        options = {
            (pairing, lam): Steering(one.site, {i: lam * v for i, v in one.vectors.items()}, one.mode, one.position)
            for pairing, one in ones.items()
            for lam in ICV_STRENGTHS
        }
        ((pairing, lam), scores), pick = timed(lambda: choose(model, enc, options, "in-context vector", progress))
        info = {"pairing": pairing, "strength": lam, "dev_scores": scores, "selection_s": pick}
        out["in_context_vector"] = steered(model, "in-context vector", options[pairing, lam], secs, skip, info)
    return out


def _post_mlp_norm(model: nn.Module) -> bool:
    """Whether some layer's output side goes through a norm after the MLP (Gemma 2/3)."""
    adapter = adapter_for(model)
    sites = (adapter.sites(model, i).output for i in range(adapter.n_layers(model)))
    return any(site is not None and site.kind == "matrix+scale" for site in sites)


def _patches(
    model: nn.Module,
    enc: Encoded,
    want,
    *,
    rank,
    ridge,
    layers,
    sampled,
    bake_times,
    hybrid,
    norm_steps,
    seed,
    progress,
) -> dict[str, Method]:
    out: dict[str, Method] = {}
    queries = batched([q + a for q, a in zip(enc.query["calibration"], enc.answer["calibration"])])
    prompt = torch.tensor(enc.prefix + enc.demos)
    keep_bos = bool(enc.prefix)

    def fit(r, lam, calibration, steps=0):
        return thought_patch(
            model,
            prompt,
            calibration,
            ridge=lam,
            rank=r,
            output="affine",
            keep_bos=keep_bos,
            layers=layers,
            norm_steps=steps,
            progress=progress,
        ).patch

    reference = answer_logits(model, enc.batch("dev", True), Method("ICL", prompted=True))
    ridges = [ridge] if isinstance(ridge, (int, float, str)) else list(ridge)

    full, by_ridge, start = {}, {}, time.perf_counter()
    if len(ridges) > 1:  # the ridge with the lowest KL to ICL on the dev split
        for lam in ridges:
            full[lam] = timed(lambda: fit(None, lam, queries))
            by_ridge[lam] = dev_kl(model, enc, patched(model, "", full[lam][0], 0.0, {}), reference)
    chosen = min(by_ridge, key=by_ridge.get) if by_ridge else ridges[0]
    search = time.perf_counter() - start if by_ridge else 0.0  # every ridge's fit and dev run
    fits = {}  # key: (name, patch, seconds, rank, ridge, info)
    for key, name, r, lam in (
        ("thought_patch", "thought patch", None, chosen),
        ("thought_patch_rank", f"thought patch (rank {rank})", rank, chosen),
        ("thought_patch_gcv", "thought patch (GCV ridge)", None, "gcv"),
    ):
        if not want(key):
            continue
        if r is None and lam in full:  # the ridge sweep fitted it already
            patch, secs = full[lam]
        else:
            patch, secs = timed(lambda: fit(r, lam, queries))
        swept_here = key == "thought_patch"
        info = {"selection_s": search, "dev_kl_by_ridge": [[k, v] for k, v in by_ridge.items()]} if swept_here else {}
        fits[key] = (name, patch, secs, r, lam, info)
    if norm_steps and want("thought_patch_norm") and _post_mlp_norm(model):  # steps chosen on dev, the ridge above
        start = time.perf_counter()
        tried = {k: timed(lambda: fit(None, chosen, queries, k)) for k in norm_steps}
        by_steps = {k: dev_kl(model, enc, patched(model, "", p, 0.0, {}), reference) for k, (p, _) in tried.items()}
        best = min(by_steps, key=by_steps.get)
        info = {
            "norm_steps": best,
            "dev_kl": by_steps[best],
            "dev_kl_by_norm_steps": [[k, v] for k, v in by_steps.items()],
            "selection_s": time.perf_counter() - start,
        }
        name = "thought patch (Gauss-Newton through the norm)"
        fits["thought_patch_norm"] = (name, tried[best][0], tried[best][1], None, chosen, info)
    text = enc.fmt.demos(enc.demo_pairs)
    begin = demonstration_start(text)
    start_ids = enc.tokenizer(begin, add_special_tokens=False)["input_ids"] if begin else None
    for n in sampled if want("thought_patch_sampled") else ():
        rows, s_secs = timed(lambda: sample_calibration(model, prompt, n, SAMPLE_LENGTH, start=start_ids, seed=seed))
        pieces = demonstrations(enc.tokenizer, rows, enc.fmt.separator)
        cal = batched(pieces) if pieces else [rows]  # no whole demonstration written: the continuations
        patch, secs = timed(lambda: fit(None, chosen, cal))  # the ridge chosen on dev above
        info = {"continuations": n, "demonstrations": len(pieces), "sampling_s": s_secs}
        name = f"thought patch (self-written: {n} continuations, their demonstrations)"
        fits[f"thought_patch_sampled_{n}"] = (name, patch, s_secs + secs, None, chosen, info)
    for key, (name, patch, secs, r, lam, more) in fits.items():
        info = {"rank": r, "ridge": lam, "fits": patch.meta["thought"]["fits"], "patch": patch, **more}
        out[key] = patched(model, name, patch, secs, info)
        known = {**dict(more.get("dev_kl_by_ridge", ())), **({lam: more["dev_kl"]} if "dev_kl" in more else {})}
        out[key].info["dev_kl"] = known[lam] if lam in known else dev_kl(model, enc, out[key], reference)
    base = out.get("thought_patch")
    budget = base.extraction_s if base is not None else None
    if budget and bake_times and want("prompt_baking"):
        baked = bake(
            model,
            prompt,
            queries,
            seconds=[k * budget for k in bake_times],
            rank=rank,
            keep_bos=keep_bos,
            seed=seed,
            progress=progress,
        )
        for k, b in zip(sorted(bake_times), baked):
            key = f"prompt_baking_{k:g}x"
            out[key] = patched(
                model,
                f"prompt baking (LoRA rank {rank}, {k:g}x time)",
                b.patch,
                b.seconds,
                {"steps": b.steps, "kl_calibration": b.losses[-1], "patch": b.patch},
            )
    if budget and hybrid and want("thought_patch_baked"):
        (b,) = bake(
            model,
            prompt,
            queries,
            seconds=hybrid * budget,
            rank=rank,
            keep_bos=keep_bos,
            base=base.info["patch"],
            seed=seed,
            progress=progress,
        )
        out["thought_patch_baked"] = patched(
            model,
            f"thought patch + baking ({hybrid:g}x time)",
            b.patch,
            budget + b.seconds,
            {"steps": b.steps, "kl_calibration": [b.losses[0], b.losses[-1]], "patch": b.patch},
        )
    return out


def extract(
    model: nn.Module,
    enc: Encoded,
    *,
    rank: int = 4,
    ridge: Any = 0.0,
    layers: Any = None,
    n_heads: int = 10,
    effect_prompts: int | None = None,
    seed: int = 0,
    sampled: tuple[int, ...] = (),
    bake_times: tuple[float, ...] = (),
    hybrid: float | None = None,
    norm_steps: tuple[int, ...] = (),
    methods: tuple[str, ...] | None = None,
    progress: bool | None = None,
) -> dict[str, Method]:
    """Every method (``methods``: only those keys, ``"thought_patch_sampled"`` and ``"prompt_baking"``
    naming their rows), extracted from the prompt and the calibration split and placed on the dev split.
    ``sampled``: numbers of self-written continuations; ``bake_times``: prompt-baking budgets as
    multiples of the thought patch's fit time; ``hybrid``: the hybrid's budget (the same unit);
    ``norm_steps``: the Gauss-Newton step counts the row that refines the fit through a post-MLP norm
    chooses from on dev (at the ridge chosen on dev; only on a model with such a norm). ``effect_prompts``:
    the function vector's head effects on that many of the calibration prompts (None: all)."""
    if effect_prompts is not None and effect_prompts < 1:
        raise InputError(f"effect_prompts must be at least 1 prompt (or None: all), got {effect_prompts}")
    want = lambda name: methods is None or name in methods  # noqa: E731
    out = {"zero_shot": Method("zero-shot"), "icl": Method("ICL", prompted=True)}
    out.update(
        _patches(
            model,
            enc,
            want,
            rank=rank,
            ridge=ridge,
            layers=layers,
            sampled=sampled,
            bake_times=bake_times,
            hybrid=hybrid,
            norm_steps=norm_steps,
            seed=seed,
            progress=progress,
        )
    )
    out.update(_vectors(model, enc, want, seed, n_heads, effect_prompts, progress))
    return out
