"""The report's thought-patch section (``docs/thought-patches.md``): how well one static patch
stands in for a prompt on queries it has never seen, on the shipped model."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import torch

from tokenpatch.dynamics.diagnostics import cosine
from tokenpatch.dynamics.finetuning import finetune
from tokenpatch.errors import InputError
from tokenpatch.models.icl import load_model
from tokenpatch.patching import token_patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import functional_call
from tokenpatch.tasks.linreg import query_tokens, task_of, training_points
from tokenpatch.thought.distillation import distill
from tokenpatch.thought.front import ThoughtWarning, evaluate_thought_patch, thought_patch
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.section import Section

__all__ = ["thought_section"]

SIZES = (16, 32, 64, 128, 256, 512, 1024, 4096)  # calibration queries m (past both thresholds at 1024)
REDUCED = {
    "n_prompts": 4,
    "n_test": 500,
    "sizes": SIZES[:-1],
    "n_gradient": 1,
}  # reproduce's default run (--full: the defaults)
RIDGES = (0.0, 1e-6, 1e-4, 1e-2, 1.0)
ABLATION_M = 1024
DISTILL_STEPS = 100
VARIANTS = {  # name -> thought_patch options
    "sequential, input + affine output (default)": {},
    "teacher-forced, input + affine output": {"mode": "teacher"},
    "sequential, input + thought vector": {"output": "vector"},
    "teacher-forced, input + thought vector": {"mode": "teacher", "output": "vector"},
    "sequential, input side only": {"output": None},
    "affine output side only": {"inputs": False},
    "thought vector only (mean shift)": {"inputs": False, "output": "vector"},
}
TRUNCATIONS = (1, 4, 16)
VARIANTS.update({f"sequential, rank {k} during the fit": {"rank": k} for k in TRUNCATIONS})


def _quiet_fit(*args, **kwargs):
    """The fit; rank-deficient systems (m below a threshold, on purpose here) are the curve's point."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThoughtWarning)
        return thought_patch(*args, **kwargs)


def _quartiles(values: list[float]) -> list[float]:
    return torch.quantile(
        torch.tensor(values, dtype=torch.float64), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    ).tolist()


def thought_section(
    out: Path,
    n_prompts: int = 8,
    n_test: int = 1000,
    seed: int = 21,
    sizes: tuple[int, ...] = SIZES,
    n_gradient: int = 2,
    progress: bool | None = None,
):
    """Generalisation against the number of calibration queries ``sizes`` (with 64, 256 and 1024) and
    the ridge, the forms of the fit side by side, and the closed form against gradient distillation
    and fine-tuning, on ``n_prompts`` prompts (the gradient baselines on the first ``n_gradient``)."""
    if not {64, 256, ABLATION_M} <= set(sizes):
        raise InputError(f"sizes must include 64, 256 and {ABLATION_M} (the text reads them), got {list(sizes)}")
    if not 1 <= n_gradient <= n_prompts:
        raise InputError(f"n_gradient must be between 1 and n_prompts = {n_prompts}, got {n_gradient}")
    model = load_model(dtype="float64")
    task = task_of(model)
    g = torch.Generator().manual_seed(seed)
    batches = [task.sample(1, g, dtype=torch.float64) for _ in range(n_prompts)]
    prompts = [b.tokens[0, :-1] for b in batches]  # [N, D+1] each: the task's examples
    tests = [query_tokens((n_test, 1), task.dim, g) for _ in prompts]  # one-token queries [n, 1, D+1]
    targets = [torch.einsum("md,d->m", t[:, 0, :-1], b.w[0])[:, None, None] for t, b in zip(tests, batches)]
    d_in, d_hidden = model.config.d_model, model.config.hidden
    residual = lambda ev, key="thought_patch": ev["mse_to_context"][key] / ev["mse_to_context"]["no_prompt"]  # noqa: E731
    refs = [evaluate_thought_patch(model, p, t, {})["with_prompt"] for p, t in zip(prompts, tests)]  # once per test set

    curve = {"m": list(sizes), "train": [], "test": []}  # per m: quartiles over prompts of the relative error
    for m in progress_bar(sizes, progress, desc="thought: calibration size"):
        train, test = [], []
        for p, t, ref in zip(prompts, tests, refs):
            cal = query_tokens((m, 1), task.dim, g)
            fit = _quiet_fit(model, p, cal, progress=False)
            train.append(residual(evaluate_thought_patch(model, p, cal, fit.patch)))
            test.append(residual(evaluate_thought_patch(model, p, t, fit.patch, reference=ref)))
        curve["train"].append(_quartiles(train))
        curve["test"].append(_quartiles(test))

    ridge_m = 256
    ridge = {"m": ridge_m, "ridge": list(RIDGES), "train": [], "test": []}
    cals = [query_tokens((ridge_m, 1), task.dim, g) for _ in prompts]
    for lam in progress_bar(RIDGES, progress, desc="thought: ridge"):
        fits = [_quiet_fit(model, p, c, ridge=lam, progress=False) for p, c in zip(prompts, cals)]
        ridge["train"].append(
            _quartiles([residual(evaluate_thought_patch(model, p, c, f.patch)) for p, c, f in zip(prompts, cals, fits)])
        )
        ridge["test"].append(
            _quartiles(
                [
                    residual(evaluate_thought_patch(model, p, t, f.patch, reference=ref))
                    for p, t, f, ref in zip(prompts, tests, fits, refs)
                ]
            )
        )

    ablation: dict[str, list[dict]] = {}
    cals = [query_tokens((ABLATION_M, 1), task.dim, g) for _ in prompts]
    defaults = []
    for name, options in progress_bar(list(VARIANTS.items()), progress, desc="thought: forms"):
        for p, c, t, y, ref in zip(prompts, cals, tests, targets, refs):
            t0 = time.perf_counter()
            fit = _quiet_fit(model, p, c, progress=False, **options)
            seconds = time.perf_counter() - t0
            extra = {}
            if not options:
                defaults.append(fit)
                extra = {f"rank {k} truncation": fit.truncate(k) for k in TRUNCATIONS}
                extra.update({"its thought vector alone": fit.vector(), "its thought matrices alone": fit.matrices()})
            ev = evaluate_thought_patch(model, p, t, {name: fit.patch, **extra}, targets=y, reference=ref)
            for key in [name, *extra]:
                ablation.setdefault(key, []).append(
                    {
                        "gap_closed": ev["gap_closed"][key],
                        "task_mse": ev["task_mse"][key],
                        **({"seconds": seconds} if key == name else {}),
                    }
                )
            if not options:
                for key, label in (("with_prompt", "with prompt"), ("no_prompt", "no prompt")):
                    ablation.setdefault(label, []).append({"task_mse": ev["task_mse"][key]})
    for p, t, y in zip(prompts, tests, targets):  # the exact, per-query token patch: the with-prompt model again
        x = torch.cat([p.expand(t.shape[0], -1, -1), t], 1)
        with torch.no_grad():
            pred = functional_call(model, token_patch(model, x), t)
        ablation.setdefault("token patch of each query (exact)", []).append(
            {"task_mse": float(((pred - y) ** 2).mean())}
        )

    k = n_gradient
    baseline = _baselines(model, prompts[:k], cals[:k], tests[:k], defaults[:k], batches[:k], progress)
    data = {
        "n_prompts": n_prompts,
        "n_gradient": n_gradient,
        "n_test": n_test,
        "seed": seed,
        "d_in": d_in,
        "d_hidden": d_hidden,
        "curve": curve,
        "ridge": ridge,
        "ablation_m": ABLATION_M,
        "ablation": {_slug(k): _summary(v) for k, v in ablation.items()},
        "labels": {_slug(k): k for k in [*ablation, *baseline["rows"]]},
        "gradient_baseline": {**baseline, "rows": {_slug(k): v for k, v in baseline["rows"].items()}},
    }
    return Section("thought", "Thought patches: one static update for a whole prompt", *_write(out, data), data)


def _slug(label: str) -> str:
    """A table label as a results.json key: ``"rank 4 truncation"`` -> ``"rank_4_truncation"``."""
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def _summary(rows: list[dict]) -> dict:
    keys = rows[0].keys()
    return {k: _quartiles([r[k] for r in rows]) for k in keys}


def _baselines(model, prompts, cals, tests, fits, batches, progress) -> dict:
    """Closed form against context distillation (Adam on the same parameters, full rank and rank 8,
    from zero and from the closed form), and the thought patch's alignment with fine-tuning."""
    rows = {}
    for key, options in progress_bar(
        [
            ("distilled, full matrices", {}),
            ("distilled, rank 8", {"rank": 8}),
            ("closed form + 50 Adam steps", {"steps": 50, "lr": 1e-5, "init": True}),
        ],
        progress,
        desc="thought: gradient baselines",
    ):
        for p, c, t, fit in zip(prompts, cals, tests, fits):
            kw = {"steps": DISTILL_STEPS, "lr": 1e-3, **options}
            kw["init"] = fit if kw.get("init") else None
            d = distill(model, p, c, list(fit.patch), progress=False, **kw)
            ev = evaluate_thought_patch(model, p, t, d.patch)
            rows.setdefault(key, []).append(
                {
                    "seconds": d.seconds,
                    "gap_closed": ev["gap_closed"]["thought_patch"],
                    "calibration_mse": float(d.losses[-1]),
                    "losses": d.losses.tolist(),
                }
            )
    for p, c, t, _ in zip(prompts, cals, tests, fits):
        t0 = time.perf_counter()
        again = _quiet_fit(model, p, c, progress=False)
        seconds = time.perf_counter() - t0
        ev = evaluate_thought_patch(model, p, t, again.patch)
        cal_mse = evaluate_thought_patch(model, p, c, again.patch)["mse_to_context"]["thought_patch"]
        rows.setdefault("closed form", []).append(
            {"seconds": seconds, "gap_closed": ev["gap_closed"]["thought_patch"], "calibration_mse": cal_mse}
        )
    names = [n for n in fits[0].patch if n.endswith("fc_in.weight")]
    align = []
    for b, fit in zip(batches, fits):
        ft = finetune(model, *training_points(b), optimizer="adam", steps=64, progress=False).at()
        align.append([float(cosine(fit.patch[n].index((0, 0)), ft[n][0])) for n in names])
    return {"rows": rows, "finetune_alignment_fc_in": align}


def _prompts(n: int) -> str:
    return "one prompt" if n == 1 else f"{n} prompts"


def _reading(ab: dict) -> str:
    """What the ablation table says, from its medians."""
    gap = lambda name: ab[_slug(name)]["gap_closed"][1]  # noqa: E731
    default, teacher = gap("sequential, input + affine output (default)"), gap("teacher-forced, input + affine output")
    ranks = ", ".join(
        f"rank {k}: {gap(f'sequential, rank {k} during the fit'):.3f} during the fit, "
        f"{gap(f'rank {k} truncation'):.3f} cut afterwards"
        for k in TRUNCATIONS
    )
    return (
        f"The affine output side is what closes the gap: the default closes {default:.4f} of it, the affine output "
        f"side alone {gap('affine output side only'):.4f}, while a thought vector (a constant shift) alone closes "
        f"{gap('thought vector only (mean shift)'):.3f} and the input side with one "
        f"{gap('sequential, input + thought vector'):.3f}. Sequential against teacher-forced: {default:.4f} against "
        f"{teacher:.4f} with the affine output side, {gap('sequential, input + thought vector'):.3f} against "
        f"{gap('teacher-forced, input + thought vector'):.3f} with a thought vector: the teacher-forced fits above "
        f"layer 0 see states the patched model does not produce. Small patches: {ranks}; the layers above must fit "
        "on top of the truncated update, so truncating after the fit is not a substitute."
    )


def _write(out: Path, data: dict) -> tuple[str, str, list[str]]:
    """(markdown, figures) of the section."""
    c, r = data["curve"], data["ridge"]
    fig1 = plots.thought_curves(
        c,
        r,
        data["d_in"],
        data["d_hidden"],
        out / "thought_generalisation.png",
        f"Thought patch on {data['n_prompts']} prompts: error relative to dropping the prompt",
    )
    rows = ["| form of the fit | gap closed (median [25%, 75%]) | task MSE (median) | fit time |", "|---|---|---|---|"]
    order = [_slug(k) for k in ("with prompt", "no prompt", "token patch of each query (exact)")]
    for key, s in sorted(data["ablation"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 3):
        name = data["labels"][key]
        gap = s.get("gap_closed")
        gap_text = f"{gap[1]:.4f} [{gap[0]:.4f}, {gap[2]:.4f}]" if gap else "-"
        secs = f"{s['seconds'][1]:.2f} s" if "seconds" in s else "-"
        rows.append(f"| {name} | {gap_text} | {s['task_mse'][1]:.4f} | {secs} |")
    base = data["gradient_baseline"]["rows"]
    brow = ["| method | gap closed | calibration MSE to the with-prompt output | wall time |", "|---|---|---|---|"]
    for key, rs in base.items():
        brow.append(
            f"| {data['labels'][key]} | "
            + ", ".join(f"{x['gap_closed']:.5f}" for x in rs)
            + " | "
            + ", ".join(f"{x['calibration_mse']:.2e}" for x in rs)
            + " | "
            + ", ".join(f"{x['seconds']:.2f} s" for x in rs)
            + " |"
        )
    speed = min(x["seconds"] for x in base["distilled_full_matrices"]) / max(x["seconds"] for x in base["closed_form"])
    lines = {
        f"{data['labels'][k]}, prompt {j}": (list(range(len(x["losses"]))), x["losses"])
        for k, rs in base.items()
        if k != "closed_form"
        for j, x in enumerate(rs)
    }
    steps = max(len(xs) for xs, _ in lines.values()) - 1
    lines.update(
        {
            f"closed form, prompt {j}": ([0, steps], [x["calibration_mse"]] * 2)
            for j, x in enumerate(base["closed_form"])
        }
    )
    fig2 = plots.curves(
        {
            "Adam on the calibration queries, beside the closed form (flat lines)": {
                "x": "step",
                "y": "calibration MSE to the with-prompt output",
                "logy": True,
                "lines": lines,
            }
        },
        out / "thought_distillation.png",
        "Context distillation against the closed-form fit",
        wide=True,
    )
    align = data["gradient_baseline"]["finetune_alignment_fc_in"]
    past = ", ".join(f"m = {m}: {c['test'][c['m'].index(m)][1]:.2e}" for m in c["m"] if m >= ABLATION_M)
    body = [
        f"For {data['n_prompts']} prompts (each a task's 16 examples) of the shipped model, `tp.thought_patch` fits "
        "one static patch from m calibration queries read after the prompt; the patched model then runs "
        f"{data['n_test']} held-out queries *without* the prompt. Error: mean squared distance of its outputs to the "
        "with-prompt outputs, relative to the no-prompt model's (1 = nothing gained, 0 = the prompt fully replaced; "
        "gap closed = 1 - error). Defaults: sequential fit, input side plus affine output side, lambda = 0.",
        "",
        f"![generalisation]({fig1.name})",
        "",
        f"With m <= d_in = {data['d_in']} the input side interpolates and with m <= d_hidden + 1 = "
        f"{data['d_hidden'] + 1} the output side does: the training error is at rounding level there and the test "
        f"error peaks at the thresholds (median test error at m = 64: {c['test'][c['m'].index(64)][1]:.3g}, at m = "
        f"256: {c['test'][c['m'].index(256)][1]:.3g}); past them it falls ({past}). A ridge tames "
        f"the peak (right panel, m = {r['m']}).",
        "",
        f"The forms of the fit at m = {data['ablation_m']} (held-out queries; task MSE against the true `w.x`):",
        "",
        *rows,
        "",
        _reading(data["ablation"]),
        "",
        f"Against gradient descent on the same parameters (context distillation: Adam, full batch, {DISTILL_STEPS} steps, "
        f"matching the with-prompt outputs on the same calibration queries; {_prompts(data['n_gradient'])}):",
        "",
        *brow,
        "",
        f"The closed form is at least {speed:.0f}x faster than {DISTILL_STEPS} distillation steps here.",
        "",
        f"![distillation]({fig2.name})",
        "",
        "Cosine between the thought patch's `fc_in` update and the Adam fine-tuning update of the same matrix "
        f"on the prompt's 16 examples (as in the fine-tuning section), per layer, {_prompts(data['n_gradient'])}: "
        + "; ".join(", ".join(f"{x:+.3f}" for x in row) for row in align)
        + ".",
    ]
    return "\n".join(body), [fig1.name, fig2.name]
