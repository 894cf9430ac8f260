"""Sweeps over the number of training chains K and the sequence length N (``docs/markov.md`` §4).

``sweep_chains`` trains one model per (K, seed) and keeps each run's evaluation history; from it:

* the **phase diagram**: the label on the training chains at every (K, step);
* ``K*_1``: the smallest K whose final model is closer, on fresh chains, to 2-gen than to 2-mem
  (``KL(2-gen || model) < KL(2-mem || model)``): from there on the model generalises;
* ``K*_2``: the largest K whose final model reaches 2-mem on its training chains (2-mem the
  nearest of the four predictors, or ``KL(2-mem || model) <= tol``): the most chains the model
  can memorise in the budget.

Each is estimated per seed; the grid brackets it (``K*_1`` lies in ``(K_prev, K]``) and the
seeds give its spread. ``sweep_lengths`` trains at large K for several N and measures ``tau(N)``,
the step at which ``KL(2-gen || model)`` falls below ``KL(1-gen || model)`` on fresh chains for good
(``transition_step``), then fits ``tau = c N / log N`` and ``tau = c N^a``.
Runs are directories of ``markov.train_markov``: a finished run is read back, not retrained, and
an interrupted one resumes.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from tokenpatch.interp.phases import PHASES
from tokenpatch.models.markov import MarkovModel
from tokenpatch.progress import progress_bar
from tokenpatch.tasks.markov import MarkovTask
from tokenpatch.workbench.train.markov import MarkovTrain, train_markov

__all__ = ["sweep_chains", "sweep_lengths", "phase_grid", "k_star", "transition_step", "fit_tau"]


def _run(args) -> dict:
    out, task, shape, cfg, threads = args
    import torch

    torch.set_num_threads(threads)
    _, history = train_markov(out, task, shape, cfg, progress=False, snapshots=False)
    return {"chains": task.chains, "length": task.length, "seed": cfg.seed, "history": history}


def _map(jobs: list, workers: int, progress: bool | None, desc: str) -> list[dict]:
    threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    jobs = [(*job, threads) for job in jobs]
    if workers <= 1:
        return [_run(job) for job in progress_bar(jobs, progress, desc=desc, unit="run")]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(progress_bar(pool.map(_run, jobs), progress, total=len(jobs), desc=desc, unit="run"))


def sweep_chains(
    out: str | Path,
    chains=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    seeds=(0, 1, 2),
    task: MarkovTask = MarkovTask(),
    shape: MarkovModel = MarkovModel(),
    cfg: MarkovTrain = MarkovTrain(),
    workers: int = 2,
    progress: bool | None = None,
) -> dict:
    """Train every (K, seed) (the seed fixes both the chains and the training run); write
    ``out/sweep.json`` and return it: ``{"task", "model", "train", "runs": [...]}``."""
    out = Path(out)
    jobs = [
        (out / f"K{k:05d}-s{s}", replace(task, chains=k, seed=s), shape, replace(cfg, seed=s))
        for k in chains
        for s in seeds
    ]
    runs = _map(jobs, workers, progress, "K sweep")
    summary = {"task": task.to_dict(), "model": shape.to_dict(), "train": cfg.to_dict(), "runs": runs}
    (out / "sweep.json").write_text(json.dumps(summary))
    return summary


def sweep_lengths(
    out: str | Path,
    lengths=(16, 32, 64, 128),
    seeds=(0, 1),
    task: MarkovTask = MarkovTask(chains=4096),
    shape: MarkovModel = MarkovModel(),
    cfg: MarkovTrain = MarkovTrain(),
    workers: int = 2,
    progress: bool | None = None,
) -> dict:
    """Train at large K for every (N, seed); ``out/lengths.json`` with ``tau`` per run and the fits."""
    out = Path(out)
    jobs = [
        (out / f"N{n:04d}-s{s}", replace(task, length=n, seed=s), shape, replace(cfg, seed=s))
        for n in lengths
        for s in seeds
    ]
    runs = _map(jobs, workers, progress, "N sweep")
    for run in runs:
        run["tau"] = transition_step(run["history"])
    summary = {
        "task": task.to_dict(),
        "model": shape.to_dict(),
        "train": cfg.to_dict(),
        "runs": runs,
        "fit": fit_tau([r["length"] for r in runs], [r["tau"] for r in runs]),
    }
    (out / "lengths.json").write_text(json.dumps(summary))
    return summary


def phase_grid(
    summary: dict, seed: int | None = None, which: str = "train"
) -> tuple[list[int], list[int], list[list[str]]]:
    """``(chains, steps, labels[K][step])`` for one seed (default: the first)."""
    runs = [r for r in summary["runs"] if seed is None or r["seed"] == seed]
    first = runs[0]["seed"]
    runs = sorted((r for r in runs if r["seed"] == first), key=lambda r: r["chains"])
    steps = [h["step"] for h in runs[0]["history"]]
    return [r["chains"] for r in runs], steps, [[h[which]["label"] for h in r["history"]] for r in runs]


def k_star(summary: dict, tol: float | None = None) -> dict:
    """``K*_1`` and ``K*_2`` per seed from the final evaluation of every run (module docstring),
    with the grid bracket, and their geometric mean and range over seeds (``None`` if not found).

    A run "reaches 2-mem" when ``KL(2-mem || model)`` on its training chains is the least of the
    four predictors' (``tol=None``, the default), or is at most ``tol`` nats. The default is
    scale-free: the gap between 2-mem and 2-gen shrinks as K grows, so a fixed tolerance
    means a different thing at each K."""
    by_seed: dict[int, list] = {}
    for r in summary["runs"]:
        by_seed.setdefault(r["seed"], []).append(r)
    per_seed = {}
    for seed, runs in sorted(by_seed.items()):
        runs.sort(key=lambda r: r["chains"])
        ks = [r["chains"] for r in runs]
        final = [r["history"][-1] for r in runs]
        gen = [f["fresh"]["kl"]["2-gen"] < f["fresh"]["kl"]["2-mem"] for f in final]
        mem = [
            (f["train"]["kl"]["2-mem"] <= tol)
            if tol is not None
            # ties (K = 1: 1-mem = 2-mem) count
            else f["train"]["kl"]["2-mem"] <= min(f["train"]["kl"][p] for p in PHASES)
            for f in final
        ]
        k1 = next((i for i, g in enumerate(gen) if g), None)
        k2 = max((i for i, m in enumerate(mem) if m), default=None)
        per_seed[seed] = {
            "k1": None if k1 is None else ks[k1],
            "k1_bracket": None if k1 is None else [ks[k1 - 1] if k1 else 0, ks[k1]],
            "k2": None if k2 is None else ks[k2],
            "k2_bracket": None if k2 is None else [ks[k2], ks[k2 + 1] if k2 + 1 < len(ks) else None],
            "generalises": dict(zip(map(str, ks), gen)),
            "memorises": dict(zip(map(str, ks), mem)),
        }
    out = {"tol": tol, "per_seed": per_seed}
    for key in ("k1", "k2"):
        vals = [v[key] for v in per_seed.values() if v[key] is not None]
        out[key] = (
            None
            if not vals
            else {
                "geomean": float(np.exp(np.mean(np.log(vals)))),
                "min": min(vals),
                "max": max(vals),
                "found": len(vals),
                "seeds": len(per_seed),
            }
        )
    return out


def transition_step(
    history: list[dict], which: str = "fresh", after: str = "2-gen", before: str = "1-gen"
) -> float | None:
    """The step at which ``KL(after || model)`` falls below ``KL(before || model)`` for good: the
    last crossing from ``>=`` to ``<`` (step 0 excluded), interpolated in log-step between the two
    evaluations around it; ``None`` if the run ends above, or was never above after step 0."""
    pts = [(h["step"], h[which]["kl"][after] - h[which]["kl"][before]) for h in history if h["step"] > 0]
    if not pts or pts[-1][1] >= 0:
        return None
    above = [i for i, (_, gap) in enumerate(pts) if gap >= 0]
    if not above:
        return None
    (s0, g0), (s1, g1) = pts[above[-1]], pts[above[-1] + 1]
    frac = g0 / (g0 - g1)
    return float(math.exp(math.log(s0) + frac * (math.log(s1) - math.log(s0))))


def fit_tau(lengths: list[int], taus: list[float | None]) -> dict:
    """Least-squares fits in log space of ``tau = c N / log N`` (one parameter) and
    ``tau = c N^a`` (two), with each fit's RMS log residual; runs without a transition are dropped."""
    pts = [(n, t) for n, t in zip(lengths, taus) if t is not None]
    if len(pts) < 3 or len({n for n, _ in pts}) < 2:
        return {"points": len(pts)}
    n = np.array([p[0] for p in pts], dtype=float)
    y = np.log([p[1] for p in pts])
    x1 = np.log(n / np.log(n))
    c1 = float(np.mean(y - x1))
    a, c2 = np.polyfit(np.log(n), y, 1)
    r1 = float(np.sqrt(np.mean((y - x1 - c1) ** 2)))
    r2 = float(np.sqrt(np.mean((y - a * np.log(n) - c2) ** 2)))
    return {
        "points": len(pts),
        "n_over_log_n": {"c": float(np.exp(c1)), "rms_log": r1},
        "power": {"c": float(np.exp(c2)), "a": float(a), "rms_log": r2},
    }
