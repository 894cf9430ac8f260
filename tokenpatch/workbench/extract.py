"""How each compared method is extracted from one task's prompt and splits (``docs/prompt-compression.md``
§2): one function per entry of ``registry.py`` (``extract_<key>``, called ``(Extraction, Compared)``,
returning its rows as ``Method``s, how each runs a batch of queries), whose settings were chosen on
the dev split, never on test, and the ``Extraction`` they share (the settings, the rows so far, the
ridge chosen on dev). ``registry.extract`` runs them; ``compare.py`` scores them.

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

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from tokenpatch.arch import adapter_for
from tokenpatch.baselines.baking import bake
from tokenpatch.baselines.steering import Steering
from tokenpatch.baselines.vectors import (
    attention_shift,
    function_vectors,
    in_context_vectors,
    task_vectors,
    thought_vector,
)
from tokenpatch.patch import Patch
from tokenpatch.progress import progress_bar
from tokenpatch.thought.calibration import batched, demonstration_start, demonstrations, sample_calibration
from tokenpatch.thought.front import thought_patch
from tokenpatch.workbench.methods import Encoded, Method, answer_logits, patched, steered

__all__ = ["Extraction", "RidgeChoice", "timed", "choose", "dev_kl", "patched", "steered"]

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


def choose(
    model: nn.Module, enc: Encoded, candidates: dict[Any, Steering], name: str, progress: bool | None
) -> tuple[Any, list]:
    """The candidate that does best on the dev split: the most dev answers whose first token is ranked
    first, ties broken by the mean log-probability of that token. Returns ``(key, [[key, hits, logp]])``."""
    batch, first = enc.batch("dev", False), enc.first("dev")
    scores = []
    for key in progress_bar(list(candidates), progress, desc=f"{name} on dev", unit="candidate"):
        logp = answer_logits(model, batch, steered(model, name, candidates[key], skip=len(enc.prefix))).cpu()
        hits = int((logp.argmax(-1) == first).sum())
        scores.append((key, hits, float(logp.gather(1, first[:, None]).mean())))
    best = max(scores, key=lambda s: (s[1], s[2]))
    return best[0], [list(s) for s in scores]


def dev_kl(model: nn.Module, enc: Encoded, method: Method, reference) -> float:
    """``KL(p_ICL || p_method)`` at the dev queries' answer position (mean, nats)."""
    logp = answer_logits(model, enc.batch("dev", False), method)
    return float((reference.exp() * (reference - logp)).sum(-1).mean())


@dataclass
class RidgeChoice:
    """The thought patch's ridge chosen on dev: ``chosen`` (the lowest KL to ICL on the dev split of
    several, else the one given), the full-rank fits the choice made (ridge -> ``(patch, seconds)``),
    their dev KL (ridge -> nats) and the seconds it took (every fit and dev run; 0 without a choice)."""

    chosen: Any
    fits: dict
    dev_kl: dict
    seconds: float


class Extraction:
    """One task's extraction under way: the model, the encoded task, ``extract``'s ``settings``, the
    rows extracted so far (``rows``: prompt baking reads the thought patch's time), and what several
    methods share, each computed once when first asked for: the ICL reference on dev, the ridge
    chosen on dev, the calibration batches."""

    def __init__(self, model: nn.Module, enc: Encoded, settings: dict):
        self.model, self.enc, self.settings = model, enc, settings
        self.rows: dict[str, Method] = {}
        self.skip = len(enc.prefix)
        self.prompt = torch.tensor(enc.prefix + enc.demos)
        self.keep_bos = bool(enc.prefix)

    @cached_property
    def queries(self) -> list:
        """The calibration split's queries with their answers, batched by length."""
        return batched([q + a for q, a in zip(self.enc.query["calibration"], self.enc.answer["calibration"])])

    @cached_property
    def reference(self):
        """ICL's next-token log-probabilities at the dev queries' answer position."""
        return answer_logits(self.model, self.enc.batch("dev", True), Method("ICL", prompted=True))

    def fit(self, rank, ridge, calibration, norm_steps: int = 0) -> Patch:
        """The thought patch of the prompt on ``calibration`` (affine output side)."""
        return thought_patch(
            self.model,
            self.prompt,
            calibration,
            ridge=ridge,
            rank=rank,
            output="affine",
            keep_bos=self.keep_bos,
            layers=self.settings["layers"],
            norm_steps=norm_steps,
            progress=self.settings["progress"],
        ).patch

    def dev_kl(self, method: Method) -> float:
        return dev_kl(self.model, self.enc, method, self.reference)

    @cached_property
    def ridge(self) -> RidgeChoice:
        """The ridge with the lowest KL to ICL on the dev split, of several given (one: that one)."""
        ridge = self.settings["ridge"]
        ridges = [ridge] if isinstance(ridge, (int, float, str)) else list(ridge)
        fits, by_ridge, start = {}, {}, time.perf_counter()
        if len(ridges) > 1:
            for lam in ridges:
                fits[lam] = timed(lambda: self.fit(None, lam, self.queries))
                by_ridge[lam] = self.dev_kl(patched(self.model, "", fits[lam][0]))
        chosen = min(by_ridge, key=by_ridge.get) if by_ridge else ridges[0]
        return RidgeChoice(chosen, fits, by_ridge, time.perf_counter() - start if by_ridge else 0.0)

    def full_rank(self, ridge) -> tuple[Patch, float]:
        """The full-rank fit at ``ridge`` and its seconds (the ridge choice's, when it made one)."""
        made = self.ridge.fits
        return made[ridge] if ridge in made else timed(lambda: self.fit(None, ridge, self.queries))

    def fitted(
        self, entry, patch: Patch, seconds: float, rank, ridge, more: dict, fields: dict | None = None
    ) -> dict[str, Method]:
        """A thought patch's row (``fields``: those of its name and key): its rank, ridge, per-layer
        fits and ``more``, and its dev KL to ICL."""
        fields = fields or {}
        info = {"rank": rank, "ridge": ridge, "fits": patch.meta["thought"]["fits"], "patch": patch, **more}
        row = entry.method(self.model, patch, seconds, info, **fields)
        known = {**dict(more.get("dev_kl_by_ridge", ())), **({ridge: more["dev_kl"]} if "dev_kl" in more else {})}
        row.info["dev_kl"] = known[ridge] if ridge in known else self.dev_kl(row)
        return {entry.key_of(**fields): row}

    @cached_property
    def calibration_pairs(self) -> tuple[dict, dict, Any]:
        """The calibration queries with their answers, after the prompt and alone, and their lengths."""
        enc = self.enc
        plain = enc.batch("calibration", False, answers=True)
        return enc.batch("calibration", True, answers=True), plain, enc.n_query("calibration", answers=True)

    @cached_property
    def dummy(self) -> dict:
        """The prompt and a dummy query, the answer to come."""
        return self.enc.batch("calibration", True)

    def steering(self, entry, s: Steering, seconds: float, info: dict | None = None) -> dict[str, Method]:
        return {entry.key_of(): entry.method(self.model, s, seconds, info, self.skip)}


# --------------------------------------------------------------------------- one function per entry


def extract_unchanged(x: Extraction, entry) -> dict[str, Method]:
    """Zero-shot and ICL: nothing to extract."""
    return {entry.key_of(): entry.method(x.model)}


def extract_thought_patch(x: Extraction, entry) -> dict[str, Method]:
    """The thought patch at full rank, at the ridge chosen on dev."""
    choice = x.ridge
    patch, secs = x.full_rank(choice.chosen)
    more = {"selection_s": choice.seconds, "dev_kl_by_ridge": [[k, v] for k, v in choice.dev_kl.items()]}
    return x.fitted(entry, patch, secs, None, choice.chosen, more)


def extract_thought_patch_rank(x: Extraction, entry) -> dict[str, Method]:
    """The thought patch at rank ``rank``, at the ridge chosen on dev."""
    rank, lam = x.settings["rank"], x.ridge.chosen
    patch, secs = timed(lambda: x.fit(rank, lam, x.queries))
    return x.fitted(entry, patch, secs, rank, lam, {}, {"rank": rank})


def extract_thought_patch_gcv(x: Extraction, entry) -> dict[str, Method]:
    """The thought patch at full rank, each layer's ridge chosen by GCV from the fit's own sums."""
    patch, secs = x.full_rank("gcv")
    return x.fitted(entry, patch, secs, None, "gcv", {})


def _post_mlp_norm(model: nn.Module) -> bool:
    """Whether some layer's output side goes through a norm after the MLP (Gemma 2/3)."""
    adapter = adapter_for(model)
    sites = (adapter.sites(model, i).output for i in range(adapter.n_layers(model)))
    return any(site is not None and site.norm is not None for site in sites)


def extract_thought_patch_norm(x: Extraction, entry) -> dict[str, Method]:
    """The fit refined through a post-MLP norm (only on a model with one), its Gauss-Newton steps
    chosen on dev from ``norm_steps``, at the ridge chosen on dev."""
    steps = x.settings["norm_steps"]
    if not steps or not _post_mlp_norm(x.model):
        return {}
    chosen = x.ridge.chosen
    start = time.perf_counter()
    tried = {k: timed(lambda: x.fit(None, chosen, x.queries, k)) for k in steps}
    by_steps = {k: x.dev_kl(patched(x.model, "", p)) for k, (p, _) in tried.items()}
    best = min(by_steps, key=by_steps.get)
    info = {
        "norm_steps": best,
        "dev_kl": by_steps[best],
        "dev_kl_by_norm_steps": [[k, v] for k, v in by_steps.items()],
        "selection_s": time.perf_counter() - start,
    }
    return x.fitted(entry, tried[best][0], tried[best][1], None, chosen, info)


def extract_thought_patch_sampled(x: Extraction, entry) -> dict[str, Method]:
    """One row per number of continuations in ``sampled``: the fit on the demonstrations the prompted
    model writes itself (no labels), at the ridge chosen on dev."""
    enc, out = x.enc, {}
    begin = demonstration_start(enc.fmt.demos(enc.demo_pairs))
    start_ids = enc.tokenizer(begin, add_special_tokens=False)["input_ids"] if begin else None
    for n in x.settings["sampled"]:
        rows, s_secs = timed(
            lambda: sample_calibration(x.model, x.prompt, n, SAMPLE_LENGTH, start=start_ids, seed=x.settings["seed"])
        )
        pieces = demonstrations(enc.tokenizer, rows, enc.fmt.separator)
        cal = batched(pieces) if pieces else [rows]  # no whole demonstration written: the continuations
        lam = x.ridge.chosen
        patch, secs = timed(lambda: x.fit(None, lam, cal))
        info = {"continuations": n, "demonstrations": len(pieces), "sampling_s": s_secs}
        out.update(x.fitted(entry, patch, s_secs + secs, None, lam, info, {"n": n}))
    return out


def _budget(x: Extraction) -> float | None:
    """The thought patch's fit time (the gradient rows' unit; None without that row)."""
    base = x.rows.get("thought_patch")
    return base.extraction_s if base is not None else None


def extract_prompt_baking(x: Extraction, entry) -> dict[str, Method]:
    """Prompt baking (a LoRA of rank ``rank`` trained on KL to the prompted model), one row per
    multiple of the thought patch's fit time in ``bake_times``."""
    budget, times, rank = _budget(x), x.settings["bake_times"], x.settings["rank"]
    if not (budget and times):
        return {}
    baked = bake(
        x.model,
        x.prompt,
        x.queries,
        seconds=[k * budget for k in times],
        rank=rank,
        keep_bos=x.keep_bos,
        seed=x.settings["seed"],
        progress=x.settings["progress"],
    )
    out = {}
    for k, b in zip(sorted(times), baked):
        info = {"steps": b.steps, "kl_calibration": b.losses[-1], "patch": b.patch}
        out[entry.key_of(k=k)] = entry.method(x.model, b.patch, b.seconds, info, rank=rank, k=k)
    return out


def extract_thought_patch_baked(x: Extraction, entry) -> dict[str, Method]:
    """The hybrid: the thought patch, then baking on top for ``hybrid`` times its fit time."""
    budget, hybrid = _budget(x), x.settings["hybrid"]
    if not (budget and hybrid):
        return {}
    (b,) = bake(
        x.model,
        x.prompt,
        x.queries,
        seconds=hybrid * budget,
        rank=x.settings["rank"],
        keep_bos=x.keep_bos,
        base=x.rows["thought_patch"].info["patch"],
        seed=x.settings["seed"],
        progress=x.settings["progress"],
    )
    info = {"steps": b.steps, "kl_calibration": [b.losses[0], b.losses[-1]], "patch": b.patch}
    return {entry.key_of(): entry.method(x.model, b.patch, budget + b.seconds, info, hybrid=hybrid)}


def extract_thought_vector(x: Extraction, entry) -> dict[str, Method]:
    prompted, plain, n_q = x.calibration_pairs
    s, secs = timed(lambda: thought_vector(x.model, prompted, plain, n_q, x.skip))
    return x.steering(entry, s, secs)


def extract_attention_shift(x: Extraction, entry) -> dict[str, Method]:
    prompted, plain, n_q = x.calibration_pairs
    s, secs = timed(lambda: attention_shift(x.model, prompted, plain, n_q))
    return x.steering(entry, s, secs)


def extract_task_vector(x: Extraction, entry) -> dict[str, Method]:
    """The task vector at the layer chosen on dev."""
    model, progress = x.model, x.settings["progress"]
    tv, secs = timed(lambda: task_vectors(model, x.dummy))
    (layer, scores), pick = timed(
        lambda: choose(model, x.enc, {i: tv.only(i) for i in tv.vectors}, entry.name, progress)
    )
    return x.steering(entry, tv.only(layer), secs, {"layer": layer, "dev_scores": scores, "selection_s": pick})


def extract_function_vector(x: Extraction, entry) -> dict[str, Method]:
    """The function vector of the ``n_heads`` heads with the largest effects (on ``effect_prompts``
    of the calibration prompts), at the layer chosen on dev."""
    model, enc, s = x.model, x.enc, x.settings
    corrupted = enc.batch("calibration", True, demos=enc.shuffled_demos(s["seed"]))
    first = enc.first("calibration")
    if s["effect_prompts"] is not None:  # the heads' effects measured on the first prompts only
        corrupted, first = {k: v[: s["effect_prompts"]] for k, v in corrupted.items()}, first[: s["effect_prompts"]]
    fv, secs = timed(lambda: function_vectors(model, x.dummy, corrupted, first, s["n_heads"], s["progress"]))
    (layer, scores), pick = timed(
        lambda: choose(model, enc, {i: fv.only(i) for i in fv.vectors}, entry.name, s["progress"])
    )
    info = {"layer": layer, "dev_scores": scores, "selection_s": pick, "heads": fv.meta["heads"]}
    return x.steering(entry, fv.only(layer), secs, info)


def extract_in_context_vector(x: Extraction, entry) -> dict[str, Method]:
    """The in-context vector at the pairing and strength chosen on dev (``ICV_PAIRINGS``, ``ICV_STRENGTHS``)."""
    model, enc = x.model, x.enc
    ones, secs = timed(lambda: {k: in_context_vectors(model, *pairs(enc), 1.0) for k, pairs in ICV_PAIRINGS.items()})
    options = {
        (pairing, lam): Steering(one.site, {i: lam * v for i, v in one.vectors.items()}, one.mode, one.position)
        for pairing, one in ones.items()
        for lam in ICV_STRENGTHS
    }
    ((pairing, lam), scores), pick = timed(lambda: choose(model, enc, options, entry.name, x.settings["progress"]))
    info = {"pairing": pairing, "strength": lam, "dev_scores": scores, "selection_s": pick}
    return x.steering(entry, options[pairing, lam], secs, info)
