"""``tokenpatch icl-sgd``: in-context learning against explicit gradients on a real language model
(``docs/dynamics.md`` section 7).

tokenpatch icl-sgd --model smollm2-135m --out results/icl-sgd --threads 2
"""

from __future__ import annotations

from pathlib import Path

from tokenpatch.workbench.cli.args import Help, check_out_file, check_out_folder, common, count, usage
from tokenpatch.workbench.zoo.pretrained import pretrained_names

__all__ = ["add_parser", "check", "run"]


def add_parser(sub) -> None:
    """Register ``icl-sgd`` on the top-level subparsers ``sub``."""
    p = sub.add_parser(
        "icl-sgd",
        help="implicit updates of in-context learning against explicit gradients, on a real LM",
        formatter_class=Help,
        description="Word-pair prompts of five tasks (one prompt each): each demonstration's implicit "
        "step against its own gradient and against online SGD, step by step; the whole token and "
        "thought patches against full-batch SGD and Adam (cosine with its ceiling, SimAOU, accuracy); "
        "the same on a randomly initialised model of the same shape; and whether the per-layer update "
        "norms of tp.generate tell right answers from wrong ones (AUROC). Writes icl-sgd-NAME.md, "
        ".json and the figures to --out (docs/dynamics.md section 7).",
    )
    p.add_argument("--model", required=True, choices=pretrained_names(), help="the real model")
    p.add_argument("--out", default="results/icl-sgd", help="output folder")
    p.add_argument("--shots", type=count(2), default=8, help="demonstrations per prompt (the steps)")
    p.add_argument("--tests", type=count(2), default=20, help="held-out test queries per prompt")
    p.add_argument("--monitor", type=count(2), default=60, help="test queries per task for the AUROC")
    p.add_argument("--seed", type=count(0), default=0, help="seed of the task splits")
    common(p)


def outputs(args) -> dict[str, Path]:
    stem = f"icl-sgd-{args.model}"
    out = Path(args.out)
    return {
        "md": out / f"{stem}.md",
        "json": out / f"{stem}.json",
        "steps": out / f"{stem}-steps.png",
        "curves": out / f"{stem}-curves.png",
        "whole": out / f"{stem}-whole.png",
        "monitor": out / f"{stem}-monitor.png",
    }


def check(args) -> None:
    """Every check of the arguments that needs no torch (``main`` runs it first)."""
    check_out_folder(args.out, "--out", " for the results")
    for path in outputs(args).values():
        check_out_file(str(path), "--out", may_exist=False)
    if args.shots > 10:
        raise usage(f"--shots {args.shots}: at most 10 (the demonstrations of a task's split)")


def run(args) -> int:
    from tokenpatch.workbench.report.icl_sgd_page import write_report

    path = write_report(
        args.model,
        outputs(args),
        shots=args.shots,
        tests=args.tests,
        monitor=args.monitor,
        seed=args.seed,
        threads=args.threads,
        progress=not args.quiet,
    )
    print(f"report: {path}")
    return 0
