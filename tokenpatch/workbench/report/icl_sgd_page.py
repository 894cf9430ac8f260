"""``tokenpatch icl-sgd``: every measurement of ``workbench.icl_sgd`` and ``workbench.monitor`` on one real
model, its JSON, its markdown page and its figures (``docs/dynamics.md`` section 7)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
from torch import Tensor

from tokenpatch.dynamics.finetuning import finetuned
from tokenpatch.dynamics.online_sgd import online_sgd
from tokenpatch.progress import progress_bar
from tokenpatch.run import apply
from tokenpatch.stats import mean_interval
from tokenpatch.tasks.wordpairs import load_task
from tokenpatch.workbench import icl_sgd as X
from tokenpatch.workbench.monitor import monitor_answers, separation
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.compress import FORMATS
from tokenpatch.workbench.zoo.pretrained import load_pretrained

__all__ = ["write_report", "measure", "SETTINGS", "LRS"]

# Per model: the first token and the prompt format the prompt-compression comparison chose on its dev
# split (docs/prompt-compression.md section 4), and its five tasks.
SETTINGS = {
    "smollm2-135m": (
        [0],
        "arrow",
        ("country_capital", "present_past", "singular_plural", "antonym", "adjective_comparative"),
    ),
    "gemma3-270m": ([2], "qa", ("country_capital", "present_past", "singular_plural", "english_french", "antonym")),
}
LRS = (1e-3, 1e-2)  # online SGD on the answer NLL, the one of lowest held-out NLL after the pass is reported
FULL = {"sgd": 20, "adam": 20}  # full-batch steps; SGD at the online choice, Adam at ADAM_LR
ADAM_LR = 1e-4


def _stats(t: Tensor) -> dict:
    return mean_interval(t.reshape(t.shape[0], -1).double().mean(1))


def _by_layer(t: Tensor, names: list[str]) -> list[dict]:
    """``[R, ..., M]`` over matrices -> per layer (its matrices averaged) the mean over runs with its interval."""
    layers = sorted({X.layer_of(n) for n in names})
    idx = {i: [j for j, n in enumerate(names) if X.layer_of(n) == i] for i in layers}
    return [_stats(t[..., idx[i]].mean(-1)) for i in layers]


def _random_init(model):
    """The same architecture at its initialisation (the control of Deutch et al., 2024), seeded."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        twin = type(model)(model.config).to(next(model.parameters()).dtype).eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


def _steps(model, runs, progress) -> tuple[dict, object, list]:
    al, patches = X.step_by_step(model, runs, LRS, generator=torch.Generator().manual_seed(0), progress=progress)
    final = al.heldout[:, :, -1].mean(1)
    best = min(range(len(LRS)), key=lambda k: final[k] if math.isfinite(final[k]) else math.inf)
    names = al.names
    rec = {
        "matrices": len(names),
        "lrs": list(LRS),
        "chosen_lr": LRS[best],
        "heldout_after_pass": final.tolist(),
        "per_layer": {
            **{
                k: _by_layer(getattr(al, k), names)
                for k in ("gradient", "gradient_shuffled", "gradient_other_run", "random")
            },
            "sgd_step": _by_layer(al.sgd_step[best], names),
            "shuffled_sgd_step": _by_layer(al.shuffled_sgd_step[best], names),
            "sgd_weights": _by_layer(al.sgd_weights[best][:, -1:], names),
            "shuffled_sgd_weights": _by_layer(al.shuffled_sgd_weights[best][:, -1:], names),
        },
        "overall": {
            k: _stats(t)
            for k, t in {
                "gradient": al.gradient,
                "gradient_shuffled": al.gradient_shuffled,
                "gradient_other_run": al.gradient_other_run,
                "random": al.random,
                "sgd_step": al.sgd_step[best],
                "shuffled_sgd_step": al.shuffled_sgd_step[best],
                "sgd_weights": al.sgd_weights[best][:, -1:],
            }.items()
        },
        "by_step": {k: getattr(al, k).mean((0, 2)).tolist() for k in ("gradient", "gradient_shuffled", "random")}
        | {
            "sgd_step": al.sgd_step[best].mean((0, 2)).tolist(),
            "sgd_weights": al.sgd_weights[best].mean((0, 2)).tolist(),
        },
        "heldout_sgd": al.heldout[best].mean(0).tolist(),
    }
    return rec, al, patches


def measure(model, tokenizer, name: str, *, shots: int, tests: int, monitor: int, seed: int, progress) -> dict:
    """Every number of the page (JSON-able); seconds per part in ``seconds``."""
    lead, fmt_key, task_names = SETTINGS[name]
    fmt, tasks = FORMATS[fmt_key], [load_task(t) for t in task_names]
    runs = X.encode_runs(tokenizer, tasks, lead, fmt, shots=shots, tests=tests, seed=seed)
    seconds, t0 = {}, time.perf_counter()
    out = {"model": name, "tasks": list(task_names), "shots": shots, "tests": tests, "seed": seed}
    out["lead"], out["format"] = lead, fmt_key
    out["steps"], al, patches = _steps(model, runs, progress)
    seconds["steps"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lr = out["steps"]["chosen_lr"]
    names = al.names
    *_, (_, online) = online_sgd(model, X.losses(model, runs)[0], runs.shots, names, lr)
    updates = {
        "online_sgd": online,
        "sgd": X.train(model, runs, names, "sgd", lr, FULL["sgd"]),
        "adam": X.train(model, runs, names, "adam", ADAM_LR, FULL["adam"]),
    }
    thought = [
        X.fit_thought(model, runs, r, progress=False)
        for r in progress_bar(range(len(runs.tasks)), progress, desc="thought patches")
    ]
    whole = X.whole_updates(model, runs, patches, updates, thought)
    out["whole"] = {
        "steps": FULL,
        "lrs": {"sgd": lr, "adam": ADAM_LR, "online_sgd": lr},
        "methods": {
            k: {
                f: _by_layer(t, whole["names"]) if f != "simaou" else [_stats(t[:, j]) for j in range(t.shape[1])]
                for f, t in rec.items()
            }
            | {f"{f}_overall": _stats(t) for f, t in rec.items()}
            for k, rec in whole["methods"].items()
        },
    }
    contexts = {
        "icl": lambda r: contextlib.nullcontext(),
        "zero_shot": lambda r: contextlib.nullcontext(),
        "thought_patch": lambda r: apply(model, thought[r]),
        **{k: (lambda r, d=d: finetuned(model, X.one_run(d, r))) for k, d in updates.items()},
    }
    acc = X.accuracy(model, tokenizer, runs, contexts)
    out["accuracy"] = {k: {"per_task": v.tolist(), **_stats(v)} for k, v in acc.items()}
    seconds["whole"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    twin = _random_init(model)
    ctrl, al_u, patches_u = _steps(twin, runs, progress)
    *_, (_, online_u) = online_sgd(twin, X.losses(twin, runs)[0], runs.shots, names, lr)
    whole_u = X.whole_updates(twin, runs, patches_u, {"online_sgd": online_u}, None)
    ctrl["whole"] = {
        f: _by_layer(t, whole_u["names"]) if f != "simaou" else [_stats(t[:, j]) for j in range(t.shape[1])]
        for f, t in whole_u["methods"]["online_sgd"].items()
    }
    out["untrained"] = ctrl
    del twin
    seconds["untrained"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    answers = monitor_answers(
        model, tokenizer, tasks, lead, fmt, shots=shots, queries=monitor, seed=seed, progress=progress
    )
    out["monitor"] = {"detail": answers, **separation(answers)}
    seconds["monitor"] = time.perf_counter() - t0
    out["seconds"] = seconds
    return out


def write_report(
    name: str,
    paths: dict[str, Path],
    *,
    shots: int = 8,
    tests: int = 20,
    monitor: int = 60,
    seed: int = 0,
    threads: int = 0,
    progress: bool | None = None,
) -> Path:
    """Load ``name``, run ``measure``, write ``paths["json"]``, the figures and ``paths["md"]``; returns the page."""
    t0 = time.perf_counter()
    model, tokenizer = load_pretrained(name, progress=progress)
    for p in model.parameters():
        p.requires_grad_(False)
    data = measure(model, tokenizer, name, shots=shots, tests=tests, monitor=monitor, seed=seed, progress=progress)
    data["threads"] = threads or torch.get_num_threads()
    data["seconds"]["total"] = time.perf_counter() - t0
    paths["md"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(json.dumps(data, indent=1))
    figures(data, paths)
    paths["md"].write_text(markdown(data, paths))
    return paths["md"]


def _band(rows: list[dict]) -> tuple[list[float], list[float], list[float]]:
    return [r["mean"] for r in rows], [r["lo"] for r in rows], [r["hi"] for r in rows]


def figures(data: dict, paths: dict[str, Path]) -> None:
    st, un = data["steps"]["per_layer"], data["untrained"]["per_layer"]
    plots.per_layer(
        {
            "each demonstration's implicit step S_i = dW_i - dW_(i-1)": {
                "trained: vs -g_i": _band(st["gradient"]),
                "trained: vs another demonstration": _band(st["gradient_shuffled"]),
                "trained: vs another task": _band(st["gradient_other_run"]),
                "trained: vs online SGD step": _band(st["sgd_step"]),
                "untrained: vs -g_i": _band(un["gradient"]),
                "random matrix": _band(st["random"]),
            },
            f"after all {data['shots']}: cos(dW_k - dW_0, D_k), online SGD": {
                "trained": _band(st["sgd_weights"]),
                "trained, shuffled order": _band(st["shuffled_sgd_weights"]),
                "untrained": _band(un["sgd_weights"]),
            },
        },
        paths["steps"],
        f"{data['model']}: implicit steps against explicit gradients (mean over the layer's matrices and "
        f"{len(data['tasks'])} prompts, 95% intervals)",
    )
    m = data["whole"]["methods"]
    plots.per_layer(
        {
            "cos(dW_k - dW_0, D), whole updates": {
                **{f"token patch vs {k}": _band(v["token_patch"]) for k, v in m.items()},
                **{f"thought patch vs {k}": _band(v["thought_patch"]) for k, v in m.items() if k == "adam"},
                "untrained: token patch vs online SGD": _band(data["untrained"]["whole"]["token_patch"]),
            },
            "rank ceiling s_1(D) / |D|_F": {f"{k}": _band(v["ceiling"]) for k, v in m.items()},
            "SimAOU cos(h_C - h_0, h_FT - h_0), layer outputs": {
                **{k: _band(v["simaou"]) for k, v in m.items()},
                "untrained: online SGD": _band(data["untrained"]["whole"]["simaou"]),
            },
        },
        paths["whole"],
        f"{data['model']}: the whole update of a {data['shots']}-shot prompt against SGD and Adam on its demonstrations",
    )
    mon = data["monitor"]
    if mon["per_layer"] is None:  # only right or only wrong answers: nothing to separate
        return
    layers = list(range(len(mon["per_layer"])))
    flat = lambda v: ([layers[0], layers[-1]], [v["mean"], v["mean"]])  # noqa: E731
    plots.curves(
        {
            "flagging wrong answers: AUROC (0.5 = chance)": {
                "x": "layer",
                "y": "AUROC",
                "lines": {
                    "update norm |dW| of the layer": (layers, [r["mean"] for r in mon["per_layer"]]),
                    "pooled: norm over all layers": flat(mon["pooled"]),
                    "baseline: 1 - first-token probability": flat(mon["probability"]),
                    "baseline: - logit margin": flat(mon["margin"]),
                },
            }
        },
        paths["monitor"],
        f"{data['model']}: do the implicit updates of tp.generate tell right from wrong? "
        f"({mon['wrong']} wrong of {mon['answers']} answers)",
    )


def _iv(v: dict, fmt: str = "+.3f") -> str:
    return f"{v['mean']:{fmt}} [{v['lo']:{fmt}}, {v['hi']:{fmt}}]"


def markdown(data: dict, paths: dict[str, Path]) -> str:
    s, u = data["steps"], data["untrained"]
    o, ou = s["overall"], u["overall"]
    rows = [
        ("cos(S_i, -g_i): the demonstration's own gradient", "gradient"),
        ("another demonstration's gradient, same weights", "gradient_shuffled"),
        ("another task's gradient", "gradient_other_run"),
        ("a random matrix", "random"),
        ("cos(S_i, online SGD step)", "sgd_step"),
        ("online SGD step, shuffled order", "shuffled_sgd_step"),
        ("cos(dW_k - dW_0, D_k), after the pass", "sgd_weights"),
    ]
    steps = ["| measure | trained | untrained (random init) |", "|---|---|---|"]
    steps += [f"| {label} | {_iv(o[k])} | {_iv(ou[k])} |" for label, k in rows]
    sweep = ["| lr | held-out answer NLL after one pass |", "|---|---|"]
    sweep += [f"| {lr:g} | {v:.3f} |" for lr, v in zip(s["lrs"], s["heldout_after_pass"])]
    m = data["whole"]["methods"]
    whole = [
        "| update D | cos(token patch, D) | rank ceiling | cos(thought patch, D) | SimAOU |",
        "|---|---|---|---|---|",
    ]
    whole += [
        f"| {k} | {_iv(v['token_patch_overall'])} | {_iv(v['ceiling_overall'], '.3f')} | "
        f"{_iv(v['thought_patch_overall'])} | {_iv(v['simaou_overall'])} |"
        for k, v in m.items()
    ]
    acc = ["| method | accuracy (mean over tasks) | per task |", "|---|---|---|"]
    acc += [
        f"| {k} | {_iv(v, '.2f')} | {' / '.join(f'{x:.2f}' for x in v['per_task'])} |"
        for k, v in data["accuracy"].items()
    ]
    mon = data["monitor"]
    if mon["per_layer"] is None:
        monitor = [f"No AUROC: {mon['wrong']} of {mon['answers']} answers were wrong."]
    else:
        best = max(range(len(mon["per_layer"])), key=lambda i: abs(mon["per_layer"][i]["mean"] - 0.5))
        monitor = ["| score | AUROC for a wrong answer |", "|---|---|"]
        monitor += [
            f"| update norm, layer {best} (furthest from 0.5) | {_iv(mon['per_layer'][best], '.3f')} |",
            f"| update norm, pooled over layers | {_iv(mon['pooled'], '.3f')} |",
            f"| baseline: first-token probability | {_iv(mon['probability'], '.3f')} |",
            f"| baseline: logit margin | {_iv(mon['margin'], '.3f')} |",
        ]
    w = data["whole"]
    sec = data["seconds"]
    return "\n".join(
        [
            f"# In-context learning against explicit gradients: {data['model']}",
            "",
            f"`tokenpatch icl-sgd --model {data['model']}` ({sec['total'] / 60:.1f} min, {data['threads']} threads; "
            f"steps {sec['steps']:.0f} s, whole updates {sec['whole']:.0f} s, untrained control "
            f"{sec['untrained']:.0f} s, monitoring {sec['monitor']:.0f} s). Tasks {', '.join(data['tasks'])}, one "
            f"{data['shots']}-shot prompt each (first token {data['lead']}, format `{data['format']}`: the choice the "
            f"prompt-compression comparison made on its dev split), seed {data['seed']}. Every cosine is over the "
            f"{s['matrices']} matrices the token patch changes (the MLP's input readers and its output matrix, every "
            "layer), averaged per layer; intervals are 95% over the prompts. `docs/dynamics.md` section 7 says what "
            "each number is.",
            "",
            "## 1-2. Step by step",
            "",
            f"Online SGD at lr {s['chosen_lr']:g} (lowest held-out answer NLL after one pass):",
            "",
            *sweep,
            "",
            *steps,
            "",
            f"![step by step]({paths['steps'].name})",
            "",
            "## 3. Whole updates",
            "",
            f"Full-batch SGD (lr {w['lrs']['sgd']:g}, {w['steps']['sgd']} steps) and Adam (lr {w['lrs']['adam']:g}, "
            f"{w['steps']['adam']} steps) on the {data['shots']} demonstrations, online SGD (one pass); the token patch "
            "of the whole prompt (at the first query) and its thought patch (the calibration split, ridge by GCV):",
            "",
            *whole,
            "",
            f"Greedy accuracy on {data['tests']} held-out queries per prompt:",
            "",
            *acc,
            "",
            f"![whole updates]({paths['whole'].name})",
            "",
            "## 4. Monitoring",
            "",
            f"{mon['answers']} test answers of the five prompts, {mon['wrong']} wrong (`tp.generate`, the update norms of "
            "the step that writes the answer's first token):",
            "",
            *monitor,
            "",
            f"![monitoring]({paths['monitor'].name})" if mon["per_layer"] is not None else "",
            "",
        ]
    )
