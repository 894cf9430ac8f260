"""Induction heads and temporal order, measured on a model: the head table, the lag curve, serial
recall, their dose-response to ablating the top induction heads against random heads, and each
head's part of the token patches that implement copying (``tokenpatch induction report``;
``docs/induction.md``). ``run_model`` takes a real model's name, ``run_lm`` a small LM of
``tokenpatch.models.lm``; both return JSON-able dicts that ``write`` turns into markdown, a figure and JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tokenpatch.errors import InputError
from tokenpatch.interp.ablation import ablate_heads, control_pool, random_sets, select_heads
from tokenpatch.interp.head_patches import NODES, head_patches, pooled_share
from tokenpatch.interp.induction import head_scores, repeated_tokens
from tokenpatch.interp.temporal import dose_response, lag_curve, pooled, serial_recall
from tokenpatch.models.lm import lm_inputs, load_lm
from tokenpatch.stats import half_width, mean_interval
from tokenpatch.tasks.recall import lag_prompts, single_token_words
from tokenpatch.tasks.repeats import BOS, LMData
from tokenpatch.workbench.report.section import Section
from tokenpatch.workbench.train.lm import LMTrain, train_lm
from tokenpatch.workbench.zoo import pretrained

__all__ = ["run_model", "run_lm", "patch_study", "figure", "markdown", "write", "induction_section"]


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


def _random(d: dict, k: int) -> dict:
    """The random control of dose-response ``d`` at its ``k``-th n, pooled over its head sets."""
    exact = d.get("exact", [False] * len(d["n"]))  # results written before the exact control: drawn sets
    return pooled(d["random"][k], exact=bool(exact[k]))


def _pool(d: dict) -> str:
    """Where the random heads of dose-response ``d`` come from: outside the top max(M, n)."""
    m = d["exclude_top"]
    return str(m) if max(d["n"]) <= m else f"max({m}, n)"


def _dose_panel(ax, d, ylabel):
    xs = [max(n, 0.5) for n in d["n"]]
    top = d["top"]
    rand = [_random(d, k) for k in range(len(d["n"]))]
    for vals, label, colour in (
        (top, "top induction heads (band: over items)", "#d94801"),
        (
            rand,
            f"random heads outside the top {_pool(d)} "
            f"(band: {'over items' if all(d.get('exact', [False])) else 'over head sets'})",
            "#08519c",
        ),
    ):
        m, lo, hi = (np.array([v[key] for v in vals]) for key in ("mean", "lo", "hi"))
        ax.plot(xs, m, "o-", color=colour, label=label)
        ax.fill_between(xs, np.clip(lo, 0, 1), np.clip(hi, 0, 1), color=colour, alpha=0.2, lw=0)  # probabilities
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs, [str(n) for n in d["n"]])
    ax.set_xlabel("heads ablated (zero); bands: 95% intervals (Student's t)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def figure(result: dict, path: Path) -> Path:
    """Lag curve (lags -5..+5, 95% intervals), the dose-response curves, and the token-patch norms per
    layer with the top induction heads ablated against random heads."""
    panels = ["lag", "dose_lag_plus_one"] + (["dose_recall"] if "dose_recall" in result else [])
    panels += ["patches"] if result.get("patches") else []
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), constrained_layout=True)
    for ax, key in zip(np.atleast_1d(axes), panels):
        if key == "lag":
            lag = result["lag"]
            keep = [i for i, l in enumerate(lag["lags"]) if -5 <= l <= 5]
            m, lo, hi = (np.array(lag[key])[keep] for key in ("mean", "lo", "hi"))
            ax.errorbar([lag["lags"][i] for i in keep], m, yerr=[m - lo, hi - m], fmt="o-", capsize=3)
            ax.set_xlabel("lag (0: the repeated item; +1: its successor)")
            ax.set_ylabel("next-token probability")
            ax.set_title(
                f"lag curve ({result['settings']['prompts']} prompts of {result['settings']['n_words']} items)"
            )
        elif key == "patches":
            p = result["patches"]
            clean = np.array(p["patch_norm"]["clean"])  # [L]
            layers = np.arange(len(clean))
            safe = np.where(clean > 0, clean, np.nan)
            ax.axhline(1, color="k", lw=1)
            for tl in sorted({h[0] for h in p["top"]}):
                ax.axvline(tl, color="#d94801", lw=0.8, ls=":")
            ax.plot(
                layers,
                np.array(p["patch_norm"]["top"]) / safe,
                "o-",
                color="#d94801",
                label=f"top {p['n']} induction heads ablated (dotted: their layers)",
            )
            ax.plot(
                layers,
                np.array(p["patch_norm"]["random"]).mean(0) / safe,
                "s-",
                color="#08519c",
                label=f"{p['n']} random heads ablated (mean of sets)",
            )
            ax.set_xticks(layers if len(layers) <= 12 else layers[::2])
            ax.set_xlabel("layer")
            ax.set_ylabel("token patch norm / clean")
            ax.set_title("patches where the model copies (second copy)")
            ax.legend(fontsize=8)
        else:
            _dose_panel(
                ax,
                result[key],
                "probability at lag +1" if key == "dose_lag_plus_one" else "serial-recall accuracy per position",
            )
        ax.grid(True, alpha=0.3)
    fig.suptitle(result["model"] + (f" ({result['describe']})" if "describe" in result else ""))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cell(c, fmt: str) -> str:
    """``mean ± half-width`` of an interval ``{"mean", "lo", "hi"}`` (the mean alone when it is a point)."""
    m, ci = c["mean"], half_width(c)
    return f"{m:{fmt}} ± {ci:.1e}" if ci else f"{m:{fmt}}"


def _sets(sets: list) -> str:
    """The random control's head sets, in words."""
    if len(sets) == 1:
        return f"the one set {[tuple(h) for h in sets[0]]}"
    return f"mean over {len(sets)} sets" + (f" {[[tuple(h) for h in s] for s in sets]}" if len(sets) <= 3 else "")


def _lag(k: int) -> str:
    return f"{k:+d}" if k else "0"


def markdown(result: dict, figure_name: str) -> str:
    lag = result["lag"]
    i0 = lag["lags"].index(0)
    near = [k for k in (-2, -1, 0, 1, 2) if k in lag["lags"]]  # a prompt of 3 or 4 items has fewer lags
    peak = lag["lags"][int(np.argmax(lag["mean"]))]
    half = half_width(lag)  # per lag
    s = result["settings"]
    what = f"{result['words']} single-token nouns" if "words" in result else f"{s['n_words']} token ids per prompt"
    lines = [
        f"## {result['model']}",
        "",
        f"{result['heads']} heads; {what}; {result['seconds'] / 60:.1f} min.",
        "",
        f"![{result['model']}]({figure_name})",
        "",
        "| lag | " + " | ".join(_lag(k) for k in near) + " |",
        "|---" * (1 + len(near)) + "|",
        "| p | " + " | ".join(f"{lag['mean'][i0 + k]:.2e} ± {half[i0 + k]:.1e}" for k in near) + " |",
        "",
        f"Peak at lag {_lag(peak)} (± 95% intervals over prompts).",
    ]
    if "recall" in result:
        lines[-1] += (
            f" Serial recall ({s['lists']} lists of {s['length']}, {s['shots']} shots): accuracy "
            f"{result['recall']['accuracy']:.3f}, whole lists {result['recall']['exact']:.2f}."
        )
    doses = [("lag +1", result["dose_lag_plus_one"], ".2e")]
    doses += [("recall", result["dose_recall"], ".3f")] if "dose_recall" in result else []
    head = " | ".join(f"{k}, top | {k}, random" for k, _, _ in doses)
    lines += ["", f"| heads ablated | {head} |", "|---" * (1 + 2 * len(doses)) + "|"]
    for k, n in enumerate(doses[0][1]["n"]):
        cells = []
        for _, d, fmt in doses:
            cells += [_cell(d["top"][k], fmt), _cell(_random(d, k), fmt)]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "| layer | head | diagonal | detector | previous-token |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['layer']} | {r['head']} | {r['diagonal']:.3f} | {r['detector']:.3f} | {r['previous_token']:.3f} |"
        for r in result["top_heads"][:8]
    ]
    p = result.get("patches")
    if p:
        share = np.array(p["share"])  # [L, H]
        top = {tuple(h) for h in p["top"]}
        lines += [
            "",
            f"Token patches at the {p['length']} second-copy positions of {p['sequences']} repeated "
            f"sequences (`interp.head_patches`; exact split, closure at most {p['closure_max']:.1e}). Ablated: top "
            f"{p['n']} induction heads {sorted(top)}; random: {_sets(p['random_heads'])}.",
            "",
            "| layer | patch norm, clean | top ablated | random ablated | largest share (head) | "
            "top heads' share | first-order miss |",
            "|---|---|---|---|---|---|---|",
        ]
        rand = np.array(p["patch_norm"]["random"]).mean(0)
        for l in range(len(share)):
            mine = f"{sum(share[l, h] for tl, h in top if tl == l):.2f}" if any(tl == l for tl, _ in top) else "-"
            lines.append(
                f"| {l} | {p['patch_norm']['clean'][l]:.3f} | {p['patch_norm']['top'][l]:.3f} | {rand[l]:.3f} | "
                f"{share[l].max():.2f} ({int(share[l].argmax())}) | {mine} | {p['linear_error_median'][l]:.2f} |"
            )
    return "\n".join(lines)


def write(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    name = f"induction-{result['model']}.png"
    figure(result, out / name)
    (out / f"induction-{result['model']}.json").write_text(json.dumps(result, indent=1))
    path = out / f"induction-{result['model']}.md"
    path.write_text(markdown(result, name) + "\n")
    return path


def induction_section(
    out: Path, data=None, cfg=None, shape: dict | None = None, options: dict | None = None, progress: bool | None = None
):
    """The report ``Section``: train the small LM of ``tokenpatch.models.lm`` (default: its default recipe;
    ``data``, ``cfg``, ``shape`` as ``train_lm``'s) at ``out/small-lm.safetensors``, so a second
    call reads it back, and run ``run_lm`` on it (``options``: more of its arguments)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = out / "small-lm.safetensors"
    train_lm(path, data or LMData(), cfg or LMTrain(), **(shape or {}), progress=progress)
    result = run_lm(path, progress=progress, **(options or {}))
    result["seconds"] = time.perf_counter() - t0  # training included
    write(result, out)
    body = (
        f"The small LM of `tokenpatch.models.lm` ({result['describe']}; default recipe), trained here, then "
        "`tokenpatch induction report --model small-lm.safetensors`. Real models: "
        "`tokenpatch induction report --model smollm2-135m` (docs/induction.md).\n\n"
        + markdown(result, f"induction-{result['model']}.png").split("\n", 2)[2]
    )
    data = {k: v for k, v in result.items() if k != "model"}
    return Section("induction", "Induction heads in a small LM", body, [f"induction-{result['model']}.png"], data)
