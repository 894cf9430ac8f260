"""Prompt compression on a language model, measured: a k-shot prompt replaced by a thought patch,
a thought vector, an attention shift, a task vector or a function vector, against zero-shot (the
floor) and the prompt itself (ICL, the ceiling), on the same word-pair task, prompt and splits
(``docs/prompt-compression.md``).

    result = compare(model, tokenizer, load_task("present_past"), shots=10)
    result["methods"]["thought_patch"]["accuracy"], result["methods"]["thought_patch"]["kl"]

Per method and test query: greedy decoding of the answer (whole-word match, ``wordpairs.is_correct``)
and the answer position's next-token distribution, scored by ``KL(p_ICL || p_method)`` (fidelity to
the prompt). Costs: extraction seconds, bytes stored and the prefill time on the test queries as a
ratio to zero-shot. Layers of the task and function vectors are chosen on the dev split (the
answer's first token ranked first, then its mean log-probability); nothing is chosen on the test split.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenpatch.baselines.steering import Steering, steer
from tokenpatch.baselines.vectors import attention_shift, function_vectors, task_vectors, thought_vector
from tokenpatch.errors import InputError
from tokenpatch.patch import Patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import apply
from tokenpatch.stats import wilson
from tokenpatch.tasks.wordpairs import Format, WordPairs, is_correct
from tokenpatch.thought.front import thought_patch
from tokenpatch.workbench.methods import (
    Encoded,
    Method,
    answer_logits,
    greedy,
    on_device,
    single_token_answers,
)

# key (snake_case, as in the results) -> the name shown
METHODS = {
    "zero_shot": "zero-shot",
    "icl": "ICL",
    "thought_patch": "thought patch",
    "thought_patch_rank": "thought patch (rank r)",
    "thought_vector": "thought vector",
    "attention_shift": "attention shift",
    "task_vector": "task vector",
    "function_vector": "function vector",
}


def _steered(model: nn.Module, name: str, s: Steering, seconds: float, skip: int, info: dict | None = None) -> Method:
    """Steering in the queries' forward (every position but the ``skip`` leading tokens, or the last
    one) and, for every-position steering, in each generated token's (a last-position edit lives on
    in the KV cache)."""

    def prefill(batch: dict):
        return steer(model, s, (batch["position_ids"] >= skip) & (batch["attention_mask"] > 0))

    every = s.position == "all"
    return Method(
        name, False, prefill, (lambda: steer(model, s)) if every else contextlib.nullcontext, seconds, s.nbytes, info
    )


def _patched(model: nn.Module, name: str, patch: Patch, seconds: float, info: dict) -> Method:
    nbytes = sum(
        t.numel() * t.element_size() for d in patch.values() for t in ((d.u, d.v) if hasattr(d, "u") else (d,))
    )
    return Method(name, False, lambda batch: apply(model, patch), lambda: apply(model, patch), seconds, nbytes, info)


def choose_layer(
    model: nn.Module, enc: Encoded, candidates: Steering, name: str, progress: bool | None
) -> tuple[int, list]:
    """The layer whose vector does best on the dev split: the most dev answers whose first token is
    ranked first, ties broken by the mean log-probability of that token."""
    batch, first = enc.batch("dev", False), enc.first("dev")
    scores = []
    for layer in progress_bar(sorted(candidates.vectors), progress, desc=f"{name} layer", unit="layer"):
        logp = answer_logits(
            model, batch, Method(name, prefill=lambda b, s=candidates.only(layer): steer(model, s))
        ).cpu()
        hits = int((logp.argmax(-1) == first).sum())
        scores.append((layer, hits, float(logp.gather(1, first[:, None]).mean())))
    best = max(scores, key=lambda s: (s[1], s[2]))
    return best[0], [[layer, hits, lp] for layer, hits, lp in scores]


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def extract(
    model: nn.Module,
    enc: Encoded,
    *,
    rank: int = 4,
    ridge: float = 0.0,
    layers: Any = None,
    n_heads: int = 10,
    seed: int = 0,
    methods: tuple[str, ...] | None = None,
    progress: bool | None = None,
) -> dict[str, Method]:
    """Every method of ``METHODS`` (or those named in ``methods``), extracted from the calibration
    split and, for the task and function vectors, placed on the dev split."""
    want = lambda name: methods is None or name in methods  # noqa: E731
    out = {"zero_shot": Method("zero-shot"), "icl": Method("ICL", prompted=True)}
    prompted, plain = enc.batch("calibration", True, answers=True), enc.batch("calibration", False, answers=True)
    n_q = enc.n_query("calibration", answers=True)
    if want("thought_patch") or want("thought_patch_rank"):
        rows = [q + a for q, a in zip(enc.query["calibration"], enc.answer["calibration"])]
        by_len: dict[int, list] = {}
        for r in rows:
            by_len.setdefault(len(r), []).append(r)
        queries = [torch.tensor(v) for _, v in sorted(by_len.items())]
        prompt = torch.tensor(enc.prefix + enc.demos)
        keep_bos = bool(enc.prefix)
        output = "affine"
        fit = lambda r, lam: (
            thought_patch(  # noqa: E731
                model,
                prompt,
                queries,
                ridge=lam,
                rank=r,
                output=output,
                keep_bos=keep_bos,
                layers=layers,
                progress=progress,
            ).patch
        )
        ridges = [float(ridge)] if isinstance(ridge, (int, float)) else [float(x) for x in ridge]
        dev, dev_kl, full, start = enc.batch("dev", False), {}, {}, time.perf_counter()
        if len(ridges) > 1:  # the ridge with the lowest KL to ICL on the dev split
            ref = answer_logits(model, enc.batch("dev", True), out["icl"])
            for lam in ridges:
                full[lam] = _timed(lambda: fit(None, lam))
                p = _patched(model, "", full[lam][0], 0.0, {})
                dev_kl[lam] = float((ref.exp() * (ref - answer_logits(model, dev, p))).sum(-1).mean())
        chosen = min(dev_kl, key=dev_kl.get) if dev_kl else ridges[0]
        search = time.perf_counter() - start if dev_kl else 0.0  # every ridge's fit and dev run
        for key, name, r in (
            ("thought_patch", "thought patch", None),
            ("thought_patch_rank", f"thought patch (rank {rank})", rank),
        ):
            if not want(key):
                continue
            patch, secs = full[chosen] if r is None and chosen in full else _timed(lambda: fit(r, chosen))
            fits = patch.meta["thought"]["fits"]
            out[key] = _patched(
                model,
                name,
                patch,
                secs,
                {
                    "rank": r,
                    "ridge": chosen,
                    "selection_s": search,
                    "dev_kl_by_ridge": [[k, v] for k, v in dev_kl.items()],
                    "output": output,
                    "fits": fits,
                    "patch": patch,
                },
            )
    if want("thought_vector"):
        s, secs = _timed(lambda: thought_vector(model, prompted, plain, n_q, len(enc.prefix)))
        out["thought_vector"] = _steered(model, "thought vector", s, secs, len(enc.prefix))
    if want("attention_shift"):
        s, secs = _timed(lambda: attention_shift(model, prompted, plain, n_q))
        out["attention_shift"] = _steered(model, "attention shift", s, secs, len(enc.prefix))
    dummy = enc.batch("calibration", True)  # the prompt and a dummy query, the answer to come
    if want("task_vector"):
        tv, secs = _timed(lambda: task_vectors(model, dummy))
        (layer, scores), pick = _timed(lambda: choose_layer(model, enc, tv, "task vector", progress))
        out["task_vector"] = _steered(
            model,
            "task vector",
            tv.only(layer),
            secs,
            len(enc.prefix),
            {"layer": layer, "dev_scores": scores, "selection_s": pick},
        )
    if want("function_vector"):
        corrupted = enc.batch("calibration", True, demos=enc.shuffled_demos(seed))
        fv, secs = _timed(
            lambda: function_vectors(model, dummy, corrupted, enc.first("calibration"), n_heads, progress)
        )
        (layer, scores), pick = _timed(lambda: choose_layer(model, enc, fv, "function vector", progress))
        out["function_vector"] = _steered(
            model,
            "function vector",
            fv.only(layer),
            secs,
            len(enc.prefix),
            {"layer": layer, "dev_scores": scores, "selection_s": pick, "heads": fv.meta["heads"]},
        )
    return out


def _prefill_seconds(model: nn.Module, batch: dict, method: Method, repeats: int = 2) -> float:
    """The best of ``repeats`` timed forwards of ``batch`` with the method in place (a patch is
    written once, before the clock starts: its forward is the plain model's)."""
    batch, best = on_device(model, batch), math.inf
    with torch.no_grad(), method.prefill(batch):
        for _ in range(repeats):
            _, secs = _timed(lambda: model(**batch, use_cache=False, logits_to_keep=1))
            best = min(best, secs)
    return best


def evaluate(
    model: nn.Module,
    enc: Encoded,
    methods: dict[str, Method],
    split: str = "test",
    progress: bool | None = None,
    timing_rows: int = 32,
) -> dict[str, dict]:
    """Per method: greedy accuracy with its 95% Wilson interval (``"accuracy_interval"``,
    ``{"mean", "lo", "hi"}``: ``stats.wilson``), ``KL(p_ICL || p_method)`` at the answer
    position (mean over the queries, nats), and the prefill time on ``timing_rows`` queries as a
    ratio to zero-shot."""
    pairs = enc.splits[split]
    steps = min(8, max(len(a) for a in enc.answer[split]) + 1)
    batches = {False: enc.batch(split, False), True: enc.batch(split, True)}
    timing = {k: {n: v[:timing_rows] for n, v in b.items()} for k, b in batches.items()}
    runs = {}
    for name in progress_bar(list(methods), progress, desc=f"evaluate ({len(pairs)} queries)", unit="method"):
        m = methods[name]
        tokens, logp = greedy(model, batches[m.prompted], m, steps)
        texts = enc.tokenizer.batch_decode(tokens.cpu())
        runs[name] = (
            [is_correct(t, ys) for t, (_, ys) in zip(texts, pairs)],
            logp.cpu(),
            texts,
            _prefill_seconds(model, timing[m.prompted], m),
        )
    if "icl" not in runs:
        raise InputError("evaluate needs the ICL method (the KL is to it)")
    ref = runs["icl"][1]
    rows = {}
    for name, (correct, logp, texts, secs) in runs.items():
        k, n = sum(correct), len(correct)
        kl = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)  # [B]
        m = methods[name]
        rows[name] = {
            "name": m.name,
            "correct": k,
            "n": n,
            "accuracy": k / n,
            "accuracy_interval": wilson(k, n),
            "kl": float(kl.mean()),
            "kl_median": float(kl.median()),
            "extraction_s": m.extraction_s,
            "bytes": m.nbytes,
            "overhead": secs / runs["zero_shot"][3] if "zero_shot" in runs else None,
            "examples": [
                [x, t.split("\n", 1)[0].strip(), ok] for (x, _), t, ok in list(zip(pairs, texts, correct))[:5]
            ],
        }
    return rows


def compare(
    model: nn.Module,
    tokenizer,
    task: WordPairs,
    *,
    shots: int = 10,
    seed: int = 0,
    test: int | None = None,
    calibration: int = 40,
    dev: int = 30,
    fmt: Format = Format(),
    rank: int = 4,
    ridge: float = 0.0,
    layers: Any = None,
    n_heads: int = 10,
    methods: tuple[str, ...] | None = None,
    progress: bool | None = None,
) -> dict:
    """Every method on one task (``extract`` then ``evaluate`` on the test split). Returns a JSON-able
    dict (methods keyed as in ``METHODS``) but for ``"patches"``: the fitted thought patches
    (``tp.save_patch`` them; ``json.dumps`` the rest). ``ridge``: a number, or several to choose
    from on the dev split by the KL to ICL."""
    if model.training:
        raise InputError("the model is in training mode: call model.eval()")
    if test is not None and test < 1:
        raise InputError(f"test must be at least 1 pair (or None: all that are left), got {test}")
    if shots < 2 and (methods is None or "function_vector" in methods):
        raise InputError(
            "the function vector's corrupted prompts shuffle the answers of the demonstrations: "
            f"it needs shots >= 2, got {shots}"
        )
    splits = task.split(seed, demos=max(shots, 10), calibration=calibration, dev=dev, test=test)
    enc = Encoded(tokenizer, splits, shots, fmt)
    built = extract(
        model,
        enc,
        rank=rank,
        ridge=ridge,
        layers=layers,
        n_heads=n_heads,
        seed=seed,
        methods=methods,
        progress=progress,
    )
    rows = evaluate(model, enc, built, progress=progress)
    for name, m in built.items():
        if m.info:
            rows[name].update({k: _finite(v) for k, v in m.info.items() if k != "patch"})
    zero, icl = rows["zero_shot"]["correct"], rows["icl"]["correct"]
    n = rows["icl"]["n"]
    for r in rows.values():
        r["gain_recovered"] = (r["correct"] - zero) / (icl - zero) if icl > zero else None
    c = model.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    kv = 2 * c.num_hidden_layers * kv_heads * _head_dim(model) * len(enc.prefix + enc.demos)
    rows["icl"]["bytes"] = kv * model.get_input_embeddings().weight.element_size()  # the prompt's KV cache
    return {
        "task": task.name,
        "description": task.description,
        "shots": shots,
        "seed": seed,
        "prompt_tokens": len(enc.prefix + enc.demos),
        "splits": {k: len(v) for k, v in splits.items()},
        "answers": single_token_answers(tokenizer, task, fmt),
        "informative": 5 * (icl - zero) >= n,  # >= 20 points
        "methods": rows,
        "patches": {n: m.info["patch"] for n, m in built.items() if m.info and "patch" in m.info},
    }


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (an infinite condition number) as ``None``: valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _head_dim(model: nn.Module) -> int:
    c = model.config
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
