"""Prompt compression on the pretrained models, as a table (``docs/prompt-compression.md``):
``compare`` on word-pair tasks for each method, with the goal's three checks and Hendel et al.'s
published numbers beside ours (context, not targets).

``run_model`` runs one model over the main tasks and, while fewer than ``min_informative`` of
them are informative (ICL at least 20 points above zero-shot on the test split), the reserve
tasks; with an ``out`` folder it keeps each finished task there (its thought patches and a
``NAME-TASK-result.json``), and a rerun reads finished tasks back instead of running them again;
``markdown`` and ``figure`` present it; ``compression_section`` is the reduced run of
``tokenpatch reproduce``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch_files import save_patch
from tokenpatch.tasks.wordpairs import MAIN_TASKS, RESERVE_TASKS, WordPairs, load_task
from tokenpatch.workbench.compare import compare
from tokenpatch.workbench.report.plots import plt
from tokenpatch.workbench.report.section import Section, differences, part_inputs, read_part, write_part
from tokenpatch.workbench.zoo import pretrained

log = logging.getLogger(__name__)

KEY = "prompt_compression"
TITLE = "Prompt compression on real language models"
RIDGES = (0.01, 0.1, 1.0, 10.0)  # the thought patch's ridge, chosen per task on the dev split (KL to ICL)
BASELINES = ("task_vector", "function_vector", "attention_shift")
# Hendel et al. 2023, "In-Context Learning Creates Task Vectors", Pythia-2.8B: zero-shot / task vector / ICL.
HENDEL_PYTHIA_2_8B = {
    "antonym": (0.37, 0.68, 0.76),
    "country_capital": (0.18, 0.70, 0.76),
    "english_french": (0.16, 0.28, 0.60),
}


def run_model(
    name: str,
    tasks: list[str | WordPairs] | None = None,
    *,
    shots: int = 10,
    test: int | None = 100,
    seed: int = 0,
    ridge=RIDGES,
    rank: int = 4,
    min_informative: int = 4,
    out: Path | None = None,
    progress: bool | None = None,
    **options,
) -> dict:
    """``compare`` on ``tasks`` (names of shipped tasks, or ``WordPairs`` read from a user's file; default:
    the main tasks, then reserves until ``min_informative`` are informative) for the pretrained model
    ``name``; thought patches are saved to ``out``.
    ``options``: more of ``compare``'s (``calibration``, ``dev``, ``n_heads``, ``layers``...).

    With ``out``, each task is kept there as it finishes (``result_path``); a rerun reads a finished
    task back (``"read_back"`` lists them) when it ran with the same settings, and refuses, before the
    model loads, a folder whose finished tasks ran with others (nothing is mixed or overwritten)."""
    t0 = time.perf_counter()
    given = {t.name: t for t in tasks or () if isinstance(t, WordPairs)}  # a user's tasks, by name
    queue = [t.name if isinstance(t, WordPairs) else t for t in tasks] if tasks else [*MAIN_TASKS, *RESERVE_TASKS]
    settings = lambda task: {  # noqa: E731  what a task's result depends on
        "model": name,
        "task": task,
        **({"pairs": _digest(given[task])} if task in given else {}),
        "shots": shots,
        "test": test,
        "seed": seed,
        "ridge": ridge,
        "rank": rank,
        "options": options,
    }
    saved = {}
    for task in queue if out is not None else []:
        path = result_path(out, name, task)
        before = part_inputs(path)
        changed = differences(before, settings(task)) if before is not None else ""
        if changed:
            raise InputError(
                f"{path} is a finished {task} run with other settings ({changed}); rerun with its "
                "settings to resume, or give a new folder"
            )
        data = read_part(path, settings(task))
        if data is not None and all((Path(out) / p).exists() for p in data["patch_files"]):
            saved[task] = data
    if saved:
        log.info("%s: read back %d finished tasks from %s (%s)", name, len(saved), out, ", ".join(saved))
    model, tokenizer = (None, None) if set(queue) <= set(saved) else _load(name)
    results: dict[str, dict] = {}
    earlier = 0.0
    for task in queue:
        informative = sum(r["informative"] for r in results.values())
        if not tasks and task in RESERVE_TASKS and informative >= min_informative:
            break
        if task in saved:
            results[task], earlier = saved[task]["result"], earlier + saved[task]["seconds"]
            continue
        if model is None:
            model, tokenizer = _load(name)
        log.info("%s: %s", name, task)
        t1 = time.perf_counter()
        res = compare(
            model,
            tokenizer,
            given[task] if task in given else load_task(task),
            shots=shots,
            seed=seed,
            test=test,
            ridge=ridge,
            rank=rank,
            progress=progress,
            **options,
        )
        patches = res.pop("patches")
        if out is not None:
            files = []
            for method, patch in patches.items():
                tag = "full" if method == "thought_patch" else f"rank{rank}"
                files.append(f"{_slug(name)}-{task}-thought-{tag}.safetensors")
                save_patch(patch, Path(out) / files[-1])
            data = {"result": res, "seconds": time.perf_counter() - t1, "patch_files": files}
            write_part(result_path(out, name, task), settings(task), data)
        results[task] = res
        log.info("%s", _line(task, res))
    return {
        "model": name,
        "shots": shots,
        "seed": seed,
        "seconds": time.perf_counter() - t0 + earlier,
        "threads": torch.get_num_threads(),
        "tasks": results,
        "read_back": [t for t in results if t in saved],
        "goal": goal(results),
    }


def _digest(task: WordPairs) -> str:
    """What a user's task holds (a changed file is another task: its finished result is not read back)."""
    return hashlib.sha256(json.dumps([task.description, task.pairs]).encode()).hexdigest()[:16]


def _load(name: str):
    return pretrained.load_pretrained(name, dtype=torch.float32, progress=False)


def result_path(out: Path, name: str, task: str) -> Path:
    """Where ``run_model`` keeps the finished ``task`` of the model ``name`` in ``out``."""
    return Path(out) / f"{_slug(name)}-{task}-result.json"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower())


def _line(task: str, res: dict) -> str:
    m = res["methods"]
    return f"{task}: " + ", ".join(f"{k} {v['correct']}/{v['n']} (KL {v['kl']:.2f})" for k, v in m.items())


def goal(results: dict[str, dict]) -> dict:
    """The issue's three checks on the informative tasks: the thought patch has the lowest KL of
    every method but ICL; its accuracy matches or beats each of ``BASELINES``; its mean share of
    the ICL-over-zero-shot gain."""
    informative = [t for t, r in results.items() if r["informative"]]
    lowest_kl, at_least, shares = [], [], []
    for t in informative:
        m = results[t]["methods"]
        others = {k: v["kl"] for k, v in m.items() if k not in ("icl", "thought_patch")}
        if m["thought_patch"]["kl"] <= min(others.values()):
            lowest_kl.append(t)
        if all(m["thought_patch"]["correct"] >= m[b]["correct"] for b in BASELINES if b in m):
            at_least.append(t)
        shares.append(m["thought_patch"]["gain_recovered"])
    mean_share = sum(shares) / len(shares) if shares else None
    return {
        "informative": informative,
        "lowest_kl": lowest_kl,
        "accuracy_at_least_baselines": at_least,
        "mean_gain_recovered": mean_share,
        "met": len(lowest_kl) >= 4 and len(at_least) >= 3 and mean_share is not None and mean_share >= 0.8,
    }


def markdown(run: dict) -> str:
    """The accuracy / KL / cost table of one model, then the goal's checks."""
    lines = [
        f"**{run['model']}**, {run['shots']}-shot prompts, seed {run['seed']}, "
        f"{run['seconds'] / 60:.1f} min on {run['threads']} threads.",
        "",
    ]
    first = next(iter(run["tasks"].values()))
    names = [v["name"] for v in first["methods"].values()]
    lines += ["| task | ICL gain | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for task, res in run["tasks"].items():
        m = res["methods"]
        gain = m["icl"]["accuracy"] - m["zero_shot"]["accuracy"]
        cells = [
            f"{v['correct']}/{v['n']} [{v['accuracy_interval']['lo']:.2f}, {v['accuracy_interval']['hi']:.2f}] "
            f"KL {v['kl']:.2f}"
            for v in m.values()
        ]
        flag = "" if res["informative"] else " (uninformative)"
        lines.append(f"| {task}{flag} | {gain:+.2f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Costs on " + first["task"] + " (extraction seconds; bytes stored; prefill time over zero-shot's):",
        "",
        "| method | extraction s | bytes | inference overhead |",
        "|---|---|---|---|",
    ]
    for v in first["methods"].values():
        lines.append(f"| {v['name']} | {v['extraction_s']:.1f} | {v['bytes']:,} | {v['overhead']:.2f}x |")
    lines += [
        "",
        "Single-token answers: "
        + ", ".join(f"{t} {r['answers']['single_token']}/{r['answers']['pairs']}" for t, r in run["tasks"].items())
        + ".",
    ]
    lines += [
        "",
        "Where the thought patch's fit leaves a residual (relative least-squares residual of each layer's "
        "input / output side on the calibration positions, averaged over the tasks; ridge chosen per task: "
        + ", ".join(f"{t} {r['methods']['thought_patch']['ridge']:g}" for t, r in run["tasks"].items())
        + "):",
        "",
    ]
    fits = [r["methods"]["thought_patch"]["fits"] for r in run["tasks"].values()]
    n = len(fits[0])
    picks = sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1})
    mean = lambda key, i: sum(f[i][key] or 0.0 for f in fits) / len(fits)  # noqa: E731
    lines += [
        "| layer | " + " | ".join(str(fits[0][i]["layer"]) for i in picks) + " |",
        "|---|" + "---|" * len(picks),
        "| input side | " + " | ".join(f"{mean('input_residual', i):.2f}" for i in picks) + " |",
        "| output side | " + " | ".join(f"{mean('output_residual', i):.2f}" for i in picks) + " |",
    ]
    g = run["goal"]
    share = "n/a" if g["mean_gain_recovered"] is None else f"{g['mean_gain_recovered']:.2f}"
    lines += [
        "",
        f"Goal on the {len(g['informative'])} informative tasks: lowest KL to ICL of all methods but ICL on "
        f"{len(g['lowest_kl'])} ({', '.join(g['lowest_kl']) or 'none'}; goal 4); accuracy at least each of "
        f"{', '.join(b.replace('_', ' ') for b in BASELINES)} on {len(g['accuracy_at_least_baselines'])} (goal 3); "
        "mean share of the "
        f"ICL-over-zero-shot gain {share} (goal 0.80): {'met' if g['met'] else 'not met'}.",
    ]
    hendel = [t for t in HENDEL_PYTHIA_2_8B if t in run["tasks"]]
    if hendel:
        lines += [
            "",
            "Context (not targets): Hendel et al.'s Pythia-2.8B, zero-shot / task vector / ICL, beside ours:",
            "",
            "| task | Pythia-2.8B (Hendel et al.) | " + run["model"] + " |",
            "|---|---|---|",
        ]
        for t in hendel:
            m = run["tasks"][t]["methods"]
            ours = " / ".join(f"{m[k]['accuracy']:.2f}" for k in ("zero_shot", "task_vector", "icl"))
            lines.append(f"| {t} | {' / '.join(f'{x:.2f}' for x in HENDEL_PYTHIA_2_8B[t])} | {ours} |")
    return "\n".join(lines)


def figure(run: dict, path: Path) -> Path:
    """Accuracy with 95% intervals (top) and KL to ICL (bottom, log scale), task by method."""
    tasks = list(run["tasks"])
    methods = list(run["tasks"][tasks[0]]["methods"])
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(tasks)), 7), sharex=True)
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab10")
    for j, method in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(tasks))]
        rows = [run["tasks"][t]["methods"][method] for t in tasks]
        acc = [r["accuracy"] for r in rows]
        ivs = [r["accuracy_interval"] for r in rows]
        err = [[a - iv["lo"] for a, iv in zip(acc, ivs)], [iv["hi"] - a for a, iv in zip(acc, ivs)]]
        axes[0].bar(xs, acc, width, yerr=err, capsize=2, label=rows[0]["name"], color=colors(j))
        if method != "icl":
            axes[1].bar(xs, [max(r["kl"], 1e-3) for r in rows], width, color=colors(j))
    axes[0].set_ylabel("test accuracy (95% CI)")
    axes[0].legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.25))
    axes[1].set_yscale("log")
    axes[1].set_ylabel("KL(ICL || method), nats")
    axes[1].set_xticks(range(len(tasks)))
    axes[1].set_xticklabels(
        [t + ("" if run["tasks"][t]["informative"] else "\n(uninformative)") for t in tasks], fontsize=8
    )
    fig.suptitle(f"{run['model']}: the {run['shots']}-shot prompt replaced", y=0.99)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compression_section(
    out: Path,
    name: str = "smollm2-135m",
    task: str = "present_past",
    test: int = 40,
    progress: bool | None = None,
    **options,
):
    """The reduced run of ``tokenpatch reproduce``: one task, one model, ``test`` queries (``options``:
    more of ``compare``'s)."""
    try:
        pretrained.check_requirements(name)
    except UnsupportedModelError as exc:
        return Section(KEY, TITLE, f"Skipped: {exc}", [], {"skipped": True, "reason": str(exc)})
    run = run_model(name, [task], test=test, progress=progress, **options)
    png = figure(run, Path(out) / "compression.png")
    body = (
        f"A reduced run: one task, {test} test queries (the full table: `tokenpatch compress --model {name} "
        f"--task all`, docs/prompt-compression.md).\n\n" + markdown(run) + f"\n\n![compression]({png.name})"
    )
    return Section(KEY, TITLE, body, [png.name], {"skipped": False, **run})
