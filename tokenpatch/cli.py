"""Command line: ``tokenpatch train | verify | reproduce`` (``tokenpatch <command> --help``)."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys

import torch

from . import __version__

log = logging.getLogger("tokenpatch")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or log lines")


def _parser() -> argparse.ArgumentParser:
    from .train import DEFAULT_MODEL, DEFAULT_TASK, DEFAULT_TRAIN

    parser = argparse.ArgumentParser(prog="tokenpatch", description="Context is a weight update: exact token patches.")
    parser.add_argument("--version", action="version", version=f"tokenpatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train an ICL transformer on in-context linear regression",
                       description="Train (or resume) an ICLTransformer. The defaults are the recipe of the shipped checkpoint.")
    t.add_argument("--out", default="runs/linreg-pre10.safetensors", help="checkpoint path (resumed if it exists)")
    t.add_argument("--export", default=None, help="also write a weights-only copy here when done (the shipped file is one)")
    t.add_argument("--no-resume", action="store_true", help="start afresh even if --out exists (overwrites it)")
    t.add_argument("--dim", type=int, default=DEFAULT_TASK.dim, help="task dimension D")
    t.add_argument("--context", type=int, default=DEFAULT_TASK.n_context, help="context pairs per task")
    t.add_argument("--noise", type=float, default=DEFAULT_TASK.noise, help="label noise std")
    t.add_argument("--layers", type=int, default=DEFAULT_MODEL.n_layers)
    t.add_argument("--d-model", type=int, default=DEFAULT_MODEL.d_model)
    t.add_argument("--heads", type=int, default=DEFAULT_MODEL.n_heads)
    t.add_argument("--layer", default=DEFAULT_MODEL.layer, help="softmax | linear | rnn | gru | lstm")
    t.add_argument("--norm", default=DEFAULT_MODEL.norm, help="none | pre | post")
    t.add_argument("--no-residual", action="store_true")
    t.add_argument("--steps", type=int, default=DEFAULT_TRAIN.steps)
    t.add_argument("--batch-size", type=int, default=DEFAULT_TRAIN.batch_size)
    t.add_argument("--lr", type=float, default=DEFAULT_TRAIN.lr)
    t.add_argument("--seed", type=int, default=DEFAULT_TRAIN.seed)
    t.add_argument("--checkpoint-every", type=int, default=DEFAULT_TRAIN.checkpoint_every)
    _add_common(t)

    v = sub.add_parser("verify", help="per-layer equivalence errors of token patches on a checkpoint",
                       description="Patch every layer for fresh tasks, run the model on the query alone with the patch, "
                                   "and print the error per layer against the with-context pass. Exit status 1 if the "
                                   "tolerance (float32: max rel 1e-4; float64: max abs 1e-10) is not met.")
    v.add_argument("--checkpoint", default=None, help="model file (default: the shipped checkpoint)")
    v.add_argument("--tasks", type=int, default=256, help="fresh tasks (batch size)")
    v.add_argument("--seed", type=int, default=2026)
    v.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    v.add_argument("--query", choices=["last", "all"], default="last", help="the prediction only, or every position")
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_common(v)

    r = sub.add_parser("reproduce", help="run the paper experiments; write results/report.md, figures, JSON",
                       description="Run every section of the report on the shipped checkpoint (minutes on a 2-core CPU).")
    r.add_argument("--out", default="results", help="output folder (default: results/)")
    r.add_argument("--checkpoint", default=None, help="model file (default: the shipped checkpoint)")
    r.add_argument("--tasks", type=int, default=256, help="fresh tasks for the equivalence section")
    r.add_argument("--seed", type=int, default=2026)
    _add_common(r)
    return parser


def _train(args) -> int:
    from .models import ICLConfig, read_checkpoint, save_model
    from .tasks.linreg import LinRegTask
    from .train import TrainConfig, train

    task = LinRegTask(dim=args.dim, n_context=args.context, noise=args.noise)
    model_config = ICLConfig(d_in=task.d_in, d_out=1, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                             layer=args.layer, norm=args.norm, residual=not args.no_residual)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      checkpoint_every=args.checkpoint_every)
    train(args.out, model_config, task, cfg, resume=not args.no_resume, progress=not args.quiet)
    model, doc, _ = read_checkpoint(args.out)
    ev = doc["meta"]["eval"]
    print(f"{args.out}: in-context MSE {ev['mse_model']:.4f} = {100 * ev['ratio_zero']:.1f}% of the zero predictor "
          f"({ev['mse_zero']:.4f}); least squares {ev['mse_least_squares']:.4f}, ridge {ev['mse_ridge']:.4f}")
    if args.export:
        save_model(model, args.export, meta=doc["meta"])
        print(f"weights-only copy: {args.export}")
    return 0


def _verify(args) -> int:
    from .models import load_model
    from .patching import token_patch, verify
    from .report import meets_target, task_of

    dtype = getattr(torch, args.dtype)
    model = load_model(args.checkpoint)
    task = task_of(model)
    model = copy.deepcopy(model).to(dtype)
    tokens = task.sample(args.tasks, torch.Generator().manual_seed(args.seed), dtype=dtype).tokens
    patch = token_patch(model, tokens, query=-1 if args.query == "last" else "all", progress=not args.quiet)
    result = verify(model, tokens, patch)
    ok, tol = meets_target(result)
    if args.json:
        print(json.dumps({"checkpoint": args.checkpoint or "shipped", "tolerance": tol, "ok": ok, **result.to_dict()}, indent=1))
    else:
        c = model.config
        print(f"{args.checkpoint or 'shipped checkpoint'}: {c.describe()}, {args.dtype}, "
              f"{args.tasks} tasks, query {args.query} ({result.n} patches)")
        print(result.table())
        print(f"max abs {result.max_abs:.2e}, max rel {result.max_rel:.2e}: {'OK' if ok else 'FAILED'} ({tol})")
    return 0 if ok else 1


def _reproduce(args) -> int:
    from .report import reproduce

    path = reproduce(args.out, checkpoint=args.checkpoint, n_tasks=args.tasks, seed=args.seed, progress=not args.quiet)
    print(f"report: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"train": _train, "verify": _verify, "reproduce": _reproduce}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
