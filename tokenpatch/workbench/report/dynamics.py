"""The report's dynamics section: how the token patch evolves as the context is read, for the
shipped models that differ only in their contextual layer (``docs/dynamics.md``)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenpatch.dynamics import diagnostics as dg
from tokenpatch.dynamics.online_gd import replay
from tokenpatch.dynamics.trajectories import trajectory
from tokenpatch.models.icl import SHIPPED, load_model
from tokenpatch.progress import progress_bar
from tokenpatch.tasks.linreg import task_of
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.section import Section

__all__ = ["dynamics_section"]

QUANTILES = (0.25, 0.5, 0.75)


def _quartiles(t: torch.Tensor) -> list[float]:
    return torch.quantile(t.double(), torch.tensor(QUANTILES, dtype=torch.float64)).tolist()


def dynamics_section(out: Path, n_tasks: int = 64, seed: int = 11, progress: bool | None = None):
    """Step norms against context length for every shipped layer kind (fitted log-log exponents
    and their spread over tasks), the softmax model's layer alignment, and how far each of its
    layers is from online gradient descent (NLMS replay deviation)."""
    rows, curves, data = (
        [],
        {"layer 0 (fc_in)": {}, "last layer (fc_in)": {}},
        {"n_tasks": n_tasks, "seed": seed, "models": {}},
    )
    alignment = deviation = None
    for layer in progress_bar(sorted(SHIPPED, key=list(SHIPPED).index), progress, desc="dynamics"):
        model = load_model(layer=layer, dtype="float64")
        x = task_of(model).sample(n_tasks, torch.Generator().manual_seed(seed), dtype=torch.float64).tokens
        traj = trajectory(model, x)
        names = [f"blocks.{i}.mlp.fc_in.weight" for i in range(model.config.n_layers)]
        record = {"eval": model.meta.get("eval", {}), "layers": {}}
        for i, name in enumerate(names):
            norms = dg.step_norms(traj, name)  # [B, N]
            record["layers"][str(i)] = {
                "exponent_quartiles": _quartiles(dg.decay_exponent(norms)),
                "median_step_norms": norms.median(0).values.tolist(),
            }
        first, last = record["layers"]["0"], record["layers"][str(len(names) - 1)]
        curves["layer 0 (fc_in)"][layer] = first["median_step_norms"]
        curves["last layer (fc_in)"][layer] = last["median_step_norms"]
        ev = record["eval"]
        rows.append(
            f"| {layer} | {ev.get('mse_model', float('nan')):.4f} | {ev.get('mse_least_squares', float('nan')):.4f} | "
            + " | ".join(
                f"{q[1]:.2f} [{q[0]:.2f}, {q[2]:.2f}]"
                for q in (first["exponent_quartiles"], last["exponent_quartiles"])
            )
            + " |"
        )
        if layer == "softmax":
            alignment = dg.layer_alignment(traj, names).mean(0).tolist()
            deviation = [float(replay(traj, n).deviation[:, -1].median()) for n in names]
            record["layer_alignment_mean"], record["nlms_deviation_median"] = alignment, deviation
        data["models"][layer] = record
    n = traj.n_context
    fig1 = plots.step_norms(
        curves,
        out / "dynamics_step_norms.png",
        f"Step norms |dW_i - dW_(i-1)|_F, median over {n_tasks} tasks (float64)",
    )
    lines = [
        f"For {n_tasks} fresh tasks, `tp.trajectory` gives the token patch after each of the {n} context "
        "examples at every layer, for shipped models that differ only in their contextual layer. The step "
        "norm `|dW_i - dW_(i-1)|_F` is the size of the update example `i` makes; its log-log slope against `i` "
        "(fitted per task for i >= 2) is below, median [25%, 75%] over tasks.",
        "",
        "| layer kind | in-context MSE | least squares | exponent, layer 0 | exponent, last layer |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"![step norms]({fig1.name})",
    ]
    figures = [fig1.name]
    if alignment is not None:
        fig2 = plots.heatmap(
            alignment,
            [f"L{i}" for i in range(len(alignment))],
            out / "dynamics_layer_alignment.png",
            "softmax model: cosine between the layers'\nfc_in patches after all the context",
        )
        figures.append(fig2.name)
        lines += [
            "",
            "Online gradient descent: replayed as normalised-LMS steps (`tp.replay`), the softmax model's "
            "updates deviate from the trajectory by (median relative Frobenius distance at the last token, per "
            "layer): "
            + ", ".join(f"L{i} {d:.2g}" for i, d in enumerate(deviation))
            + ". The identity is exact at the first layer, where the anchor is fixed; deeper layers are not NLMS.",
            "",
            f"![layer alignment]({fig2.name})",
        ]
    return Section(
        "dynamics", "Implicit learning dynamics: one update per context token", "\n".join(lines), figures, data
    )
