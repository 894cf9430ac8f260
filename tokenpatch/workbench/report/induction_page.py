"""What the induction study shows: its figure (patterns, scores, the lag curve and the dose-response to
ablation) and its markdown (``docs/induction.md``); ``write`` puts both, with the JSON, in a folder."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tokenpatch.interp.temporal import pooled
from tokenpatch.stats import half_width

__all__ = ["figure", "markdown", "write"]


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
