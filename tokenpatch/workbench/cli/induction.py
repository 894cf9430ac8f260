"""``tokenpatch induction``: induction-head measurements on the command line (``docs/induction.md``).

tokenpatch induction scores --model smollm2-135m --length 50 --sequences 20 --seed 0 --json
tokenpatch induction scores --model runs/lm.safetensors      # a small LM of tokenpatch.models.lm
tokenpatch induction train --out runs/lm.safetensors          # train it (resumable)
tokenpatch induction report --model smollm2-135m --out results-induction
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenpatch.workbench.cli.args import (
    Help,
    check_out_file,
    check_out_folder,
    common,
    count,
    new_file,
    number,
    read_header,
    usage,
)
from tokenpatch.workbench.cli.defaults import MODEL_FORMAT
from tokenpatch.workbench.zoo.pretrained import load_pretrained, pretrained_names

__all__ = ["add_parser", "check", "run"]

LM_SHAPE = (64, 4, 1)  # d_model, layers, heads of the small LM (docs/induction.md §5)


def add_parser(sub) -> None:
    """Register ``induction`` and its subcommands on the top-level subparsers ``sub``."""
    fmt = Help
    i = sub.add_parser(
        "induction",
        help="induction-head scores of a real model or of a small LM",
        formatter_class=fmt,
        description="Induction heads and temporal order in context (docs/induction.md).",
    )
    isub = i.add_subparsers(dest="induction_command", required=True, parser_class=type(i))
    s = isub.add_parser(
        "scores",
        formatter_class=fmt,
        help="every head's induction scores on repeated random tokens",
        description="Every head's scores on [BOS, r_1..r_L, r_1..r_L] (r uniform over the vocabulary "
        "without special tokens): diagonal (mean A[q, q-L+1] over the second copy), detector "
        "(TransformerLens' induction ratio, BOS excluded), previous-token and duplicate-token; "
        "sorted by diagonal, descending.",
    )
    s.add_argument(
        "--model",
        required=True,
        help="smollm2-135m, gemma3-270m, or the path of a small LM written by tokenpatch.models.lm.train_lm (required)",
    )
    s.add_argument("--length", type=count(2), default=50, help="L, tokens per copy")
    s.add_argument("--sequences", type=count(1), default=20, help="random sequences S")
    s.add_argument("--seed", type=count(0), default=0, help="seed of the random tokens")
    s.add_argument("--top", type=count(1), default=10, help="rows printed without --json")
    s.add_argument("--json", action="store_true", help="print every head as a JSON list of objects")
    common(s)
    t = isub.add_parser(
        "train",
        formatter_class=fmt,
        help="train the small LM in which induction heads form",
        description="Train (or resume) the small LM of tokenpatch.models.lm: random tokens where a recurring "
        "token is followed, with probability --follow, by what followed it last time. Writes the "
        "checkpoint (with optimizer and sampler state) to --out; rerunning resumes bit for bit.",
    )
    t.add_argument("--out", required=True, help="checkpoint path, .safetensors (required)")
    t.add_argument("--vocab", type=count(3), default=32, help="V, BOS included")
    t.add_argument("--length", type=count(4), default=64, help="T, BOS included")
    t.add_argument("--follow", type=number(False), default=0.7, help="probability of copying the last successor")
    t.add_argument("--d-model", type=count(1), default=LM_SHAPE[0], help="width")
    t.add_argument("--layers", type=count(1), default=LM_SHAPE[1], help="blocks")
    t.add_argument("--heads", type=count(1), default=LM_SHAPE[2], help="heads per layer")
    t.add_argument("--attention-only", action="store_true", help="blocks without MLPs (no token patches)")
    t.add_argument("--steps", type=count(1), default=3000, help="training steps")
    t.add_argument("--seed", type=count(0), default=0, help="seed of the weights and the data")
    t.add_argument("--no-resume", action="store_true", help="start afresh even if --out exists")
    common(t)
    r = isub.add_parser(
        "report",
        formatter_class=fmt,
        help="lag curve, serial recall and their dose-response",
        description="The head table, the lag curve (permuted single-token nouns, the middle one "
        "repeated; token ids for a small LM), few-shot serial recall (real models), both measured "
        "with the top-n induction heads ablated against n random heads outside the top M, and each "
        "head's share of the token patches where the model copies. Writes induction-NAME.md/.json/.png "
        "to --out (about 17 minutes on 2 cores for SmolLM2, 27 for Gemma 3, seconds for a small LM).",
    )
    r.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m, or the path of a small LM (required)")
    r.add_argument("--out", default="results-induction", help="output folder")
    r.add_argument(
        "--words", type=count(3), default=None, help="items per lag prompt (n; default 100, 21 for a small LM)"
    )
    r.add_argument("--prompts", type=count(2), default=None, help="lag prompts (P; default 64, 256 for a small LM)")
    r.add_argument("--lists", type=count(2), default=20, help="serial-recall lists (real models)")
    r.add_argument(
        "--draws", type=count(1), default=None, help="random-head draws per n (default 3, 10 for a small LM)"
    )
    r.add_argument(
        "--exclude-top",
        type=count(0),
        default=None,
        help="random heads come from outside the top M (default min(50, heads / 4), 1 for a small LM)",
    )
    r.add_argument("--seed", type=count(0), default=0, help="seed of every draw")
    common(r)


def check(args) -> None:
    """Every check of the arguments that needs no torch (``main`` runs it first)."""
    if args.induction_command in ("scores", "report"):
        if args.model not in pretrained_names():
            if not Path(args.model).exists():
                raise usage(
                    f"--model {args.model!r} is neither a known model {list(pretrained_names())} nor an existing file"
                )
            read_header(args.model, MODEL_FORMAT)  # a small LM's checkpoint, by its header
    if args.induction_command == "report":
        check_out_folder(args.out, "--out", " for the report")
        for path in _outputs(args).values():  # nothing is overwritten
            check_out_file(str(path), "--out", may_exist=False)
    if args.induction_command == "train":
        out = Path(args.out)
        if out.is_dir() or out.suffix != ".safetensors":
            raise usage(f"--out {out}: give a file path ending in .safetensors")
        check_out_file(args.out, "--out", may_exist=True)  # resumed if it exists
        if not args.follow <= 1:
            raise usage(f"--follow {args.follow}: a probability, in [0, 1]")
        if args.d_model % args.heads:
            raise usage(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
        if out.exists() and not args.no_resume:
            read_header(str(out), MODEL_FORMAT)  # resumed: it must be a checkpoint


def _outputs(args) -> dict[str, Path]:
    """The report's files: ``induction-NAME.md/.json/.png`` (NAME: the model's, or a small LM file's stem)."""
    name = args.model if args.model in pretrained_names() else Path(args.model).stem
    return {k: Path(args.out) / f"induction-{name}.{k}" for k in ("md", "json", "png")}


def run(args) -> int:
    return {"scores": _scores, "train": _train, "report": _report}[args.induction_command](args)


def _model(name: str, quiet: bool):
    """``(model, inputs_of, pool, bos)`` for a real-model name or a small-LM checkpoint path."""
    if name in pretrained_names():
        from tokenpatch.workbench.report.induction import bos_and_pool

        model, tok = load_pretrained(name, progress=False if quiet else None)
        bos, pool = bos_and_pool(model, tok)
        return model, None, pool, bos
    path = Path(name)
    from tokenpatch.models.lm import lm_inputs, load_lm
    from tokenpatch.tasks.repeats import BOS

    model = load_lm(path)
    return model, (lambda ids: lm_inputs(model, ids)), range(1, model.config.d_out), BOS


def _scores(args) -> int:
    from tokenpatch.interp.induction import head_scores

    model, inputs_of, pool, bos = _model(args.model, args.quiet)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and 2 * args.length + 1 > limit:
        raise usage(f"--length {args.length}: 2L + 1 = {2 * args.length + 1} positions exceed the model's {limit}")
    rows = head_scores(
        model, length=args.length, sequences=args.sequences, seed=args.seed, pool=pool, bos=bos, inputs_of=inputs_of
    )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.model}: {len(rows)} heads, L = {args.length}, {args.sequences} sequences, seed {args.seed}")
    print("layer | head | kv group | diagonal | detector | previous-token | duplicate-token")
    for r in rows[: args.top]:
        print(
            f"{r['layer']:>5} | {r['head']:>4} | {r['kv_group']:>8} | {r['diagonal']:8.3f} | {r['detector']:8.3f} | "
            f"{r['previous_token']:14.3f} | {r['duplicate_token']:15.3f}"
        )
    return 0


def _train(args) -> int:
    from tokenpatch.models.icl import read_checkpoint
    from tokenpatch.tasks.repeats import LMData
    from tokenpatch.workbench.train.lm import LMTrain, train_lm

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = LMData(vocab=args.vocab, length=args.length, follow=args.follow)
    model = train_lm(
        out,
        data,
        LMTrain(steps=args.steps, seed=args.seed),
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        mlp=not args.attention_only,
        resume=not args.no_resume,
        progress=not args.quiet,
    )
    history = read_checkpoint(out)[1]["meta"]["history"]
    print(f"{model.config.describe()}: {out}" + (f" (loss {history[-1][1]:.3f})" if history else ""))
    return 0


def _report(args) -> int:
    from tokenpatch.workbench.report.induction import run_lm, run_model
    from tokenpatch.workbench.report.induction_page import figure, markdown

    known = args.model in pretrained_names()
    given = {
        k: v
        for k, v in (
            ("n_words", args.words),
            ("prompts", args.prompts),
            ("exclude_top", args.exclude_top),
            ("draws", args.draws),
        )
        if v is not None
    }
    if known:
        result = run_model(args.model, lists=args.lists, seed=args.seed, progress=not args.quiet, **given)
    else:
        result = run_lm(args.model, seed=args.seed, progress=not args.quiet, **given)
    paths = _outputs(args)  # as induction_page.write, but each file new (checked before the run)
    with new_file(paths["png"], "--out") as tmp:
        figure(result, tmp)
    with new_file(paths["json"], "--out") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    with new_file(paths["md"], "--out") as tmp:
        tmp.write_text(markdown(result, paths["png"].name) + "\n")
    print(f"report: {paths['md']}")
    return 0
