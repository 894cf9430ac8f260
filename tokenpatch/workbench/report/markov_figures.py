"""The Markov section's figures: training curves against the ideal predictors, the phase diagram over
K x steps, tau(N) (``docs/markov.md``)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tokenpatch.workbench.train.sweep import phase_grid

__all__ = ["COLOURS", "PHASE_COLOURS", "curves_figure", "phase_figure", "tau_figure"]


COLOURS = {
    "uniform": "#999999",
    "1-gen": "#9ecae1",
    "2-gen": "#08519c",
    "1-mem": "#fdae6b",
    "2-mem": "#d94801",
    "true": "#000000",
}


PHASE_COLOURS = {"U": "#dddddd", "G1": "#9ecae1", "G2": "#08519c", "M1": "#fdae6b", "M2": "#d94801"}


def _label_colour(label: str) -> str:
    return PHASE_COLOURS.get(label, "#74c476")  # mixed labels ("G2/M2") in green


def _edges(steps: list[int]) -> np.ndarray:
    """Cell edges in log-step around evaluation steps ``steps[1:]`` (step 0 drawn at 0.7)."""
    xs = [0.7, *steps[1:]]
    return np.array([0.5, *[(a * b) ** 0.5 for a, b in zip(xs[:-1], xs[1:])], xs[-1] * 1.25])


def curves_figure(runs: dict[str, tuple[list[dict], dict]], path: Path) -> Path:
    """One column per run: the model's loss on the training chains (and on fresh chains) against
    steps, the predictors' losses as dashed levels; above it, the phase label at each evaluation."""
    fig, axes = plt.subplots(
        2,
        len(runs),
        figsize=(5.6 * len(runs), 5.0),
        constrained_layout=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [1, 11]},
        sharex="col",
    )
    for col, (title, (history, refs)) in enumerate(runs.items()):
        band, ax = axes[0, col], axes[1, col]
        steps = [h["step"] for h in history]
        xs = [max(s, 0.7) for s in steps]
        edges = _edges(steps)
        for j, h in enumerate(history):
            label = h["train"]["label"]
            band.fill_between(edges[j : j + 2], 0, 1, color=_label_colour(label), lw=0)
            if j == 0 or label != history[j - 1]["train"]["label"]:
                band.text(xs[j], 0.5, label, fontsize=7, ha="left", va="center", color="black")
        band.set_yticks([])
        band.set_ylim(0, 1)
        band.set_title(title, fontsize=10)
        for name, value in refs["train"].items():
            ax.axhline(value, ls="--", lw=1, color=COLOURS[name], label=name)
        ax.plot(xs, [h["train"]["loss"] for h in history], "o-", ms=3, color="#2ca02c", label="model, training chains")
        ax.plot(xs, [h["fresh"]["loss"] for h in history], "s:", ms=3, color="#7f7f7f", label="model, fresh chains")
        ax.set_xscale("log")
        ax.set_xlim(edges[0], edges[-1])
        ax.set_ylim(refs["train"]["true"] - 0.1, refs["train"]["uniform"] + 0.6)
        ax.set_xlabel("training step")
        ax.set_ylabel("cross-entropy per token (nats)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def phase_figure(summary: dict, stars: dict, path: Path) -> Path:
    """The label on the training chains at every (K, evaluation step), seed by seed, with the
    K*_1 and K*_2 estimates."""
    seeds = sorted({r["seed"] for r in summary["runs"]})
    fig, axes = plt.subplots(1, len(seeds), figsize=(4.8 * len(seeds), 4.4), constrained_layout=True, squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        ks, steps, labels = phase_grid(summary, seed)
        edges = _edges(steps)
        for i, row in enumerate(labels):
            for j, label in enumerate(row):
                ax.fill_between(edges[j : j + 2], i - 0.5, i + 0.5, color=_label_colour(label), lw=0)
        per = stars["per_seed"][seed]
        for key, colour in (("k1", "black"), ("k2", "white")):
            if per[key] is not None:
                i = ks.index(per[key])
                ax.axhline(
                    i - 0.5 if key == "k1" else i + 0.5, color=colour, lw=2, ls="--", label=f"K*_{key[1]} = {per[key]}"
                )
        ax.set_xscale("log")
        ax.set_xlim(edges[0], edges[-1])
        ax.set_yticks(range(len(ks)), [str(k) for k in ks])
        ax.set_xlabel("training step")
        ax.set_ylabel("training chains K")
        ax.set_title(f"seed {seed}", fontsize=10)
        ax.legend(fontsize=7, loc="lower left", facecolor="#bbbbbb")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()] + [
        plt.Rectangle((0, 0), 1, 1, color="#74c476")
    ]
    fig.legend(handles, [*PHASE_COLOURS, "mixed"], loc="outside right center", fontsize=8)
    fig.suptitle("phase on the training chains (least KL(predictor || model))")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def tau_figure(lengths: dict, path: Path) -> Path:
    """tau(N) per run and the two fits."""
    fig, ax = plt.subplots(figsize=(5.4, 4.2), constrained_layout=True)
    pts = [(r["length"], r["tau"]) for r in lengths["runs"] if r["tau"] is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color="#08519c", label="tau per run")
    fit = lengths["fit"]
    if "power" in fit:
        n = np.geomspace(min(p[0] for p in pts), max(p[0] for p in pts), 50)
        ax.plot(
            n,
            fit["n_over_log_n"]["c"] * n / np.log(n),
            "--",
            color="#d94801",
            label=f"c N/log N (rms log {fit['n_over_log_n']['rms_log']:.3f})",
        )
        ax.plot(
            n,
            fit["power"]["c"] * n ** fit["power"]["a"],
            ":",
            color="#2ca02c",
            label=f"c N^{fit['power']['a']:.2f} (rms log {fit['power']['rms_log']:.3f})",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("G1 -> G2 transition step tau")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
