"""The report's attention-against-recurrence section (``docs/dynamics.md``, section 5): how the implicit
updates converge along the context when the contextual layer is ``transformers``' own code.

For each shipped model of ``workbench.train.kinds`` (Llama attention, Gated DeltaNet, Mamba 2, RG-LRU,
LFM2's short convolution, a 3:1 Gated DeltaNet / attention hybrid; ``--full`` trains them here) and
for an untrained model of the same shape (the control: what the architecture does before learning),
on fresh tasks in float64, every block's ``fc_in`` update after each context token (``tp.trajectory``):

* the step norms' log-log slope ``|dW_i - dW_(i-1)|_F ~ i^slope`` (fitted per task for ``i >= 2``),
* the distance to the limit ``|dW_(N/2) - dW_N|_F / |dW_N|_F`` halfway through the context.

Without ``transformers`` the section is one line naming the install command.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from tokenpatch.dynamics import diagnostics as dg
from tokenpatch.dynamics.trajectories import trajectory
from tokenpatch.models.icl import ICLTransformer, load_model
from tokenpatch.progress import progress_bar
from tokenpatch.tasks.linreg import task_of
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.section import Section
from tokenpatch.workbench.train.kinds import KINDS, train_kind

__all__ = ["recurrence_section"]

KEY, TITLE = "recurrence", "Attention against recurrence, on transformers' own layers"
QUANTILES = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)


def _measure(model: ICLTransformer, tokens: torch.Tensor) -> list[dict]:
    """Per block: slope quartiles over tasks, median step norms, median distance to the limit."""
    traj = trajectory(model, tokens)
    half = traj.n_context // 2
    layers = []
    for i in range(model.config.n_layers):
        name = f"blocks.{i}.mlp.fc_in.weight"
        norms, gap = dg.step_norms(traj, name), dg.limit_distance(traj, name)  # [B, N], [B, N + 1]
        layers.append(
            {
                "kind": model.config.kind(i),
                "slope_quartiles": torch.quantile(dg.decay_exponent(norms), QUANTILES).tolist(),
                "median_step_norms": norms.median(0).values.tolist(),
                "median_limit_distance": gap.median(0).values.tolist(),
                "limit_distance_half": float(gap[:, half].median()),
            }
        )
    return layers


def _trained(name: str, out: Path, full: bool, progress) -> ICLTransformer:
    if full:
        return train_kind(name, out / "runs" / f"linreg-tf-{name}.safetensors", progress=progress)
    return load_model(layer=name)


def _cell(layer: dict) -> str:
    q = layer["slope_quartiles"]
    return f"{q[1]:.2f} [{q[0]:.2f}, {q[2]:.2f}] / {layer['limit_distance_half']:.2f}"


def recurrence_section(
    out: Path, n_tasks: int = 32, seed: int = 11, full: bool = False, progress: bool | None = None
) -> Section:
    """Step-norm slopes and distances to the limit of every block, trained and untrained, for every
    model of ``KINDS``; figures of the median curves (``docs/dynamics.md``, section 5)."""
    if importlib.util.find_spec("transformers") is None:
        return Section(
            KEY,
            TITLE,
            "Skipped: these models' mixers are transformers' own code, and transformers is not installed; "
            "`pip install 'tokenpatch[hf]'` to include it.",
            data={"skipped": True, "reason": "transformers is not installed"},
        )
    out = Path(out)
    data = {"n_tasks": n_tasks, "seed": seed, "models": {}}
    for name in progress_bar(list(KINDS), progress, desc="recurrence"):
        model = _trained(name, out, full, progress).double()
        torch.manual_seed(seed)
        control = ICLTransformer(model.config).double().eval()
        tokens = task_of(model).sample(n_tasks, torch.Generator().manual_seed(seed), dtype=torch.float64).tokens
        data["models"][name] = {
            "describe": model.config.describe(),
            "eval": model.meta.get("eval", {}),
            "layers": _measure(model, tokens),
            "untrained": _measure(control, tokens),
        }
    models = data["models"]
    n_layers = len(next(iter(models.values()))["layers"])
    rows = []
    for name, rec in models.items():
        ev = rec["eval"]
        for which in ("layers", "untrained"):
            mse = f"{ev.get('mse_model', float('nan')):.3f}" if which == "layers" else "untrained"
            rows.append(f"| {name} | {mse} | " + " | ".join(_cell(x) for x in rec[which]) + " |")
    least = next(iter(models.values()))["eval"].get("mse_least_squares", float("nan"))
    panels = {
        f"block {i} ({'last' if i == n_layers - 1 else 'first' if i == 0 else 'middle'})": {
            name: rec["layers"][i]["median_step_norms"] for name, rec in models.items()
        }
        for i in (0, n_layers - 1)
    }
    beside = "hybrid (solid) against Gated DeltaNet alone (dashed)"
    panels[beside] = {
        f"{name} block {i} ({layer['kind']})": layer["median_step_norms"]
        for i in range(n_layers)
        for name in ("hybrid", "deltanet")
        for layer in (models[name]["layers"][i],)
    }
    fig = plots.step_norms(
        panels,
        out / "recurrence_step_norms.png",
        f"transformers' mixers: median step norms over {n_tasks} tasks",
        paired=(beside,),
    )
    n = len(next(iter(models.values()))["layers"][0]["median_step_norms"])
    body = [
        f"Four-block models whose contextual layer is transformers' own code (`tp.load_model(layer=...)`; one "
        "recipe, only the mixer differs; the hybrid has Gated DeltaNet in blocks 0-2 and Llama attention in "
        f"block 3, as Qwen3.5 interleaves them), on {n_tasks} fresh tasks with {n} context examples, float64. "
        "Per block: the step norms' log-log slope, median [25%, 75%] over tasks, then the median distance "
        f"`|dW_{n // 2} - dW_{n}|_F / |dW_{n}|_F` of the halfway update to the final one. Each trained model is "
        "followed by an untrained one of the same shape (the control). In-context MSE on fresh tasks; least "
        f"squares {least:.3f}.",
        "",
        "| model | MSE | " + " | ".join(f"block {i}" for i in range(n_layers)) + " |",
        "|---|---|" + "---|" * n_layers,
        *rows,
        "",
        f"![step norms]({fig.name})",
    ]
    return Section(KEY, TITLE, "\n".join(body), [fig.name], data)
