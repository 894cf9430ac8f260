"""Induction heads and temporal order on a real model: the head table, the lag curve, serial recall
and their dose-response to ablating the top induction heads against random heads
(``tokenpatch induction report``; ``docs/induction.md``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["run_model", "figure", "markdown", "write"]


def run_model(name: str, n_words: int = 100, prompts: int = 64, lists: int = 20, length: int = 14, shots: int = 2,
              ns=(0, 1, 2, 4, 8, 16), draws: int = 3, exclude_top: int = 50, score_length: int = 50,
              score_sequences: int = 10, seed: int = 0, progress: bool | None = None) -> dict:
    """Every measurement of the report on ``name`` (a ``tokenpatch.pretrained`` model), as JSON."""
    from .interp.induction import head_scores
    from .interp.temporal import dose_response, lag_curve, serial_recall
    from .pretrained import load_pretrained
    from .tasks.recall import lag_prompts, single_token_words

    t0 = time.perf_counter()
    model, tok = load_pretrained(name, progress=progress)
    special = set(tok.all_special_ids)
    bos = tok.bos_token_id
    rows = head_scores(model, length=score_length, sequences=score_sequences, seed=seed, bos=bos,
                       pool=[i for i in range(model.config.vocab_size) if i not in special])
    words = single_token_words(tok)
    ids = lag_prompts([i for _, i in words], n_words, prompts, seed=seed)
    lag = lag_curve(model, ids, bos=bos)
    plus_one = lag["lags"].index(1)

    def lag_one() -> float:
        return lag_curve(model, ids, bos=bos)["mean"][plus_one]

    def recall() -> float:
        return serial_recall(model, tok, [w for w, _ in words], length, shots, lists, seed)["accuracy"]

    heads = len(rows)
    ns = [n for n in ns if n <= heads - exclude_top]
    return {
        "model": name, "heads": heads, "top_heads": rows[:16], "words": len(words),
        "settings": {"n_words": n_words, "prompts": prompts, "lists": lists, "length": length, "shots": shots,
                     "draws": draws, "exclude_top": exclude_top, "score_length": score_length,
                     "score_sequences": score_sequences, "seed": seed},
        "lag": lag,
        "recall": serial_recall(model, tok, [w for w, _ in words], length, shots, lists, seed),
        "dose_lag_plus_one": dose_response(model, rows, lag_one, ns, exclude_top, draws, seed, progress),
        "dose_recall": dose_response(model, rows, recall, ns, exclude_top, draws, seed, progress),
        "seconds": time.perf_counter() - t0,
    }


def _band(ax, xs, values, label, colour):
    """Mean and 95% interval over the draws (random) or a plain line (top)."""
    m = np.array([np.mean(v) for v in values])
    ci = np.array([1.96 * np.std(v, ddof=1) / len(v) ** 0.5 if len(v) > 1 else 0.0 for v in values])
    ax.plot(xs, m, "o-", color=colour, label=label)
    ax.fill_between(xs, m - ci, m + ci, color=colour, alpha=0.2, lw=0)


def figure(result: dict, path: Path) -> Path:
    """Lag curve (lags -5..+5 with 95% intervals) and both dose-response curves."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    lag = result["lag"]
    keep = [i for i, l in enumerate(lag["lags"]) if -5 <= l <= 5]
    xs = [lag["lags"][i] for i in keep]
    m, ci = np.array(lag["mean"])[keep], np.array(lag["ci95"])[keep]
    axes[0].errorbar(xs, m, yerr=ci, fmt="o-", capsize=3)
    axes[0].set_xlabel("lag (0: the repeated word; +1: its successor)")
    axes[0].set_ylabel("next-token probability")
    axes[0].set_title(f"lag curve ({result['settings']['prompts']} prompts of {result['settings']['n_words']} words)")
    for ax, key, ylabel in ((axes[1], "dose_lag_plus_one", "probability at lag +1"),
                            (axes[2], "dose_recall", "serial-recall accuracy per position")):
        d = result[key]
        xs = [max(n, 0.5) for n in d["n"]]
        _band(ax, xs, [[v] for v in d["top"]], "top induction heads", "#d94801")
        _band(ax, xs, d["random"], f"random heads (outside the top {d['exclude_top']})", "#08519c")
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(n) for n in d["n"]])
        ax.set_xlabel("heads ablated (zero)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(result["model"])
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(result: dict, figure_name: str) -> str:
    lag = result["lag"]
    i0 = lag["lags"].index(0)
    peak = lag["lags"][int(np.argmax(lag["mean"]))]
    s = result["settings"]
    lines = [f"## {result['model']}", "",
             f"{result['heads']} heads; {result['words']} single-token nouns; {result['seconds'] / 60:.1f} min.", "",
             f"![{result['model']}]({figure_name})", "",
             "| lag | -2 | -1 | 0 | +1 | +2 |", "|---|---|---|---|---|---|",
             "| p | " + " | ".join(f"{lag['mean'][i0 + k]:.2e} ± {lag['ci95'][i0 + k]:.1e}" for k in (-2, -1, 0, 1, 2)) + " |",
             "", f"Peak at lag {peak:+d}. Serial recall ({s['lists']} lists of {s['length']}, {s['shots']} shots): "
                 f"accuracy {result['recall']['accuracy']:.3f}, whole lists {result['recall']['exact']:.2f}.", "",
             "| heads ablated | lag +1, top | lag +1, random (mean of draws) | recall, top | recall, random |",
             "|---|---|---|---|---|"]
    a, b = result["dose_lag_plus_one"], result["dose_recall"]
    for k, n in enumerate(a["n"]):
        lines.append(f"| {n} | {a['top'][k]:.2e} | {np.mean(a['random'][k]):.2e} | {b['top'][k]:.3f} | "
                     f"{np.mean(b['random'][k]):.3f} |")
    lines += ["", "| layer | head | diagonal | detector |", "|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['head']} | {r['diagonal']:.3f} | {r['detector']:.3f} |" for r in result["top_heads"][:8]]
    return "\n".join(lines)


def write(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    name = f"induction-{result['model']}.png"
    figure(result, out / name)
    (out / f"induction-{result['model']}.json").write_text(json.dumps(result, indent=1))
    path = out / f"induction-{result['model']}.md"
    path.write_text(markdown(result, name) + "\n")
    return path

