"""``tokenpatch markov``: the Markov-chain workbench on the command line (``docs/markov.md``).

tokenpatch markov predictors --states 10 --alpha 1 --length 128 --chains 16 --sequences 400 --json
tokenpatch markov train --out runs/k4 --chains 4
tokenpatch markov probe --run runs/k4
tokenpatch markov report --out results-markov        # the full sweep, ~30 minutes on 2 cores
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenpatch.workbench.cli.args import Help, check_out_folder, common, count, number, usage
from tokenpatch.workbench.cli.defaults import MARKOV_MODEL, MARKOV_TASK, MARKOV_TRAIN

__all__ = ["add_parser", "check", "run"]

# What `markov train` writes in its folder besides model.safetensors (a run stopped before its first
# checkpoint leaves these alone; the rerun starts afresh and replaces them).
_RUN_FILE = re.compile(r"step-\d{7}\.safetensors|curves\.png|\..*\.tmp")


def _task_args(p, chains_default: int = 16) -> None:
    d = MARKOV_TASK
    p.add_argument("--states", type=count(2), default=d["states"], help="number of states C")
    p.add_argument("--alpha", type=number(True), default=d["alpha"], help="Dirichlet concentration of each row")
    p.add_argument("--length", type=count(2), default=d["length"], help="sequence length N")
    p.add_argument("--chains", type=count(1), default=chains_default, help="training chains K")


def add_parser(sub) -> None:
    """Register ``markov`` and its subcommands on the top-level subparsers ``sub``."""
    fmt = Help
    m = sub.add_parser(
        "markov",
        help="in-context learning of Markov chains: predictors, training, phases, probes",
        formatter_class=fmt,
        description="The Markov-chain workbench: the four ideal Bayesian predictors, "
        "small transformers trained on K chains, the phase diagram over K and training time, circuit "
        "probes, phi patching and token patches per phase (docs/markov.md).",
    )
    msub = m.add_subparsers(dest="markov_command", required=True, parser_class=type(m))

    p = msub.add_parser(
        "predictors",
        formatter_class=fmt,
        help="cross-entropy of the ideal predictors (no training)",
        description="Mean per-token cross-entropy (nats; positions 2..N; x_1 ~ pi) of uniform, 1-gen, "
        "2-gen, 1-mem, 2-mem and the true chain on S sequences from fresh chains and S from the K "
        "training chains.",
    )
    _task_args(p)
    p.add_argument("--sequences", type=count(1), default=400, help="sequences per set (S)")
    p.add_argument("--seed", type=count(0), default=0, help="seed of the training chains and of the sampling")
    p.add_argument("--rule", choices=["row", "stationary"], default="row", help="1-mem prediction rule")
    p.add_argument("--json", action="store_true", help="print JSON keyed fresh/train, then predictor")
    common(p)

    d, c = MARKOV_MODEL, MARKOV_TRAIN
    t = msub.add_parser(
        "train",
        formatter_class=fmt,
        help="train one model; phase labels at log-spaced steps",
        description="Train (or resume) a small transformer on K chains; the folder --out holds the "
        "resumable checkpoint, weights-only snapshots at every evaluation, and curves.png.",
    )
    t.add_argument("--out", required=True, help="run folder, resumed if it holds the same recipe (required)")
    _task_args(t)
    t.add_argument("--d-model", type=count(1), default=d["d_model"], help="residual stream width")
    t.add_argument("--layers", type=count(1), default=d["n_layers"], help="blocks")
    t.add_argument("--heads", type=count(1), default=d["n_heads"], help="attention heads per layer")
    t.add_argument(
        "--minimal", action="store_true", help="paper A's minimal model: one layer reading [x_n; x_{n-1}; n]"
    )
    t.add_argument("--steps", type=count(1), default=c["steps"], help="training steps")
    t.add_argument("--batch-size", type=count(1), default=c["batch_size"], help="sequences per step")
    t.add_argument("--lr", type=number(True), default=c["lr"], help="learning rate (AdamW)")
    t.add_argument("--seed", type=count(0), default=c["seed"], help="seed of the chains, the weights and the sampling")
    t.add_argument(
        "--no-resume",
        action="store_true",
        help="start afresh even if --out holds a run (its checkpoint and snapshots are replaced)",
    )
    common(t)

    r = msub.add_parser(
        "probe",
        formatter_class=fmt,
        help="circuits, phi patching and token patches of a trained run",
        description="Previous-token and statistical-induction scores, head and MLP ablation, the chain "
        "probe on phi, phi patching with controls, and the bridge to token patches, as JSON.",
    )
    r.add_argument("--run", required=True, help="run folder written by `tokenpatch markov train` (required)")
    r.add_argument("--seed", type=count(0), default=0, help="seed of the probe sequences")
    common(r)

    s = msub.add_parser(
        "report",
        formatter_class=fmt,
        help="the sweep: phase diagram, K*, tau(N), probes (report.md)",
        description="Train every (K, seed) of the sweep and the N sweep, then write report.md, "
        "markov.json and the figures to --out. Full preset: 11 K x 3 seeds and 4 N x 2 seeds "
        "(about 30 minutes on 2 cores); --reduced: 4 K, one seed (a few minutes). Finished runs "
        "under --out/markov-runs are read back, interrupted ones resume.",
    )
    s.add_argument("--out", default="results-markov", help="output folder")
    s.add_argument("--reduced", action="store_true", help="the small preset of `tokenpatch reproduce`")
    s.add_argument("--workers", type=count(1), default=2, help="runs trained in parallel (the cores shared among them)")
    common(s)


def check(args) -> None:
    """Every check of the arguments that needs no torch (``main`` runs it first)."""
    if args.markov_command == "train":
        _check_run_folder(args.out)
    elif args.markov_command == "probe" and not (Path(args.run) / "model.safetensors").exists():
        raise usage(
            f"--run {args.run} holds no Markov run (no model.safetensors); train one with `tokenpatch markov train`"
        )
    elif args.markov_command == "report":
        check_out_folder(args.out, "--out", " for the report")


def run(args) -> int:
    return {"predictors": _predictors, "train": _train, "probe": _probe, "report": _report}[args.markov_command](args)


def _predictors(args) -> int:
    import numpy as np

    from tokenpatch.interp.phases import cross_entropy, predictors
    from tokenpatch.tasks.markov import STREAMS, MarkovTask

    task = MarkovTask(states=args.states, alpha=args.alpha, length=args.length, chains=args.chains, seed=args.seed)
    rng = np.random.default_rng([args.seed, STREAMS["eval"]])
    chains = task.train_chains
    result = {}
    for which in ("fresh", "train"):
        batch = task.sample(args.sequences, rng, which, matrices=chains if which == "train" else None)
        lp = predictors(batch.states, chains, task.alpha, rule=args.rule, true_chains=batch.matrices, chain=batch.chain)
        result[which] = {name: cross_entropy(v, batch.states).mean().item() for name, v in lp.items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    names = list(result["fresh"])
    print(
        f"C={args.states} alpha={args.alpha:g} N={args.length} K={args.chains} S={args.sequences} seed={args.seed}: "
        "mean cross-entropy per token (nats)"
    )
    print(f"{'':>6} " + " ".join(f"{n:>8}" for n in names))
    for which, row in result.items():
        print(f"{which:>6} " + " ".join(f"{row[n]:8.3f}" for n in names))
    return 0


def _check_run_folder(path: str) -> Path:
    """A new or empty folder, a run to resume (``model.safetensors``), or a run interrupted before its first
    checkpoint (only its snapshots and figure: it starts afresh there); anything else is refused."""
    p = check_out_folder(path, "--out", " for the run")
    if p.is_dir() and not (p / "model.safetensors").exists():
        other = sorted(f.name for f in p.iterdir() if not _RUN_FILE.fullmatch(f.name))
        if other:
            raise usage(
                f"--out {path} holds files that are not a Markov run ({', '.join(other[:3])}"
                f"{' ...' if len(other) > 3 else ''}); give a new or empty folder (a run's folder resumes)"
            )
    return p


def _train(args) -> int:
    from tokenpatch.models.markov import MarkovModel
    from tokenpatch.tasks.markov import MarkovTask
    from tokenpatch.workbench.report.markov_figures import curves_figure
    from tokenpatch.workbench.train.markov import MarkovTrain, train_markov

    out = Path(args.out)
    task = MarkovTask(states=args.states, alpha=args.alpha, length=args.length, chains=args.chains, seed=args.seed)
    shape = MarkovModel(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, minimal=args.minimal)
    cfg = MarkovTrain(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    _, history = train_markov(out, task, shape, cfg, resume=not args.no_resume, progress=not args.quiet)
    from tokenpatch.workbench.train.markov import load_run

    refs = load_run(out)[2]["references"]
    curves_figure({f"K = {args.chains}": (history, refs)}, out / "curves.png")
    labels = [h["train"]["label"] for h in history]
    path = " -> ".join(x for i, x in enumerate(labels) if i == 0 or x != labels[i - 1])
    last = history[-1]
    print(
        f"{out}: step {last['step']}, loss {last['train']['loss']:.3f} on the training chains "
        f"({last['fresh']['loss']:.3f} on fresh chains); phases {path}; figure {out / 'curves.png'}"
    )
    print("predictors on the training chains: " + ", ".join(f"{k} {v:.3f}" for k, v in refs["train"].items()))
    return 0


def _probe(args) -> int:
    from tokenpatch.workbench.report.markov import probe_run as probe

    print(json.dumps(probe(Path(args.run), args.seed), indent=1))
    return 0


def _report(args) -> int:
    from tokenpatch.workbench.report.markov import FULL, REDUCED, markov_section

    out = Path(args.out)
    runs = out / "markov-runs"
    if runs.is_dir() and any(runs.iterdir()) and not args.quiet:
        print(
            f"resuming in {out}: the runs under {runs} are read back or resumed; report.md and markov.json are rewritten"
        )
    out.mkdir(parents=True, exist_ok=True)
    section = markov_section(out, REDUCED if args.reduced else FULL, workers=args.workers, progress=not args.quiet)
    (out / "report.md").write_text(f"# {section.title}\n\n{section.body}\n")
    (out / "markov.json").write_text(json.dumps(section.data, indent=1))
    print(f"report: {out / 'report.md'}; numbers: {out / 'markov.json'}")
    return 0
