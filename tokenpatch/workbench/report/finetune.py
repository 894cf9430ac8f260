"""The report's fine-tuning section: the implicit update of in-context learning beside explicit
fine-tuning on the same examples (``docs/dynamics.md``), for the shipped softmax model and an
untrained model of the same shape (the control of Deutch et al., 2024)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from tokenpatch.dynamics.diagnostics import cosine, rank1_ceiling
from tokenpatch.dynamics.finetuning import finetune, finetuned, simaou
from tokenpatch.dynamics.trajectories import trajectory
from tokenpatch.lowrank import LowRank
from tokenpatch.models.icl import ICLTransformer, load_model
from tokenpatch.patch import Patch
from tokenpatch.patching import token_patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import functional_call
from tokenpatch.stats import mean_interval
from tokenpatch.tasks.linreg import fresh_queries, least_squares, task_of, training_points
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.section import Section

__all__ = ["finetune_section", "compare"]

OPTIMIZERS = ("sgd", "adam")
EXAMPLES = (1, 2, 4, 8, 16)  # context examples n for the alignment-vs-n curve
RECORD = (1, 2, 4, 8, 16, 32)  # steps at which the alignment is read, besides the last
PREDICTORS = {
    "with_context": "with context",
    "zero_shot": "query alone (zero-shot)",
    "least_squares": "least squares",
    "token_patch_each_query": "token patch of each held-out query (exact)",
    "token_patch_own_query": "token patch of the task's own query",
    "finetuned_sgd": "fine-tuned, SGD",
    "finetuned_adam": "fine-tuned, Adam",
}  # results.json key -> report label
COLOURS = {
    "trained, SGD": "C0",
    "trained, Adam": "C1",
    "trained, Adam vs mean patch": "C2",
    "untrained, SGD": "C3",
    "untrained, Adam": "C4",
}  # one colour per run in every figure


def _stats(t: Tensor) -> dict:
    """Mean over tasks with its 95% Student-t interval (``stats.mean_interval``) -> ``{"mean", "lo", "hi"}``."""
    return mean_interval(t.flatten())


def _mean_patch(patch: Patch, name: str, tasks: int) -> LowRank:
    """The mean over each task's ``m`` held-out queries of their token patches: rank ``m`` -> lead ``[B]``."""
    d = patch[name]  # lead [B*m, 1], rank 1
    u, v = d.u.reshape(tasks, -1, d.shape[0]), d.v.reshape(tasks, -1, d.shape[1])  # [B, m, rows], [B, m, cols]
    return LowRank(u / u.shape[1], v)


@torch.no_grad()
def _hidden(model, x: Tensor) -> list[Tensor]:
    return [h[:, -1] for h in model(x, return_hidden=True)[1]]  # each layer's output at the last position


def compare(
    model: ICLTransformer,
    n_tasks: int = 32,
    n_queries: int = 16,
    steps: int = 64,
    seed: int = 13,
    progress: bool | None = None,
) -> dict:
    """Every number of the section for one model (float64): per layer, the cosine between the token
    patch of the whole context and the fine-tuning update (SGD and Adam, all layers' ``fc_in`` at once,
    full batch), against steps and against the number of examples; the same for the mean token patch
    over held-out queries, for another task's update and for random rank-1 directions; SimAOU on
    held-out queries; the training losses and held-out predictions. Returns JSON-able numbers."""
    task = task_of(model)
    g = torch.Generator().manual_seed(seed)
    batch = task.sample(n_tasks, g, dtype=torch.float64)
    queries, y_q = fresh_queries(batch, n_queries, task.noise, g)  # [B, m, d], [B, m]
    n_ctx, width = task.n_context, batch.tokens.shape[-1]
    with_ctx = torch.cat([batch.tokens[:, None, :-1].expand(-1, n_queries, -1, -1), queries[:, :, None]], 2)
    with_ctx = with_ctx.reshape(-1, n_ctx + 1, width)  # [B*m, N+1, d]  the context, then a held-out query
    alone = queries.reshape(-1, 1, width)  # [B*m, 1, d]
    names = [f"blocks.{i}.mlp.fc_in.weight" for i in range(model.config.n_layers)]
    traj = trajectory(model, batch.tokens)
    icl = {name: traj.patch(n_ctx)[name].index((slice(None), 0)) for name in names}  # lead [B]
    held = token_patch(model, with_ctx)
    mean_patch = {name: _mean_patch(held, name, n_tasks) for name in names}
    h_ctx, h_0 = _hidden(model, with_ctx), _hidden(model, alone)
    rand = {
        name: LowRank(
            torch.randn(n_tasks, 1, *icl[name].shape[:1], generator=g, dtype=torch.float64),
            torch.randn(n_tasks, 1, icl[name].shape[1], generator=g, dtype=torch.float64),
        )
        for name in names
    }
    per_layer = lambda f: [_stats(f(name)) for name in names]  # noqa: E731
    out = {"n_tasks": n_tasks, "n_queries": n_queries, "steps": steps, "seed": seed, "optimizers": {}}
    with torch.no_grad():
        preds = {"with_context": model(with_ctx)[:, -1, 0], "zero_shot": model(alone)[:, -1, 0]}
    x_ctx, y_ctx = batch.x[:, :-1], batch.y[:, :-1]
    preds["least_squares"] = torch.stack([least_squares(x_ctx, y_ctx, queries[:, j, :-1]) for j in range(n_queries)], 1)
    own = token_patch(model, batch.tokens)  # [B, 1]: each task's patch for its own query, used on held-out ones
    spread = own.map(lambda t: t.expand(-1, n_queries, *t.shape[2:]))  # [B, m]: the same patch for every query
    with torch.no_grad():
        preds["token_patch_own_query"] = functional_call(model, spread, alone)[:, -1, 0]
        preds["token_patch_each_query"] = functional_call(model, held, alone)[:, -1, 0]
    for opt in progress_bar(OPTIMIZERS, progress, desc="finetune", leave=False):
        xs, ys = training_points(batch)
        ft = finetune(model, xs, ys, optimizer=opt, steps=steps, record=RECORD, progress=False)
        last = ft.at()
        with torch.no_grad(), finetuned(model, last):
            h_ft = _hidden(model, alone)  # B*m sequences, m per run, in run order
            preds[f"finetuned_{opt}"] = model(alone)[:, -1, 0]
        by_n, rand_n = {}, {}
        for n in EXAMPLES:
            ft_n = (
                last
                if n == n_ctx
                else finetune(model, *training_points(batch, n), optimizer=opt, steps=steps, progress=False).at()
            )
            by_n[n] = per_layer(lambda nm: cosine(traj.patch(n)[nm].index((slice(None), 0)), ft_n[nm]))
            rand_n[n] = per_layer(lambda nm: cosine(rand[nm], ft_n[nm]))
        out["optimizers"][opt] = {
            "lr": ft.meta["lr"],
            "alignment": per_layer(lambda nm: cosine(icl[nm], last[nm])),
            "alignment_by_step": {s: per_layer(lambda nm: cosine(icl[nm], ft.at(s)[nm])) for s in sorted(ft.deltas)},
            "alignment_by_examples": by_n,
            "random_alignment_by_step": {
                s: per_layer(lambda nm: cosine(rand[nm], ft.at(s)[nm])) for s in sorted(ft.deltas)
            },
            "random_alignment_by_examples": rand_n,
            "mean_patch_alignment": per_layer(lambda nm: cosine(mean_patch[nm], last[nm])),
            "other_task_alignment": per_layer(lambda nm: cosine(icl[nm], last[nm].roll(1, 0))),
            "random_alignment": per_layer(lambda nm: cosine(rand[nm], last[nm])),
            "rank1_ceiling": per_layer(lambda nm: rank1_ceiling(last[nm])),
            "simaou": [_stats(simaou(a, b, c)) for a, b, c in zip(h_ctx, h_0, h_ft)],
            "simaou_random": [
                _stats(simaou(a, b, b + torch.randn(b.shape, generator=g, dtype=b.dtype))) for a, b in zip(h_ctx, h_0)
            ],
            "loss_mean": ft.losses.mean(0).tolist(),
        }
    out["heldout_mse"] = {k: float(((v.reshape(n_tasks, n_queries) - y_q) ** 2).mean()) for k, v in preds.items()}
    out["token_patch_max_abs_vs_context"] = float((preds["token_patch_each_query"] - preds["with_context"]).abs().max())
    return out


def _band(rows: list[dict]) -> tuple[list[float], list[float], list[float]]:
    return [r["mean"] for r in rows], [r["lo"] for r in rows], [r["hi"] for r in rows]


REDUCED = {"n_tasks": 12}  # reproduce's default run (--full: 32 tasks)


def finetune_section(out: Path, n_tasks: int = 32, seed: int = 13, progress: bool | None = None):
    """ICL against explicit fine-tuning on the shipped softmax model, beside an untrained control."""
    trained = load_model(layer="softmax", dtype="float64")
    with torch.random.fork_rng():  # the control: the same architecture at its initialisation
        torch.manual_seed(seed)
        untrained = ICLTransformer(trained.config).to(torch.float64)
    res = {
        name: compare(m, n_tasks=n_tasks, seed=seed, progress=progress)
        for name, m in progress_bar([("trained", trained), ("untrained", untrained)], progress, desc="icl vs finetune")
    }
    t, u = res["trained"]["optimizers"], res["untrained"]["optimizers"]
    n_layers, steps = trained.config.n_layers, res["trained"]["steps"]
    cols = [
        ("SGD", t["sgd"]["alignment"]),
        ("Adam", t["adam"]["alignment"]),
        ("Adam vs mean patch", t["adam"]["mean_patch_alignment"]),
        ("Adam vs other task", t["adam"]["other_task_alignment"]),
        ("random rank-1", t["adam"]["random_alignment"]),
        ("rank-1 ceiling (Adam)", t["adam"]["rank1_ceiling"]),
        ("untrained: SGD", u["sgd"]["alignment"]),
        ("untrained: Adam", u["adam"]["alignment"]),
    ]
    table = ["| layer | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    table += [f"| L{i} | " + " | ".join(f"{rows[i]['mean']:+.3f}" for _, rows in cols) + " |" for i in range(n_layers)]
    sim_cols = [
        ("trained: SGD", t["sgd"]["simaou"]),
        ("trained: Adam", t["adam"]["simaou"]),
        ("untrained: SGD", u["sgd"]["simaou"]),
        ("untrained: Adam", u["adam"]["simaou"]),
        ("random direction", t["adam"]["simaou_random"]),
    ]
    sim = ["| layer | " + " | ".join(c for c, _ in sim_cols) + " |", "|---" * (len(sim_cols) + 1) + "|"]
    sim += [
        f"| L{i} | " + " | ".join(f"{rows[i]['mean']:+.3f}" for _, rows in sim_cols) + " |" for i in range(n_layers)
    ]
    mse_t, mse_u = res["trained"]["heldout_mse"], res["untrained"]["heldout_mse"]
    mse = ["| predictor | trained model | untrained model |", "|---|---|---|"]
    mse += [f"| {label} | {mse_t[k]:.4f} | {mse_u[k]:.4f} |" for k, label in PREDICTORS.items()]
    best = max(range(n_layers), key=lambda i: t["adam"]["alignment"][i]["mean"])
    fig1 = plots.per_layer(
        {
            "cos(dW_ICL, dW_FT), fc_in, after all the context": {
                "trained, SGD": _band(t["sgd"]["alignment"]),
                "trained, Adam": _band(t["adam"]["alignment"]),
                "trained, Adam vs mean patch": _band(t["adam"]["mean_patch_alignment"]),
                "untrained, SGD": _band(u["sgd"]["alignment"]),
                "untrained, Adam": _band(u["adam"]["alignment"]),
                "random rank-1 vs Adam": _band(t["adam"]["random_alignment"]),
            },
            "SimAOU: cos(h_C - h_0, h_FT - h_0), layer outputs, held-out queries": {
                "trained, SGD": _band(t["sgd"]["simaou"]),
                "trained, Adam": _band(t["adam"]["simaou"]),
                "untrained, SGD": _band(u["sgd"]["simaou"]),
                "untrained, Adam": _band(u["adam"]["simaou"]),
                "random direction": _band(t["adam"]["simaou_random"]),
            },
        },
        out / "finetune_alignment.png",
        f"In-context update vs fine-tuning ({steps} steps), mean over {n_tasks} tasks, 95% intervals",
        colours=COLOURS,
    )
    layer0 = lambda by: ([int(k) for k in by], [rows[0]["mean"] for rows in by.values()])  # noqa: E731
    runs = {f"{m}, {'SGD' if o == 'sgd' else 'Adam'}": res[m]["optimizers"][o] for m in res for o in OPTIMIZERS}
    by = lambda key: {
        **{k: layer0(r[key]) for k, r in runs.items()},  # noqa: E731
        "random rank-1 vs trained Adam": layer0(t["adam"]["random_" + key]),
    }
    fig2 = plots.curves(
        {
            "layer 0: against fine-tuning steps": {
                "x": "step",
                "y": "cosine",
                "logx": True,
                "lines": by("alignment_by_step"),
            },
            "layer 0: against examples (ICL prefix = FT set)": {
                "x": "examples n",
                "y": "cosine",
                "logx": True,
                "lines": by("alignment_by_examples"),
            },
            "fine-tuning loss (mean over tasks)": {
                "x": "step",
                "y": "training MSE",
                "logy": True,
                "lines": {k: (list(range(steps + 1)), r["loss_mean"]) for k, r in runs.items()},
            },
        },
        out / "finetune_curves.png",
        "In-context update vs fine-tuning: steps, examples, loss",
        colours=COLOURS,
    )
    lr = {o: t[o]["lr"] for o in t}
    body = [
        f"For {n_tasks} fresh tasks, each task's {task_of(trained).n_context} "
        "context examples `(x_i, y_i)` become no-context training points (the query token `[x_i; 0]`, target `y_i`), and "
        f"every layer's `fc_in` is fine-tuned on them at once ({steps} full-batch steps of SGD, lr {lr['sgd']:g}, or Adam, "
        f"lr {lr['adam']:g}; `tp.finetune`). Per layer, the cosine (normalised Frobenius inner product) between the token "
        "patch `dW_ICL` of the whole context and the update `dW_FT`, mean over tasks, beside: the mean token patch over "
        f"{res['trained']['n_queries']} held-out queries, another task's update (`dW_ICL` of task b against `dW_FT` of task "
        "b - 1), random rank-1 directions, the largest cosine any rank-1 matrix can reach with `dW_FT` (`s_1 / |dW_FT|_F`), "
        "and the same measurements on an untrained model of the same shape (the control of Deutch et al., 2024).",
        "",
        *table,
        "",
        f"The trained model's largest alignment is at L{best} with Adam ({t['adam']['alignment'][best]['mean']:+.3f}; "
        f"{t['adam']['mean_patch_alignment'][best]['mean']:+.3f} for the mean patch), against "
        f"{t['adam']['other_task_alignment'][best]['mean']:+.3f} for another task, "
        f"{t['adam']['random_alignment'][best]['mean']:+.3f} for a random direction and "
        f"{u['adam']['alignment'][best]['mean']:+.3f} untrained, while a rank-1 matrix could reach "
        f"{t['adam']['rank1_ceiling'][best]['mean']:.2f}"
        + (
            ": in weight space the implicit update is nearly orthogonal to explicit fine-tuning, as measured here."
            if t["adam"]["alignment"][best]["mean"] < 0.25 * t["adam"]["rank1_ceiling"][best]["mean"]
            else "."
        ),
        "",
        f"![alignment per layer]({fig1.name})",
        "",
        "SimAOU (Dai et al., 2023) on each layer's output at held-out queries: the cosine between what the context changes "
        "and what fine-tuning changes (`h_C - h_0` against `h_FT - h_0`); the untrained model is the control.",
        "",
        *sim,
        "",
        "Held-out queries (MSE; the exact token patch of each query reproduces the context to "
        f"{res['trained']['token_patch_max_abs_vs_context']:.1e}; a token patch made for the task's own query is query-"
        "specific and does not transfer):",
        "",
        *mse,
        "",
        f"![curves]({fig2.name})",
    ]
    return Section(
        "finetune", "In-context learning against explicit fine-tuning", "\n".join(body), [fig1.name, fig2.name], res
    )
