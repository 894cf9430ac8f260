"""Figures (matplotlib, Agg backend: no screen needed). Each function writes one PNG and
returns its path; the numbers it draws are returned by the caller in the report's JSON."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter  # noqa: E402

__all__ = ["layer_errors", "training_curve", "step_norms", "heatmap", "per_layer", "curves", "thought_curves"]

Rows = list[tuple[str, float, float]]  # [(site, max_abs, max_rel), ...]


def _below(ax, ncols: int = 2) -> None:
    """Legend under the axes, outside the data (constrained layout makes room for it)."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=ncols, fontsize=8, frameon=False)


def layer_errors(
    series: dict[str, Rows],
    path: str | Path,
    title: str,
    reference: Rows | None = None,
    rel_targets: dict[str, float] | None = None,
    abs_targets: dict[str, float] | None = None,
) -> Path:
    """Two panels of error per site (each layer's output hidden state L0, L1, ..., then the model
    output), patched no-context pass vs with-context pass, one colour per series:

    - left: max relative error, with ``reference`` (grey: the query alone *without* the patch, i.e.
      the size of the context's effect that the patch reproduces) and ``rel_targets``;
    - right: max absolute error, with ``abs_targets``.

    ``series``: label -> ``[(site, max_abs, max_rel), ...]`` in site order; ``reference``: the same
    rows; ``*_targets``: series label -> tolerance, drawn as a dashed horizontal line in its colour.
    """
    path = Path(path)
    colours = dict(zip(series, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    sites = [r[0].replace("layer ", "L") for r in next(iter(series.values()))]
    x = range(len(sites))
    fig, (rel, ab) = plt.subplots(1, 2, figsize=(11, 4.6), constrained_layout=True)
    if reference:
        rel.semilogy(x, [r[2] for r in reference], "x:", color="grey", label="query alone, no patch")
    for ax, col, kind, targets in ((rel, 2, "rel", rel_targets), (ab, 1, "abs", abs_targets)):
        for label, rows in series.items():
            ax.semilogy(x, [max(r[col], 1e-300) for r in rows], "o-", color=colours[label], label=label)
        for label, tol in (targets or {}).items():
            ax.axhline(tol, color=colours[label], ls="--", lw=1, label=f"{label} target: max {kind} <= {tol:.0e}")
        ax.set_xticks(x, sites)
        ax.set_xlabel("site (layer output hidden state, then model output)")
        ax.set_ylabel(f"max {'relative' if kind == 'rel' else 'absolute'} error (log)")
        ax.yaxis.set_major_locator(LogLocator(base=10, numticks=10))  # at most ~10 labelled decades
        ax.grid(True, which="major", alpha=0.3)
        _below(ax)
    rel.set_title("max relative error per site")
    ab.set_title("max absolute error per site")
    fig.suptitle(f"{title}: patched no-context pass vs with-context pass")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def training_curve(
    history: list[list[float]],
    zero_mse: float,
    path: str | Path,
    title: str,
    least_squares_mse: float | None = None,
    model_mse: float | None = None,
) -> Path:
    """Training loss (EMA of the query MSE) against step, beside the zero predictor, 20% of it
    (the target), least squares, and ``model_mse`` (the trained model's MSE on fresh tasks, as in
    the report's table) marked at the last step."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.4), constrained_layout=True)
    steps, loss = zip(*history)
    ax.semilogy(steps, loss, label="training MSE (EMA)")
    ax.axhline(zero_mse, color="grey", ls=":", label="zero predictor")
    ax.axhline(0.2 * zero_mse, color="grey", ls="--", label="20% of zero predictor (target)")
    if least_squares_mse is not None:
        ax.axhline(least_squares_mse, color="green", ls="-.", label="least squares")
    if model_mse is not None:
        ax.plot(steps[-1], model_mse, "D", color="C3", label="evaluation MSE, fresh tasks")
        ax.annotate(
            f"eval {model_mse:.4f}",
            (steps[-1], model_mse),
            xytext=(-8, 8),
            textcoords="offset points",
            ha="right",
            color="C3",
            fontsize=9,
        )
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("step")
    ax.set_ylabel("MSE (log)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    _below(ax, ncols=3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def step_norms(
    curves: dict[str, dict[str, list[float]]], path: str | Path, title: str, paired: tuple[str, ...] = ()
) -> Path:
    """Median step norm ``|dW_i - dW_{i-1}|_F`` against the context token ``i`` (log-log), one panel
    per layer of the model, one line per model. ``curves``: panel -> model label -> medians. In the
    ``paired`` panels the lines come in pairs drawn in one colour, the first solid, the second dashed."""
    path = Path(path)
    fig, axes = plt.subplots(1, len(curves), figsize=(5.2 * len(curves), 4.2), constrained_layout=True, squeeze=False)
    for ax, (panel, lines) in zip(axes[0], curves.items()):
        for j, (label, ys) in enumerate(lines.items()):
            style = dict(color=f"C{j // 2}", ls="-" if j % 2 == 0 else "--") if panel in paired else {"ls": "-"}
            ax.loglog(range(1, len(ys) + 1), ys, marker="o", ms=3, label=label, **style)
        ax.set_xlabel("context token i")
        ax.set_ylabel("median step norm (log)")
        ax.set_title(panel)
        ax.grid(True, which="both", alpha=0.3)
        _below(ax, ncols=3)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def heatmap(matrix: list[list[float]], labels: list[str], path: str | Path, title: str) -> Path:
    """A square matrix of cosines in [-1, 1] with its values written in the cells."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.2, 5.2), constrained_layout=True)
    im = ax.imshow(matrix, vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yticks(range(len(labels)), labels)
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            ax.text(
                j,
                i,
                f"{value:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if abs(value) > 0.6 else "black",
            )
    fig.colorbar(im, ax=ax, label="cosine")
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def update_norms_figure(norms, tokens: list[str], path: str | Path, title: str) -> Path:
    """Per generated token (x) and layer (y), the norm of the layer's implicit update, log colour scale."""
    import numpy as np
    from matplotlib.colors import LogNorm

    path = Path(path)
    values = np.asarray(norms, dtype=float).T  # [L, n]
    positive = values[values > 0]
    fig, ax = plt.subplots(
        figsize=(max(5.0, 0.38 * values.shape[1] + 2), 0.18 * values.shape[0] + 2.2), constrained_layout=True
    )
    im = ax.imshow(
        values,
        aspect="auto",
        origin="lower",
        cmap="viridis",
        norm=LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None,
    )
    ax.set_xticks(range(len(tokens)), [repr(t)[1:-1] for t in tokens], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("layer")
    ax.set_xlabel("generated token")
    fig.colorbar(im, ax=ax, label="|implicit update|_F")
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


Band = tuple[list[float], list[float], list[float]]  # (means, lows, highs), one value per x


def _style(label: str, colours: dict[str, str], cycle) -> dict:
    """Grey dots for baselines (labels starting with "random"), else the label's fixed colour."""
    if label.startswith("random"):
        return dict(color="grey", ls=":")
    return dict(color=colours[label] if label in colours else next(cycle))


def per_layer(
    panels: dict[str, dict[str, Band]],
    path: str | Path,
    title: str,
    ylabel: str = "cosine",
    colours: dict[str, str] | None = None,
) -> Path:
    """One panel per entry of ``panels`` (panel title -> label -> ``(means, lows, highs)`` per layer):
    means as lines, their intervals as error bars; ``colours``: label -> colour, the same in every
    figure; labels starting with ``"random"`` are drawn grey."""
    path, colours = Path(path), colours or {}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), constrained_layout=True, squeeze=False)
    for ax, (panel, lines) in zip(axes[0], panels.items()):
        cycle = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
        for label, (mean, low, high) in lines.items():
            x = range(len(mean))
            err = [[m - lo for m, lo in zip(mean, low)], [hi - m for m, hi in zip(mean, high)]]
            ax.errorbar(x, mean, yerr=err, marker="o", ms=3, capsize=2, label=label, **_style(label, colours, cycle))
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xticks(range(len(mean)), [f"L{i}" for i in range(len(mean))])
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.set_title(panel, fontsize=10)
        ax.grid(True, alpha=0.3)
        _below(ax)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def curves(
    panels: dict[str, dict], path: str | Path, title: str, colours: dict[str, str] | None = None, wide: bool = False
) -> Path:
    """Line panels. ``panels``: title -> ``{"x": label, "y": label, "logx": bool, "logy": bool,
    "lines": {label: (xs, ys)}}``; ``colours`` and grey baselines as in ``per_layer``; ``wide``:
    panels twice as wide (many lines)."""
    path, colours = Path(path), colours or {}
    width = 9.0 if wide else 5.2
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4.8), constrained_layout=True, squeeze=False)
    for ax, (panel, spec) in zip(axes[0], panels.items()):
        cycle = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
        for label, (xs, ys) in spec["lines"].items():
            flat = len(xs) == 2 and ys[0] == ys[1]  # a reference level
            ax.plot(
                xs,
                ys,
                marker=None if flat else "o",
                ms=3,
                label=label,
                **({"ls": "--"} if flat else {}),
                **_style(label, colours, cycle),
            )
        ax.set_xscale("log" if spec.get("logx") else "linear")
        ax.set_yscale("log" if spec.get("logy") else "linear")
        if not spec.get("logy"):
            ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel(spec["x"])
        ax.set_ylabel(spec["y"])
        ax.set_title(panel, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        _below(ax)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def thought_curves(curve: dict, ridge: dict, d_in: int, d_hidden: int, path: str | Path, title: str) -> Path:
    """Left: train and test error (median, 25-75% band) against the number of calibration queries
    ``curve["m"]``, log-log, with the interpolation thresholds ``d_in`` and ``d_hidden + 1`` marked.
    Right: the same against the ridge ``ridge["ridge"]`` at ``ridge["m"]`` queries. Errors below
    1e-20 (exact interpolation) are drawn at 1e-20."""
    path = Path(path)
    floor = 1e-20
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    for ax, xs, data in ((left, curve["m"], curve), (right, list(range(len(ridge["ridge"]))), ridge)):
        for key, colour in (("train", "C0"), ("test", "C3")):
            q = [[max(v, floor) for v in row] for row in data[key]]
            ax.plot(xs, [r[1] for r in q], "o-", color=colour, label=f"{key} (median over prompts)")
            ax.fill_between(xs, [r[0] for r in q], [r[2] for r in q], color=colour, alpha=0.2)
        ax.set_yscale("log")
        ax.axhline(1, color="grey", ls=":", label="no prompt, no patch")
        ax.set_ylabel("error / no-prompt error (log)")
        ax.grid(True, which="major", alpha=0.3)
    left.set_xscale("log")
    for x, label in ((d_in, f"d_in = {d_in}"), (d_hidden + 1, f"d_hidden + 1 = {d_hidden + 1}")):
        left.axvline(x, color="black", ls="--", lw=0.8)
        left.annotate(label, (x, floor), xytext=(3, 6), textcoords="offset points", fontsize=8)
    left.set_xlabel("calibration queries m (log)")
    left.set_title("against the number of calibration queries (lambda = 0)", fontsize=10)
    right.set_xticks(range(len(ridge["ridge"])), [f"{v:g}" for v in ridge["ridge"]])
    right.set_xlabel("ridge lambda")
    right.set_title(f"against the ridge, m = {ridge['m']}", fontsize=10)
    for ax in (left, right):
        _below(ax, ncols=3)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
