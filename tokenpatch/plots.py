"""Figures (matplotlib, Agg backend: no screen needed). Each function writes one PNG and
returns its path; the numbers it draws are returned by the caller in the report's JSON."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["layer_errors", "training_curve"]


def layer_errors(series: dict[str, list[tuple[str, float, float]]], path: str | Path, title: str,
                 reference: list[tuple[str, float, float]] | None = None) -> Path:
    """Max relative (solid) and max absolute (dashed) error per site, one colour per series.

    ``series``: label -> ``[(site, max_abs, max_rel), ...]`` in site order (layers, then output).
    ``reference``: the same rows for the query alone *without* the patch (grey): the size of the
    context's effect that the patch reproduces.
    """
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7.5, 4.2), constrained_layout=True)
    if reference:
        ax.semilogy(range(len(reference)), [r[2] for r in reference], "x:", color="grey",
                    label="query alone, no patch: max rel")
    for (label, rows), colour in zip(series.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        x = range(len(rows))
        ax.semilogy(x, [max(r[2], 1e-300) for r in rows], "o-", color=colour, label=f"{label}: max rel")
        ax.semilogy(x, [max(r[1], 1e-300) for r in rows], "s--", color=colour, alpha=0.6, label=f"{label}: max abs")
        sites = [r[0].replace("layer ", "L") for r in rows]
    ax.set_xticks(range(len(sites)), sites)
    ax.set_xlabel("site (layer output hidden state, then model output)")
    ax.set_ylabel("error: patched no-context vs with-context")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def training_curve(history: list[list[float]], zero_mse: float, path: str | Path, title: str,
                   least_squares_mse: float | None = None) -> Path:
    """Training loss (EMA of the query MSE) against step, with the zero and least-squares MSEs."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    steps, loss = zip(*history)
    ax.semilogy(steps, loss, label="training MSE (EMA)")
    ax.axhline(zero_mse, color="grey", ls=":", label="zero predictor")
    ax.axhline(0.2 * zero_mse, color="grey", ls="--", label="20% of zero predictor")
    if least_squares_mse is not None:
        ax.axhline(least_squares_mse, color="green", ls="-.", label="least squares")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
