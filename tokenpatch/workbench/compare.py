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

import math
from typing import Any

import torch
from torch import nn

from tokenpatch.arch.hf import EAGER_NAN
from tokenpatch.errors import InputError
from tokenpatch.progress import progress_bar
from tokenpatch.stats import wilson
from tokenpatch.tasks.wordpairs import Format, WordPairs, is_correct
from tokenpatch.workbench.extract import timed
from tokenpatch.workbench.methods import Encoded, Method, answer_logits, greedy, on_device, single_token_answers
from tokenpatch.workbench.registry import REGISTRY, Compared, closed_form, extract, names, wanted

__all__ = ["compare", "evaluate", "closed_form", "METHODS"]

# key (snake_case, as in the results) -> the name shown, read from the registry (``registry.py``); the
# parametric rows are "thought_patch_sampled_N" (N self-written continuations) and "prompt_baking_Kx" (K
# times the fit's time), their names templates of those fields
METHODS = names()


def _prefill_seconds(model: nn.Module, batch: dict, method: Method, repeats: int = 2) -> float:
    """The best of ``repeats`` timed forwards of ``batch`` with the method in place (a patch is
    written once, before the clock starts: its forward is the plain model's)."""
    batch, best = on_device(model, batch), math.inf
    with torch.no_grad(), method.prefill(batch):
        for _ in range(repeats):
            _, secs = timed(lambda: model(**batch, use_cache=False, logits_to_keep=1))
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
    ridge: Any = 0.0,
    layers: Any = None,
    n_heads: int = 10,
    effect_prompts: int | None = None,
    timing_rows: int = 32,
    lead: list[int] | None = None,
    sampled: tuple[int, ...] = (),
    bake_times: tuple[float, ...] = (),
    hybrid: float | None = None,
    norm_steps: tuple[int, ...] = (),
    methods: tuple[str, ...] | None = None,
    progress: bool | None = None,
    registry: tuple[Compared, ...] = REGISTRY,
) -> dict:
    """Every method of ``registry`` on one task (``extract`` then ``evaluate`` on the test split). Returns a JSON-able
    dict (methods keyed as in the registry, ``METHODS``) but for ``"patches"``: the fitted thought patches
    (``tp.save_patch`` them; ``json.dumps`` the rest). ``ridge``: a number, ``"gcv"``, or several to
    choose from on the dev split by the KL to ICL. ``lead``: the token ids every sequence starts
    with (default: the tokenizer's BOS, ``leading_tokens``). ``sampled``, ``bake_times``, ``hybrid``,
    ``norm_steps``: the self-written, gradient and through-the-norm rows (``extract``); ``effect_prompts``: the function
    vector's head effects on that many calibration prompts (``extract``); ``timing_rows``: queries in the
    prefill timing (``evaluate``). ``"closed_form_choice"``: the closed-form
    thought patch with the lowest dev KL, the one the goal is checked on."""
    if model.training:
        raise InputError("the model is in training mode: call model.eval()")
    if timing_rows < 1:
        raise InputError(f"timing_rows must be at least 1 query, got {timing_rows}")
    if test is not None and test < 1:
        raise InputError(f"test must be at least 1 pair (or None: all that are left), got {test}")
    for entry in wanted(methods, registry):
        if shots < entry.min_shots:
            raise InputError(f"{entry.why_shots}: it needs shots >= {entry.min_shots}, got {shots}")
    splits = task.split(seed, demos=max(shots, 10), calibration=calibration, dev=dev, test=test)
    enc = Encoded(tokenizer, splits, shots, fmt, lead)
    if not bool(torch.isfinite(answer_logits(model, enc.batch("dev", True), Method("ICL", prompted=True))).all()):
        raise InputError(f"compare: the model's forward with the prompt gives non-finite log-probabilities{EAGER_NAN}")
    built = extract(
        model,
        enc,
        rank=rank,
        ridge=ridge,
        layers=layers,
        n_heads=n_heads,
        effect_prompts=effect_prompts,
        seed=seed,
        sampled=sampled,
        bake_times=bake_times,
        hybrid=hybrid,
        norm_steps=norm_steps,
        methods=methods,
        progress=progress,
        registry=registry,
    )
    rows = evaluate(model, enc, built, progress=progress, timing_rows=timing_rows)
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
        "lead": enc.prefix,
        "format": {"query": fmt.query, "answer": fmt.answer, "separator": fmt.separator},
        "closed_form_choice": min(
            (k for k in rows if closed_form(k, registry) and rows[k].get("dev_kl") is not None),
            key=lambda k: rows[k]["dev_kl"],
            default=None,
        ),
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
