"""Induction heads and temporal order, measured on a model: the head table, the lag curve, serial
recall, their dose-response to ablating the top induction heads against random heads, and each
head's part of the token patches that implement copying (``tokenpatch induction report``;
``docs/induction.md``). ``run_model`` takes a real model's name, ``run_lm`` a small LM of
``tokenpatch.models.lm``; both return JSON-able dicts that ``induction_page.write`` turns into markdown, a figure and JSON."""

from __future__ import annotations

import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from tokenpatch.errors import InputError
from tokenpatch.interp.ablation import ablate_heads, control_pool, random_sets, select_heads
from tokenpatch.interp.head_patches import NODES, head_patches, pooled_share
from tokenpatch.interp.induction import head_scores, repeated_tokens
from tokenpatch.interp.temporal import dose_response, lag_curve, serial_recall
from tokenpatch.models.lm import lm_inputs, load_lm
from tokenpatch.stats import mean_interval
from tokenpatch.tasks.recall import lag_prompts, single_token_words
from tokenpatch.tasks.repeats import BOS, LMData
from tokenpatch.workbench.report.induction_page import markdown, write
from tokenpatch.workbench.report.section import Section
from tokenpatch.workbench.train.lm import LMTrain, train_lm
from tokenpatch.workbench.train.shipped import place_shipped
from tokenpatch.workbench.zoo import pretrained

__all__ = ["run_model", "run_lm", "patch_study", "bos_and_pool", "induction_section"]


def _lag_and_dose(model, rows, ids, bos, inputs_of, ns, exclude_top, draws, seed, progress) -> dict:
    """The lag curve of the prompts ``ids`` and the dose-response of p(lag +1), each with 95% intervals
    ``{"mean", "lo", "hi"}`` (``stats.mean_interval``; the lag curve's are lists over the lags)."""
    lag = lag_curve(model, ids, bos=bos, inputs_of=inputs_of)
    plus_one = lag["lags"].index(1)
    del lag["per_prompt"]

    def lag_one() -> dict:
        per = lag_curve(model, ids, bos=bos, inputs_of=inputs_of)["per_prompt"]
        return mean_interval([p[plus_one] for p in per])

    return {
        "lag": lag,
        "dose_lag_plus_one": dose_response(model, rows, lag_one, ns, exclude_top, draws, seed, progress),
    }


def bos_and_pool(model, tok) -> tuple[int | None, list[int]]:
    """The id put before every scored sequence (the tokenizer's BOS, else its smallest special id) and
    the ids random sequences are drawn from (every id but the special ones)."""
    special = set(tok.all_special_ids)
    bos = tok.bos_token_id if tok.bos_token_id is not None else min(special, default=None)
    return bos, [i for i in range(model.config.vocab_size) if i not in special]


def _has_control(rows: list[dict], n: int, exclude_top: int) -> bool:
    """Whether the random control of ``n`` heads has ``n`` heads to draw from (``ablation.control_pool``)."""
    return n <= len(control_pool(rows, n, exclude_top))


def patch_study(
    model,
    rows,
    pool,
    bos,
    inputs_of=None,
    n: int = 2,
    length: int = 20,
    sequences: int = 4,
    exclude_top: int = 50,
    draws: int = 3,
    seed: int = 0,
    progress=None,
) -> dict:
    """Each head's share of every layer's token patch where the model copies (the second copy of
    ``[BOS, r_1..r_L, r_1..r_L]``), and the patch norms with the top-``n`` induction heads of ``rows``
    ablated against ``n`` random heads outside the top ``max(exclude_top, n)`` (``interp.head_patches``);
    ``n`` is capped by that pool, and ``None`` comes back when it is empty."""
    n = max((k for k in range(n + 1) if _has_control(rows, k, exclude_top)), default=0)  # top and random alike
    if n == 0:
        return None  # no head outside the top: no control
    tokens = repeated_tokens(pool, length, sequences, seed + 1, bos)  # [S, 1 + 2L] (or [S, 2L] without BOS)
    first = tokens.shape[1] - length  # the second copy: the queries where the model copies
    x = tokens if inputs_of is None else inputs_of(tokens)
    query = list(range(first, tokens.shape[1]))
    clean = head_patches(model, x, query, progress=progress)
    top = select_heads(rows, n)
    with ablate_heads(model, top):
        ablated = head_patches(model, x, query, progress=progress)
    randoms, random_heads = [], random_sets(rows, n, exclude_top, draws, seed)
    for heads in random_heads:
        with ablate_heads(model, heads):
            randoms.append(head_patches(model, x, query, progress=progress).patch_norm.mean((1, 2)).tolist())
    moved = clean.patch_norm > 1e-6 * clean.patch_norm.max()  # the closure is relative to |ds|: skip ~0 patches
    return {
        "length": length,
        "sequences": sequences,
        "n": n,
        "nodes": NODES,
        "top": top,
        "random_heads": random_heads,
        "share": pooled_share(clean).tolist(),  # [L][H]
        "patch_norm": {
            "clean": clean.patch_norm.mean((1, 2)).tolist(),
            "top": ablated.patch_norm.mean((1, 2)).tolist(),
            "random": randoms,
        },
        "closure_max": float(clean.closure[moved].max()),
        "closure_median": float(clean.closure[moved].median()),
        "linear_error_median": clean.linear_error.flatten(1).median(1).values.tolist(),
    }


def run_model(
    name: str,
    n_words: int = 100,
    prompts: int = 64,
    lists: int = 20,
    length: int = 14,
    shots: int = 2,
    ns=(0, 1, 2, 4, 8, 16),
    draws: int = 3,
    exclude_top: int | None = None,
    score_length: int = 50,
    score_sequences: int = 10,
    patch_heads: int = 2,
    seed: int = 0,
    progress: bool | None = None,
) -> dict:
    """Every measurement of the report on ``name`` (a ``tokenpatch.workbench.zoo.pretrained`` model), as JSON.

    ``exclude_top``: random heads come from outside the top M; default ``min(50, heads // 4)`` (paper
    B's code uses 50, which on a 72-head model would leave only 22 heads to draw from)."""
    t0 = time.perf_counter()
    model, tok = pretrained.load_pretrained(name, progress=progress)
    bos, pool = bos_and_pool(model, tok)
    rows = head_scores(model, length=score_length, sequences=score_sequences, seed=seed, bos=bos, pool=pool)
    words = single_token_words(tok)
    ids = lag_prompts([i for _, i in words], n_words, prompts, seed=seed)
    heads = len(rows)
    exclude_top = min(50, heads // 4) if exclude_top is None else exclude_top
    ns = [n for n in ns if _has_control(rows, n, exclude_top)]

    def recall() -> dict:
        r = serial_recall(model, tok, [w for w, _ in words], length, shots, lists, seed)
        return r["accuracy_interval"]

    return {
        "model": name,
        "heads": heads,
        "top_heads": rows[:16],
        "words": len(words),
        "settings": {
            "n_words": n_words,
            "prompts": prompts,
            "lists": lists,
            "length": length,
            "shots": shots,
            "draws": draws,
            "exclude_top": exclude_top,
            "score_length": score_length,
            "score_sequences": score_sequences,
            "patch_heads": patch_heads,
            "seed": seed,
        },
        **_lag_and_dose(model, rows, ids, bos, None, ns, exclude_top, draws, seed, progress),
        "recall": serial_recall(model, tok, [w for w, _ in words], length, shots, lists, seed),
        "dose_recall": dose_response(model, rows, recall, ns, exclude_top, draws, seed, progress),
        "patches": patch_study(
            model,
            rows,
            pool,
            bos,
            None,
            patch_heads,
            exclude_top=exclude_top,
            draws=draws,
            seed=seed,
            progress=progress,
        ),
        "seconds": time.perf_counter() - t0,
    }


def run_lm(
    path: str | Path,
    n_words: int = 21,
    prompts: int = 256,
    ns=(0, 1, 2, 4),
    draws: int = 10,
    exclude_top: int = 1,
    score_length: int | None = None,
    score_sequences: int = 20,
    patch_heads: int = 2,
    seed: int = 0,
    progress: bool | None = None,
) -> dict:
    """The report's measurements on a small LM of ``tokenpatch.models.lm`` (no words: the lag prompts are
    permutations of ``n_words`` token ids; ``score_length``: the copies' length, default the longest
    that fits, at most 20), as JSON."""
    t0 = time.perf_counter()
    model = load_lm(path)
    inputs_of = lambda ids: lm_inputs(model, ids)  # noqa: E731
    pool = list(range(1, model.config.d_out))
    positions = model.config.d_in - model.config.d_out  # T, BOS included
    if not 3 <= n_words <= min(len(pool), positions - 2):
        raise InputError(
            f"{n_words} items per lag prompt: the model reads {positions} positions and {len(pool)} "
            f"tokens, so choose 3 .. {min(len(pool), positions - 2)}"
        )
    score_length = score_length or min(20, (positions - 1) // 2)
    rows = head_scores(
        model, length=score_length, sequences=score_sequences, seed=seed, bos=BOS, pool=pool, inputs_of=inputs_of
    )
    ids = lag_prompts(pool, n_words, prompts, seed=seed)
    ns = [n for n in ns if _has_control(rows, n, exclude_top)]
    return {
        "model": Path(path).stem,
        "describe": model.config.describe(),
        "heads": len(rows),
        "top_heads": rows[:16],
        "settings": {
            "n_words": n_words,
            "prompts": prompts,
            "draws": draws,
            "exclude_top": exclude_top,
            "score_length": score_length,
            "score_sequences": score_sequences,
            "patch_heads": patch_heads,
            "seed": seed,
        },
        **_lag_and_dose(model, rows, ids, BOS, inputs_of, ns, exclude_top, draws, seed, progress),
        "patches": patch_study(
            model,
            rows,
            pool,
            BOS,
            inputs_of,
            patch_heads,
            length=score_length,
            sequences=8,
            exclude_top=exclude_top,
            draws=draws,
            seed=seed,
            progress=progress,
        )
        if model.config.mlp
        else None,
        "seconds": time.perf_counter() - t0,
    }


def induction_section(
    out: Path,
    data=None,
    cfg=None,
    shape: dict | None = None,
    options: dict | None = None,
    progress: bool | None = None,
    shipped: bool = True,
):
    """The report ``Section``: train the small LM of ``tokenpatch.models.lm`` (default: its default recipe;
    ``data``, ``cfg``, ``shape`` as ``train_lm``'s) at ``out/small-lm.safetensors``, so a second
    call reads it back, and run ``run_lm`` on it (``options``: more of its arguments). ``shipped``: with
    the default recipe, start from the LM shipped with tokenpatch (``train.shipped``, trained by that
    recipe: read back, not trained again); ``False`` trains it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = out / "small-lm.safetensors"
    placed = shipped and data is None and cfg is None and not shape and place_shipped("small-lm", path)
    train_lm(path, data or LMData(), cfg or LMTrain(), **(shape or {}), progress=progress)
    result = run_lm(path, progress=progress, **(options or {}))
    result["seconds"] = time.perf_counter() - t0  # training included
    write(result, out)
    how = "shipped with tokenpatch (`reproduce --full` trains it here)" if placed else "trained here"
    result["shipped"] = bool(placed)
    body = (
        f"The small LM of `tokenpatch.models.lm` ({result['describe']}; default recipe), {how}, then "
        "`tokenpatch induction report --model small-lm.safetensors`. Real models: "
        "`tokenpatch induction report --model smollm2-135m` (docs/induction.md).\n\n"
        + markdown(result, f"induction-{result['model']}.png").split("\n", 2)[2]
    )
    data = {k: v for k, v in result.items() if k != "model"}
    return Section("induction", "Induction heads in a small LM", body, [f"induction-{result['model']}.png"], data)
