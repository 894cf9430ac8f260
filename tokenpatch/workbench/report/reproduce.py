"""The main job: ``tokenpatch reproduce`` -> ``results/report.md``, PNG figures, ``results.json``.

Each capability contributes a ``Section`` (markdown, figures, and the numbers behind them);
``reproduce`` runs them on the shipped checkpoint (or another) and writes everything out. Each finished
section is kept in ``out/sections/KEY.json`` with what it was run with, so an interrupted run resumes:
a rerun reads back the sections whose inputs match instead of running them again.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import platform
import time
from pathlib import Path

import torch

from tokenpatch import __version__
from tokenpatch.errors import InputError
from tokenpatch.files import fingerprint
from tokenpatch.models.icl import ICLTransformer, load_model
from tokenpatch.patching import token_patch
from tokenpatch.progress import progress_bar
from tokenpatch.tasks.linreg import evaluate, task_of
from tokenpatch.verify import TOLERANCES, verify
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.compress import REDUCED as COMPRESSION_REDUCED
from tokenpatch.workbench.report.compress import compression_section
from tokenpatch.workbench.report.dynamics import dynamics_section
from tokenpatch.workbench.report.finetune import REDUCED as FINETUNE_REDUCED
from tokenpatch.workbench.report.finetune import finetune_section
from tokenpatch.workbench.report.induction import induction_section
from tokenpatch.workbench.report.markov import markov_section
from tokenpatch.workbench.report.online import online_section
from tokenpatch.workbench.report.real_models import real_models_section
from tokenpatch.workbench.report.recurrence import recurrence_section
from tokenpatch.workbench.report.section import Section, code_digest, read_part, write_part
from tokenpatch.workbench.report.thought import REDUCED as THOUGHT_REDUCED
from tokenpatch.workbench.report.thought import thought_section

__all__ = ["Section", "equivalence_section", "model_section", "reproduce"]

log = logging.getLogger(__name__)

F32_REL_TOL = TOLERANCES["float32"][1]  # max relative error (the library's one rule, verify.TOLERANCES)
F64_ABS_TOL = TOLERANCES["float64"][1]  # max absolute error


def _verify_rows(v) -> list[tuple[str, float, float]]:
    return [(e.name, e.max_abs, e.max_rel) for e in v.per_layer]


def equivalence_section(
    model: ICLTransformer, out: Path, n_tasks: int = 256, seed: int = 2026, progress: bool | None = None
) -> Section:
    """Patched no-context pass vs with-context pass on fresh tasks, float32 and float64, for
    the last query (the prediction) and for every position."""
    task = task_of(model)
    tokens = task.sample(n_tasks, torch.Generator().manual_seed(seed), dtype=torch.float64).tokens
    runs, patches = {}, {}
    copies = {dt: copy.deepcopy(model).to(dt) for dt in (torch.float32, torch.float64)}
    jobs = [(dt, q) for dt in copies for q in ("last", "all")]
    for dtype, query in progress_bar(jobs, progress, desc="equivalence"):
        m, x = copies[dtype], tokens.to(dtype)
        patch = token_patch(m, x, query=-1 if query == "last" else "all", progress=False)
        key = f"{str(dtype)[6:]}_{query}"
        patches[key], runs[key] = patch, verify(m, patch, x)
    last32, last64 = runs["float32_last"], runs["float64_last"]
    # for scale: the query alone without the patch (a zero patch), float32, against the same reference
    unpatched = verify(copies[torch.float32], patches["float32_last"].map(torch.zeros_like), tokens.to(torch.float32))
    lines = [
        f"{n_tasks} fresh tasks (seed {seed}) of {task.dim}-dimensional linear regression with "
        f"{task.n_context} context pairs, on the {model.config.describe()}. For each task the patch is computed from one "
        "with-context pass; the model is then run on the query token alone with the patch "
        "(`tp.functional_call`), and every layer's output hidden state and the prediction are "
        "compared with the with-context pass. Relative error: `|got - ref|_2 / max(|ref|_2, rms)` per "
        "query vector, max over tasks, where `rms` is the site's RMS vector norm (it keeps a "
        "prediction near 0 from inflating the ratio; see `tp.SiteError`).",
        "",
        "| site | float32 max abs | float32 max rel | (unfloored) | float64 max abs | float64 max rel |",
        "|---|---|---|---|---|---|",
    ]
    for e32, e64 in zip(last32.per_layer, last64.per_layer):
        lines.append(
            f"| {e32.name} | {e32.max_abs:.2e} | {e32.max_rel:.2e} | {e32.max_rel_unfloored:.2e} | "
            f"{e64.max_abs:.2e} | {e64.max_rel:.2e} |"
        )
    ok32, ok64 = last32.ok(), last64.ok()
    all32, all64 = runs["float32_all"], runs["float64_all"]
    lines += [
        "",
        f"- float32, query = last: max relative error **{last32.max_rel:.2e}** over all layers and the "
        f"prediction, {last32.max_rel_unfloored:.2e} unfloored, max absolute error {last32.max_abs:.2e} "
        f"(target <= {F32_REL_TOL:g}: {'met' if ok32 else 'NOT MET'}; the paper reports ~1e-6).",
        f"- float64, query = last: max absolute error **{last64.max_abs:.2e}** (target <= {F64_ABS_TOL:g}: "
        f"{'met' if ok64 else 'NOT MET'}).",
        f"- every position as a query ({all32.n} queries): float32 max rel {all32.max_rel:.2e} "
        f"({all32.max_rel_unfloored:.2e} unfloored: the model's outputs at context tokens, where it "
        f"predicts nothing, come near 0), float64 max abs {all64.max_abs:.2e}.",
        f"- for scale: the query alone *without* the patch is off by max rel {unpatched.max_rel:.2f} "
        f"(prediction: {unpatched.per_layer[-1].max_rel:.2f}).",
    ]
    fig = plots.layer_errors(
        {"float32": _verify_rows(last32), "float64": _verify_rows(last64)},
        out / "equivalence_layers.png",
        f"Token patch equivalence, {n_tasks} tasks, last query",
        reference=_verify_rows(unpatched),
        rel_targets={"float32": F32_REL_TOL},
        abs_targets={"float64": F64_ABS_TOL},
    )
    lines += ["", f"![error per layer]({fig.name})"]
    data = {
        "n_tasks": n_tasks,
        "seed": seed,
        "task": task.to_dict(),
        "runs": {k: v.to_dict() for k, v in runs.items()},
        "unpatched_float32_last": unpatched.to_dict(),
        "targets": {"float32_max_rel": F32_REL_TOL, "float64_max_abs": F64_ABS_TOL},
        "met": {"float32": ok32, "float64": ok64},
    }
    return Section("equivalence", "Context is a weight update: exact equivalence", "\n".join(lines), [fig.name], data)


def model_section(model: ICLTransformer, out: Path, n_tasks: int = 4096, seed: int = 7) -> Section:
    """In-context MSE of the model on fresh tasks beside the zero, least-squares and ridge predictors."""
    task = task_of(model)
    res = evaluate(model, task, n_tasks=n_tasks, seed=seed)
    c = model.config
    lines = [
        f"{c.describe()}, d_model {c.d_model}, "
        f"{c.n_heads} heads, MLP width {c.hidden}, {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"task: D = {task.dim}, {task.n_context} context pairs, noise {task.noise}. MSE on {n_tasks} fresh tasks:",
        "",
        "| predictor | MSE | / zero predictor |",
        "|---|---|---|",
    ]
    for name, key in [
        ("this model", "mse_model"),
        ("zero", "mse_zero"),
        ("least squares", "mse_least_squares"),
        (f"ridge (lambda = {res['ridge_lambda']:g})", "mse_ridge"),
    ]:
        lines.append(f"| {name} | {res[key]:.4f} | {res[key] / res['mse_zero']:.3f} |")
    lines += [
        "",
        f"In-context MSE is {100 * res['ratio_zero']:.1f}% of the zero predictor's "
        f"(target <= 20%: {'met' if res['ratio_zero'] <= 0.2 else 'NOT MET'}).",
    ]
    figures = []
    history = model.meta.get("history")
    if history:
        fig = plots.training_curve(
            history,
            res["mse_zero"],
            out / "training_curve.png",
            "Training (tokenpatch train)",
            least_squares_mse=res["mse_least_squares"],
            model_mse=res["mse_model"],
        )
        figures.append(fig.name)
        lines += ["", f"![training curve]({fig.name})"]
        seconds = model.meta.get("seconds_last_session")
        if seconds:
            lines.append(
                f"\nTrained for {model.meta.get('step')} steps. The last `tokenpatch train` session took "
                f"{seconds / 60:.1f} minutes (training resumes after an interruption, and the checkpoint "
                "records only the last session's time, so the whole training can have taken longer)."
            )
    return Section("model", "The model: in-context linear regression", "\n".join(lines), figures, {"eval": res})


# The sections in report order: key -> function(out, progress=...) -> Section. The first two read the
# checkpoint (``reproduce`` passes it); the others run on the shipped models and the real ones.
SECTIONS = (
    "equivalence",
    "model",
    "dynamics",
    "recurrence",
    "finetune",
    "online",
    "thought",
    "real_models",
    "prompt_compression",
    "markov",
    "induction",
)
CHECKPOINT_SECTIONS = ("equivalence", "model")


FULL_SECTIONS = (
    "recurrence",
    "finetune",
    "thought",
    "prompt_compression",
    "markov",
    "induction",
)  # the sections --full changes


def _default_builders(model, n_tasks: int, seed: int, full: bool = False) -> dict:
    return {
        "equivalence": lambda out, progress: equivalence_section(
            model, out, n_tasks=n_tasks, seed=seed, progress=progress
        ),
        "model": lambda out, progress: model_section(model, out),
        "dynamics": dynamics_section,
        # transformers' mixers: the shipped models, or trained here (full); a one-line note without transformers
        "recurrence": functools.partial(recurrence_section, full=True) if full else recurrence_section,
        "finetune": finetune_section if full else functools.partial(finetune_section, **FINETUNE_REDUCED),
        "online": online_section,
        # four prompts and m up to 1024 (THOUGHT_REDUCED), or eight and m up to 4096 (full)
        "thought": thought_section if full else functools.partial(thought_section, **THOUGHT_REDUCED),
        "real_models": real_models_section,  # a one-line note without the models
        # likewise; the ridge given and fewer prompts for the head effects and the timing (COMPRESSION_REDUCED)
        "prompt_compression": compression_section
        if full
        else functools.partial(compression_section, **COMPRESSION_REDUCED),
        # the reduced sweep (markov.REDUCED) and the small LM: shipped trained, or trained here (full)
        "markov": functools.partial(markov_section, shipped=False) if full else markov_section,
        "induction": functools.partial(induction_section, shipped=False) if full else induction_section,
    }


def reproduce(
    out: str | Path = "results",
    checkpoint: str | Path | None = None,
    n_tasks: int = 256,
    seed: int = 2026,
    progress: bool | None = None,
    sections=None,
    full: bool = False,
) -> Path:
    """Run the report's sections on the shipped (or given) checkpoint; write ``report.md``,
    the PNG figures and ``results.json`` (the numbers of every figure and table) to ``out``.

    ``sections``: which sections run, in report order (``SECTIONS``): ``None`` for all of them (only
    ``equivalence`` and ``model`` with a ``checkpoint``); a list of keys; or a dict ``key ->
    function(out, progress=...)`` whose functions replace the default of their key (``None`` keeps it),
    e.g. ``{"markov": functools.partial(markov_section, preset=small)}`` for a shorter run. ``full``: train
    the Markov sweep, the small LM and the models with transformers' mixers here instead of reading the runs shipped with tokenpatch, compare
    in-context learning with fine-tuning on 32 tasks (the default: 12) and fit the thought patches of
    eight prompts up to m = 4096 calibration queries on 1000 test queries, distilled on two (the default:
    four, up to 1024, on 500, distilled on one), and choose the compressed prompt's ridge on dev (the default: given) with the
    function vector's head effects on every calibration prompt (the default: 16).

    Each section is kept in ``out/sections/KEY.json`` as it finishes, with what it ran with (the
    tokenpatch and torch versions, the checkpoint's weights for ``equivalence`` and ``model``, ``n_tasks``
    and ``seed`` for ``equivalence``, the function given for its key: its name, a partial's arguments,
    what it closes over). A rerun reads back every section whose record matches and whose figures are
    still in ``out`` (one log line names them) and runs the others: an interrupted run resumes. A
    section given as a lambda always runs; delete a section's file to run it again."""
    out = Path(out)
    if sections is None:
        sections = CHECKPOINT_SECTIONS if checkpoint is not None else SECTIONS
    chosen = dict(sections) if isinstance(sections, dict) else dict.fromkeys(sections)
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise InputError(f"unknown report sections {unknown}; the sections are {list(SECTIONS)}")
    if checkpoint is not None and set(chosen) - set(CHECKPOINT_SECTIONS):
        raise InputError(f"with a checkpoint only {list(CHECKPOINT_SECTIONS)} run (the others use the shipped models)")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = load_model(checkpoint) if set(chosen) & set(CHECKPOINT_SECTIONS) else None
    builders = _default_builders(model, n_tasks, seed, full)
    common = {"tokenpatch": __version__, "code": code_digest(), "torch": torch.__version__}
    if model is not None:
        common.update(checkpoint=str(checkpoint) if checkpoint else "shipped", weights=fingerprint(model))
    plan = {}  # key -> (function, inputs, record path, saved record or None)
    for key in (k for k in SECTIONS if k in chosen):
        inputs = {**common, "section": key, "builder": _describe(chosen[key]) if chosen[key] else "default"}
        if key == "equivalence":
            inputs.update(n_tasks=n_tasks, seed=seed)
        if key in FULL_SECTIONS and chosen[key] is None:
            inputs.update(full=full)  # the reduced run or the full one
        path = out / "sections" / f"{key}.json"
        saved = read_part(path, inputs) if inputs["builder"] is not None else None
        if saved is not None and not all((out / f).exists() for f in saved["section"]["figures"]):
            saved = None  # a figure is gone: run it again
        plan[key] = (chosen[key] or builders[key], inputs, path, saved)
    read_back = [k for k, (*_, saved) in plan.items() if saved is not None]
    if read_back:
        log.info(
            "read back %d finished section%s from %s (run earlier with the same inputs): %s; delete a file "
            "there to run its section again",
            len(read_back),
            "s" * (len(read_back) > 1),
            out / "sections",
            ", ".join(read_back),
        )
    sections, earlier, took = [], 0.0, []  # took: each section's seconds (read back: its first run's)
    for build, inputs, path, saved in plan.values():
        if saved is not None:
            sections.append(Section(**saved["section"]))
            earlier += saved["seconds"]
            took.append(saved["seconds"])
            continue
        t1 = time.perf_counter()
        s = build(out, progress=progress)
        sections.append(s)
        took.append(time.perf_counter() - t1)
        record = {"key": s.key, "title": s.title, "body": s.body, "figures": s.figures, "data": s.data}
        write_part(path, inputs, {"section": record, "seconds": took[-1]})
    seconds = time.perf_counter() - t0 + earlier
    threads = torch.get_num_threads()
    source = "the shipped checkpoint" if checkpoint is None else f"`{checkpoint}`"
    resumed = (
        f" Sections {', '.join(read_back)} were read back from an earlier run with the same inputs "
        f"(`{out.name}/sections/`)."
        if read_back
        else ""
    )
    header = [
        "# tokenpatch report",
        "",
        f"Written by `tokenpatch reproduce` from {source}; tokenpatch {__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {threads} thread{'' if threads == 1 else 's'}, {seconds:.1f} s.{resumed}",
        "",
    ]
    header += (
        ["| section | seconds |", "|---|---:|"] + [f"| {s.key} | {t:.1f} |" for s, t in zip(sections, took)] + [""]
    )
    body = header + [f"## {i}. {s.title}\n\n{s.body}\n" for i, s in enumerate(sections, 1)]
    (out / "report.md").write_text("\n".join(body))
    data = {
        "tokenpatch": __version__,
        "torch": torch.__version__,
        "checkpoint": str(checkpoint) if checkpoint else "shipped",
        "seconds": seconds,
        "section_seconds": {s.key: t for s, t in zip(sections, took)},
        "sections": {s.key: {"title": s.title, "figures": s.figures, **s.data} for s in sections},
    }
    (out / "results.json").write_text(json.dumps(data, indent=1))
    log.info("wrote %s", out / "report.md")
    return out / "report.md"


def _describe(build) -> str | None:
    """A section function given to ``reproduce``, in words that are the same on a rerun only if it would
    compute the same: its module and name, and the values it is given (a ``functools.partial``'s
    arguments, its defaults, what it closes over). None where no such words exist (a lambda, a value
    shown by its address): that section always runs."""
    args, keywords = (), {}
    while isinstance(build, functools.partial):
        args, keywords = build.args + args, {**build.keywords, **keywords}
        build = build.func
    name = getattr(build, "__qualname__", type(build).__qualname__)
    cells = [c.cell_contents for c in getattr(build, "__closure__", None) or ()]
    given = (args, dict(sorted(keywords.items())), getattr(build, "__defaults__", None), cells)
    text = f"{getattr(build, '__module__', '?')}.{name}{given!r}"
    return None if "<lambda>" in name or " at 0x" in text or "object at" in text else text
