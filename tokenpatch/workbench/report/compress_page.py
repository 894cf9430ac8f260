"""Prompt compression, presented (``docs/prompt-compression.md`` §4): ``markdown`` (the method-by-task
table, the costs, the fits' residuals, the goal's checks, Hendel et al.'s published numbers beside
ours) and ``figure`` (accuracy and KL to ICL, task by method) of one ``compress.run_model`` run."""

from __future__ import annotations

from pathlib import Path

from tokenpatch.workbench.registry import REGISTRY, entry_of
from tokenpatch.workbench.report.plots import plt

# Hendel et al. 2023, "In-Context Learning Creates Task Vectors", Pythia-2.8B: zero-shot / task vector / ICL
# (the registry's entries with ``published`` 0, 1, 2).
HENDEL_PYTHIA_2_8B = {
    "antonym": (0.37, 0.68, 0.76),
    "country_capital": (0.18, 0.70, 0.76),
    "english_french": (0.16, 0.28, 0.60),
}


PUBLISHED = tuple(e.key for e in sorted((e for e in REGISTRY if e.published is not None), key=lambda e: e.published))


def _cell(v: dict) -> str:
    iv = v["accuracy_interval"]
    return f"{v['correct']}/{v['n']} [{iv['lo']:.2f}, {iv['hi']:.2f}] KL {v['kl']:.2f}"


def markdown(run: dict) -> str:
    """The accuracy / KL table of one model (a row per method, a column per task), the costs, the
    fits' residuals and the goal's checks."""
    tasks = run["tasks"]
    first = next(iter(tasks.values()))
    lines = [
        f"**{run['model']}**, {run['shots']}-shot prompts, seed {run['seed']}, "
        f"{run['seconds'] / 60:.1f} min on {run['threads']} threads.",
        "",
    ]
    prompting = run.get("prompting")
    if prompting:
        c, tried = prompting["chosen"], prompting["candidates"]
        chosen = f"first token {c['lead_text']!r}, format {c['format']!r}"
        lines += [
            (
                f"Prompt chosen on dev (ICL's dev answers, every task): {chosen}; the candidates: "
                + "; ".join(f"{x['lead_text']!r} + {x['format']}: {x['hits']}/{x['n']}" for x in tried)
                + "."
            )
            if tried
            else f"Prompt given (not chosen in this run): {chosen}.",
            "",
        ]
    keys = list(first["methods"])
    gains = " | ".join(
        f"{r['methods']['icl']['accuracy'] - r['methods']['zero_shot']['accuracy']:+.2f}" for r in tasks.values()
    )
    names = [t + ("" if r["informative"] else " (uninformative)") for t, r in tasks.items()]
    lines += ["| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(tasks), f"| ICL gain | {gains} |"]
    for k in keys:
        cells = [_cell(r["methods"][k]) + (" *" if r.get("closed_form_choice") == k else "") for r in tasks.values()]
        lines.append(f"| {first['methods'][k]['name']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each cell: correct / test pairs, the 95% Wilson interval, KL(ICL || method) at the answer position "
        "(nats); `*`: the closed-form thought patch chosen on dev (lowest dev KL), the goal's.",
        "",
        "Costs on " + first["task"] + " (extraction seconds; bytes stored; prefill time over zero-shot's):",
        "",
        "| method | extraction s | gradient steps | bytes | inference overhead |",
        "|---|---|---|---|---|",
    ]
    for v in first["methods"].values():
        steps = v.get("steps", "")
        lines.append(f"| {v['name']} | {v['extraction_s']:.1f} | {steps} | {v['bytes']:,} | {v['overhead']:.2f}x |")
    lines += [
        "",
        "Single-token answers: "
        + ", ".join(f"{t} {r['answers']['single_token']}/{r['answers']['pairs']}" for t, r in tasks.items())
        + ".",
    ]
    lines += _residuals(tasks)
    g = run["goal"]
    share = "n/a" if g["mean_gain_recovered"] is None else f"{g['mean_gain_recovered']:.2f}"
    closer = g.get("closer_than_baking", [])
    lines += [
        "",
        f"Goal on the {len(g['informative'])} informative tasks (the thought patch chosen on dev: "
        + ", ".join(f"{t} {k}" for t, k in g.get("choices", {}).items())
        + f"): lowest KL to ICL of all methods but ICL on {len(g['lowest_kl'])} "
        f"({', '.join(g['lowest_kl']) or 'none'}; goal 4 of 5); mean share of the ICL-over-zero-shot gain "
        f"{share} (goal 0.90); closer to ICL than prompt baking at equal time on "
        f"{sum(ok for _, _, ok in closer)} of {len(closer)}: {'met' if g['met'] else 'not met'}.",
    ]
    hendel = [t for t in HENDEL_PYTHIA_2_8B if t in tasks]
    if hendel:
        lines += [
            "",
            "Context (not targets): Hendel et al.'s Pythia-2.8B, zero-shot / task vector / ICL, beside ours:",
            "",
            "| task | Pythia-2.8B (Hendel et al.) | " + run["model"] + " |",
            "|---|---|---|",
        ]
        for t in hendel:
            m = tasks[t]["methods"]
            ours = " / ".join(f"{m[k]['accuracy']:.2f}" for k in PUBLISHED if k in m)
            lines.append(f"| {t} | {' / '.join(f'{x:.2f}' for x in HENDEL_PYTHIA_2_8B[t])} | {ours} |")
    return "\n".join(lines)


def _residuals(tasks: dict) -> list[str]:
    """The thought patch's relative least-squares residual per layer (input / output side), averaged
    over the tasks, at five depths."""
    fits = [r["methods"]["thought_patch"]["fits"] for r in tasks.values() if "thought_patch" in r["methods"]]
    if not fits:
        return []
    n = len(fits[0])
    picks = sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1})
    mean = lambda key, i: sum(f[i][key] or 0.0 for f in fits) / len(fits)  # noqa: E731
    ridges = ", ".join(f"{t} {r['methods']['thought_patch']['ridge']:g}" for t, r in tasks.items())
    swept = all(r["methods"]["thought_patch"].get("dev_kl_by_ridge") for r in tasks.values())
    return [
        "",
        "Where the thought patch's fit leaves a residual (relative least-squares residual of each layer's "
        f"input / output side on the calibration positions, averaged over the tasks; ridge {'chosen on dev' if swept else 'given'} per task: {ridges}):",
        "",
        "| layer | " + " | ".join(str(fits[0][i]["layer"]) for i in picks) + " |",
        "|---|" + "---|" * len(picks),
        "| input side | " + " | ".join(f"{mean('input_residual', i):.2f}" for i in picks) + " |",
        "| output side | " + " | ".join(f"{mean('output_residual', i):.2f}" for i in picks) + " |",
    ]


def drawn(run: dict) -> list[tuple[str, str, bool]]:
    """What ``figure`` draws, in its order: per method of the run, its key, its legend label and
    whether it has a KL bar (all but the registry's reference, which the KL is to)."""
    first = next(iter(run["tasks"].values()))["methods"]
    reference = lambda key: (entry := entry_of(key)) is not None and entry.reference  # noqa: E731
    return [(key, row["name"], not reference(key)) for key, row in first.items()]


def figure(run: dict, path: Path) -> Path:
    """Accuracy with 95% intervals (top) and KL to ICL (bottom, log scale), task by method (``drawn``)."""
    tasks = list(run["tasks"])
    methods = drawn(run)
    fig, axes = plt.subplots(2, 1, figsize=(max(9, 2.0 * len(tasks)), 7.5), sharex=True)
    width = 0.85 / len(methods)
    colors = plt.get_cmap("tab20")
    for j, (method, label, kl) in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(tasks))]
        rows = [run["tasks"][t]["methods"][method] for t in tasks]
        acc = [r["accuracy"] for r in rows]
        ivs = [r["accuracy_interval"] for r in rows]
        err = [[a - iv["lo"] for a, iv in zip(acc, ivs)], [iv["hi"] - a for a, iv in zip(acc, ivs)]]
        axes[0].bar(xs, acc, width, yerr=err, capsize=1.5, label=label, color=colors(j % 20))
        if kl:
            axes[1].bar(xs, [max(r["kl"], 1e-3) for r in rows], width, color=colors(j % 20))
    axes[0].set_ylabel("test accuracy (95% CI)")
    axes[0].legend(ncol=4, fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, 1.36))
    axes[1].set_yscale("log")
    axes[1].set_ylabel("KL(ICL || method), nats")
    axes[1].set_xticks(range(len(tasks)))
    axes[1].set_xticklabels(
        [t + ("" if run["tasks"][t]["informative"] else "\n(uninformative)") for t in tasks], fontsize=8
    )
    fig.suptitle(f"{run['model']}: the {run['shots']}-shot prompt replaced", y=0.995)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
