"""The shipped models, one per contextual layer: in-context MSE and how their updates converge.

For each model (``tp.load_model(layer=...)``, one recipe, only the layer differs): the MSE on
4096 fresh tasks beside least squares (``tasks.linreg.evaluate``, seed 99), and the log-log slope
of the step norms ``|dW_i - dW_(i-1)|_F`` of ``fc_in`` against the context token ``i``, fitted per
task (float64, 128 tasks, ``tp.diagnostics``), as quartiles over tasks, at the first and the last
layer. This is the README's table. Writes ``benchmarks/results/layer_kinds.json``.

    python benchmarks/layer_kinds.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.dynamics import diagnostics as dg
from tokenpatch.models.icl import SHIPPED
from tokenpatch.tasks.linreg import evaluate, task_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=128, help="tasks for the step-norm slopes")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "layer_kinds.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quartiles = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    rows = []
    print(
        "| layer | in-context MSE | / zero | least squares | slope, layer 0 (25/50/75%) | slope, last layer | train s |"
    )
    print("|---|---|---|---|---|---|---|")
    for layer in SHIPPED:
        model = tp.load_model(layer=layer)
        res = evaluate(model, task_of(model), n_tasks=4096, seed=99)
        model = model.double()
        x = task_of(model).sample(args.tasks, torch.Generator().manual_seed(5), dtype=torch.float64).tokens
        traj = tp.trajectory(model, x)
        slopes = [
            torch.quantile(dg.decay_exponent(dg.step_norms(traj, f"blocks.{i}.mlp.fc_in.weight")), quartiles).tolist()
            for i in (0, model.config.n_layers - 1)
        ]
        row = {
            "layer": layer,
            **res,
            "slope_quartiles_first": slopes[0],
            "slope_quartiles_last": slopes[1],
            "train_seconds_last_session": model.meta.get("seconds_last_session"),
        }
        rows.append(row)
        fmt = lambda q: " / ".join(f"{v:.2f}" for v in q)  # noqa: E731
        print(
            f"| {layer} | {res['mse_model']:.4f} | {res['ratio_zero']:.3f} | {res['mse_least_squares']:.4f} | "
            f"{fmt(slopes[0])} | {fmt(slopes[1])} | {row['train_seconds_last_session'] or float('nan'):.0f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tasks": args.tasks, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
