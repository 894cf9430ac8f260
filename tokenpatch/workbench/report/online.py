"""The report's step-by-step section: the implicit update of each context example against the
explicit gradient of that example and against online SGD, as *Learning without training* measures
it (``tp.online_alignment``, ``docs/dynamics.md`` section 7), on the shipped softmax model and an
untrained model of the same shape."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from tokenpatch.dynamics.online_sgd import online_alignment
from tokenpatch.dynamics.trajectories import trajectory
from tokenpatch.models.icl import ICLTransformer, load_model
from tokenpatch.progress import progress_bar
from tokenpatch.stats import mean_interval
from tokenpatch.tasks.linreg import fresh_queries, task_of, training_points
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.section import Section

__all__ = ["online_section", "measure", "LRS"]

LRS = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1)  # online-SGD learning rates swept; the one of lowest held-out MSE is reported
COSINES = {  # OnlineAlignment field -> label
    "gradient": "cos(S_i, -g_i)",
    "gradient_shuffled": "another example",
    "gradient_other_run": "another task",
    "random": "random",
}


def _per_run(t: Tensor) -> dict:
    """``[R, ...]`` -> the mean over runs (each run's mean over the rest first) with its 95% interval."""
    return mean_interval(t.reshape(t.shape[0], -1).mean(1))


@torch.no_grad()
def _icl_heldout(model: ICLTransformer, tokens: Tensor, queries: Tensor, y_q: Tensor) -> Tensor:
    """Held-out MSE with the first ``i`` context examples, ``i = 0..N`` -> ``[R, N + 1]``."""
    r, m, width = queries.shape
    out = []
    for i in range(tokens.shape[1] + 1):
        ctx = tokens[:, None, :i].expand(r, m, i, width)
        seq = torch.cat([ctx, queries[:, :, None]], 2).reshape(r * m, i + 1, width)
        out.append(((model(seq)[:, -1, 0].reshape(r, m) - y_q) ** 2).mean(1))
    return torch.stack(out, 1)


def measure(
    model: ICLTransformer, n_tasks: int = 16, n_queries: int = 32, seed: int = 17, progress: bool | None = None
) -> dict:
    """Every number of the section for one model (float64): the cosines of ``tp.online_alignment`` per
    layer (``fc_in``), per step at the first and last layers, the online-SGD learning-rate sweep, and the
    held-out MSE along the context for in-context learning and for online SGD. JSON-able."""
    task = task_of(model)
    g = torch.Generator().manual_seed(seed)
    batch = task.sample(n_tasks, g, dtype=torch.float64)
    queries, y_q = fresh_queries(batch, n_queries, task.noise, g)  # [R, m, d], [R, m]
    n = task.n_context
    traj = trajectory(model, batch.tokens)
    xs, ys = training_points(batch)  # [R, N, 1, d], [R, N, 1]
    names = [f"blocks.{i}.mlp.fc_in.weight" for i in range(model.config.n_layers)]

    def loss(i: int) -> Tensor:  # example i's loss: (y_hat([x_i; 0]) - y_i)^2
        return (model(xs[:, i])[:, -1, 0] - ys[:, i, 0]) ** 2

    def heldout() -> Tensor:
        return ((model(queries.reshape(-1, 1, queries.shape[-1]))[:, -1, 0].reshape(n_tasks, -1) - y_q) ** 2).mean(1)

    al = online_alignment(
        model, [traj.patch(i) for i in range(n + 1)], loss, lrs=LRS, names=names, heldout=heldout,
        generator=g, progress=progress,
    )  # fmt: skip
    final = al.heldout[:, :, -1].mean(1)  # [L]
    best = min(range(len(LRS)), key=lambda k: final[k] if math.isfinite(final[k]) else math.inf)
    layers = range(len(names))
    per_layer = lambda t: [_per_run(t[..., j]) for j in layers]  # noqa: E731
    by_step = lambda t, j: t[:, :, j].mean(0).tolist()  # noqa: E731
    return {
        "n_tasks": n_tasks,
        "n_queries": n_queries,
        "n_context": n,
        "seed": seed,
        "lrs": list(LRS),
        "chosen_lr": LRS[best],
        "order": al.order,
        "per_layer": {
            **{k: per_layer(getattr(al, k)) for k in COSINES},
            "sgd_step": per_layer(al.sgd_step[best]),
            "shuffled_sgd_step": per_layer(al.shuffled_sgd_step[best]),
            "sgd_weights": per_layer(al.sgd_weights[best][:, -1:]),
            "shuffled_sgd_weights": per_layer(al.shuffled_sgd_weights[best][:, -1:]),
            "sgd_ceiling": per_layer(al.sgd_ceiling[best][:, -1:]),
        },
        "by_step": {
            str(j): {
                **{k: by_step(getattr(al, k), j) for k in ("gradient", "gradient_shuffled", "random")},
                "sgd_step": by_step(al.sgd_step[best], j),
                "sgd_weights": by_step(al.sgd_weights[best], j),
                "shuffled_sgd_weights": by_step(al.shuffled_sgd_weights[best], j),
                "sgd_ceiling": by_step(al.sgd_ceiling[best], j),
            }
            for j in (0, len(names) - 1)
        },
        "sweep": [
            {
                "lr": lr,
                "heldout_mse": float(final[k]),
                "sgd_step": float(al.sgd_step[k].mean()),
                "sgd_weights_last": float(al.sgd_weights[k][:, -1].mean()),
            }
            for k, lr in enumerate(LRS)
        ],
        "heldout_sgd": al.heldout[best].mean(0).tolist(),
        "heldout_icl": _icl_heldout(model, batch.tokens[:, :n], queries, y_q).mean(0).tolist(),
    }


def _band(rows: list[dict]) -> tuple[list[float], list[float], list[float]]:
    return [r["mean"] for r in rows], [r["lo"] for r in rows], [r["hi"] for r in rows]


def _table(res: dict) -> list[str]:
    t, u = res["trained"]["per_layer"], res["untrained"]["per_layer"]
    cols = [
        ("cos(S_i, -g_i)", t["gradient"]),
        ("another example", t["gradient_shuffled"]),
        ("another task", t["gradient_other_run"]),
        ("random", t["random"]),
        ("SGD step", t["sgd_step"]),
        ("SGD step, shuffled order", t["shuffled_sgd_step"]),
        ("cos(dW_N, D_N)", t["sgd_weights"]),
        ("rank-1 ceiling", t["sgd_ceiling"]),
        ("untrained: cos(S_i, -g_i)", u["gradient"]),
        ("untrained: SGD step", u["sgd_step"]),
    ]
    rows = ["| layer | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    return rows + [
        f"| L{i} | " + " | ".join(f"{v[i]['mean']:+.3f}" for _, v in cols) + " |" for i in range(len(t["gradient"]))
    ]


def online_section(out: Path, n_tasks: int = 16, seed: int = 17, progress: bool | None = None) -> Section:
    """Step-by-step alignment on the shipped softmax model, beside an untrained control."""
    trained = load_model(layer="softmax", dtype="float64")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        untrained = ICLTransformer(trained.config).to(torch.float64)
    res = {
        name: measure(m, n_tasks=n_tasks, seed=seed, progress=progress)
        for name, m in progress_bar([("trained", trained), ("untrained", untrained)], progress, desc="step by step")
    }
    t = res["trained"]
    n_layers, n = trained.config.n_layers, t["n_context"]
    fig1 = plots.per_layer(
        {
            "each example's implicit step S_i = dW_i - dW_(i-1), fc_in": {
                "trained: vs -g_i": _band(t["per_layer"]["gradient"]),
                "trained: vs another example": _band(t["per_layer"]["gradient_shuffled"]),
                "trained: vs online SGD step": _band(t["per_layer"]["sgd_step"]),
                "untrained: vs -g_i": _band(res["untrained"]["per_layer"]["gradient"]),
                "random matrix": _band(t["per_layer"]["random"]),
            },
            f"after all {n} examples: cos(dW_N, D_N)": {
                "trained: online SGD": _band(t["per_layer"]["sgd_weights"]),
                "trained: online SGD, shuffled order": _band(t["per_layer"]["shuffled_sgd_weights"]),
                "untrained: online SGD": _band(res["untrained"]["per_layer"]["sgd_weights"]),
            },
        },
        out / "online_alignment.png",
        f"Implicit steps against explicit gradients, mean over {n_tasks} tasks and {n} steps, 95% intervals",
    )
    steps = list(range(1, n + 1))
    panels = {
        f"L{j}: per step i": {
            "x": "example i",
            "y": "cosine",
            "lines": {
                "cos(S_i, -g_i)": (steps, s["gradient"]),
                "cos(S_i, SGD step)": (steps, s["sgd_step"]),
                "cos(dW_i, D_i)": (steps, s["sgd_weights"]),
                "rank-1 ceiling of D_i": (steps, s["sgd_ceiling"]),
                "random": (steps, s["random"]),
            },
        }
        for j, s in ((int(k), v) for k, v in t["by_step"].items())
    }
    panels["held-out MSE (mean over tasks)"] = {
        "x": "examples read i",
        "y": "MSE",
        "logy": True,
        "lines": {
            "in context (prefix i)": (list(range(n + 1)), t["heldout_icl"]),
            f"online SGD, lr {t['chosen_lr']:g}": (list(range(n + 1)), t["heldout_sgd"]),
        },
    }
    fig2 = plots.curves(
        panels, out / "online_curves.png", "Step by step: alignment and held-out loss along the context"
    )
    sweep = ["| lr | held-out MSE after one pass | mean cos(S_i, SGD step) | cos(dW_N, D_N), mean over layers |"]
    sweep += ["|---|---|---|---|"] + [
        f"| {r['lr']:g} | {r['heldout_mse']:.3f} | {r['sgd_step']:+.3f} | {r['sgd_weights_last']:+.3f} |"
        for r in t["sweep"]
    ]
    g, rnd = t["per_layer"]["gradient"], t["per_layer"]["random"]
    hi = max(range(n_layers), key=lambda i: g[i]["mean"])
    lo = min(range(n_layers), key=lambda i: g[i]["mean"])
    above = [i for i in range(n_layers) if g[i]["lo"] > t["per_layer"]["gradient_shuffled"][i]["hi"]]
    body = [
        f"The protocol of *Learning without training*, step by step ({n_tasks} fresh tasks of {n} examples; "
        "`tp.online_alignment`). Reading example `i` moves the implicit weights by `S_i = dW_i - dW_(i-1)` (token "
        "patches of prefixes `i` and `i - 1`, anchored at the query). Set beside it, on each layer's `fc_in`: (a) the "
        "gradient `g_i` of example `i`'s own loss `(y_hat([x_i; 0]) - y_i)^2` at the implicit weights before it, `W + "
        "dW_(i-1)`; (b) the step of online SGD (batch 1, one pass in context order) at the learning rate of lowest "
        f"held-out MSE after the pass ({t['chosen_lr']:g}; sweep below). Controls: another example's gradient at the "
        "same weights (a fixed derangement of the order), another task's gradient, a random matrix, SGD in that "
        "shuffled order, and the same measurements on an untrained model of the same shape. Means over tasks and "
        "steps, per layer:",
        "",
        *_table(res),
        "",
        f"The step alignment `cos(S_i, -g_i)` ranges from {g[lo]['mean']:+.3f} [{g[lo]['lo']:+.3f}, {g[lo]['hi']:+.3f}] "
        f"(L{lo}) to {g[hi]['mean']:+.3f} [{g[hi]['lo']:+.3f}, {g[hi]['hi']:+.3f}] (L{hi}), against "
        f"{rnd[hi]['mean']:+.3f} for a random matrix; the true example's gradient beats another example's (intervals "
        f"apart) on {len(above)} of {n_layers} layers"
        + (f" ({', '.join(f'L{i}' for i in above)})" if above else "")
        + ". 'Highly aligned' would mean cosines near 1. On a one-block model the implicit step *is* an online "
        "gradient step, with cosine exactly 1 (tested), but of the normalised-LMS loss `1/2 |W' a - W s_i|^2` on "
        "the query's own MLP input `a`, not of the example's prediction loss.",
        "",
        f"![per layer]({fig1.name})",
        "",
        "The online-SGD learning rate (trained model):",
        "",
        *sweep,
        "",
        f"![per step]({fig2.name})",
    ]
    return Section(
        "online",
        "Implicit against explicit gradients, step by step",
        "\n".join(body),
        [fig1.name, fig2.name],
        res,
    )
