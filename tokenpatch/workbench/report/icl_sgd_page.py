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
from tokenpatch.workbench.report.compress import FORMATS
from tokenpatch.workbench.report.icl_sgd_figures import figures, markdown
from tokenpatch.workbench.zoo.pretrained import load_pretrained

__all__ = ["write_report", "measure", "SETTINGS", "LRS", "ADAM_LRS"]

# Per model: the first token and the prompt format the prompt-compression comparison chose on its dev
# split, and its five tasks with the thought patch's ridge it chose there for each (docs/prompt-compression.md
# section 4; GCV's ridges are far too small on Gemma 3, whose GCV patch answers nothing right).
SETTINGS = {
    "smollm2-135m": (
        [0],
        "arrow",
        {
            "country_capital": 1.0,
            "present_past": 0.1,
            "singular_plural": 0.003,
            "antonym": 0.01,
            "adjective_comparative": 0.1,
        },
    ),
    "gemma3-270m": (
        [2],
        "qa",
        {
            "country_capital": 30.0,
            "present_past": 1.0,
            "singular_plural": 10.0,
            "english_french": 10.0,
            "antonym": 30.0,
        },
    ),
}
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)  # online SGD on the answer NLL; the one of lowest held-out NLL after the pass
FULL = {"sgd": 20, "adam": 20}  # full-batch steps; SGD at the online choice, Adam at the best of ADAM_LRS
ADAM_LRS = (1e-5, 1e-4)  # Adam's rates tried; the one of lowest held-out NLL after its steps is reported


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


def _steps(model, runs, progress, lr: float | None = None) -> tuple[dict, object, list]:
    """Step by step over ``LRS``, the one of lowest held-out NLL after the pass reported; with ``lr`` (the
    random-init control) that rate alone and no held-out loss."""
    lrs = LRS if lr is None else (lr,)
    gen = torch.Generator().manual_seed(0)
    al, patches = X.step_by_step(model, runs, lrs, heldout=lr is None, generator=gen, progress=progress)
    final = al.heldout[:, :, -1].mean(1) if lr is None else torch.zeros(1)
    best = min(range(len(lrs)), key=lambda k: final[k] if math.isfinite(final[k]) else math.inf)
    names = al.names
    rec = {
        "matrices": len(names),
        "lrs": list(lrs),
        "chosen_lr": lrs[best],
        "heldout_after_pass": final.tolist() if lr is None else None,
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
        "heldout_sgd": al.heldout[best].mean(0).tolist() if lr is None else None,
    }
    return rec, al, patches


def measure(model, tokenizer, name: str, *, shots: int, tests: int, monitor: int, seed: int, progress) -> dict:
    """Every number of the page (JSON-able); seconds per part in ``seconds``."""
    lead, fmt_key, ridges = SETTINGS[name]
    task_names = list(ridges)
    fmt, tasks = FORMATS[fmt_key], [load_task(t) for t in task_names]
    runs = X.encode_runs(tokenizer, tasks, lead, fmt, shots=shots, tests=tests, seed=seed)
    seconds, t0 = {}, time.perf_counter()
    out = {"model": name, "tasks": list(task_names), "shots": shots, "tests": tests, "seed": seed}
    out["lead"], out["format"] = lead, fmt_key
    out["steps"], al, patches = _steps(model, runs, progress)
    out["steps"]["heldout_icl"] = X.icl_heldout(model, runs).mean(0).tolist()
    seconds["steps"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lr = out["steps"]["chosen_lr"]
    names = al.names
    loss, held = X.losses(model, runs)
    *_, (_, online) = online_sgd(model, loss, runs.shots, names, lr)
    adam, adam_heldout = {}, {}
    for a in progress_bar(ADAM_LRS, progress, desc="Adam", unit="rate"):
        adam[a] = X.train(model, runs, names, "adam", a, FULL["adam"])
        with torch.no_grad(), finetuned(model, adam[a]):
            adam_heldout[a] = float(held().mean())
    adam_lr = min(ADAM_LRS, key=lambda a: adam_heldout[a] if math.isfinite(adam_heldout[a]) else math.inf)
    updates = {"online_sgd": online, "sgd": X.train(model, runs, names, "sgd", lr, FULL["sgd"]), "adam": adam[adam_lr]}
    del adam
    thought = [
        X.fit_thought(model, runs, r, ridges[task], progress=False)
        for r, task in enumerate(progress_bar(task_names, progress, desc="thought patches"))
    ]
    whole = X.whole_updates(model, runs, patches, updates, thought)
    out["whole"] = {
        "steps": FULL,
        "lrs": {"sgd": lr, "adam": adam_lr, "online_sgd": lr},
        "adam_heldout": {f"{a:g}": v for a, v in adam_heldout.items()},
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
    ctrl, al_u, patches_u = _steps(twin, runs, progress, lr=lr)
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
