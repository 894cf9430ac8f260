"""``tokenpatch induction``: induction-head measurements on the command line (``docs/induction.md``).

    tokenpatch induction scores --model smollm2-135m --length 50 --sequences 20 --seed 0 --json
    tokenpatch induction scores --model runs/lm.safetensors      # a small LM of tokenpatch.lm
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(sub, fmt, common, count, number) -> None:
    """Register ``induction`` and its subcommands on the top-level subparsers ``sub``."""
    i = sub.add_parser("induction", help="induction-head scores of a real model or of a small LM",
                       formatter_class=fmt, description="Induction heads and temporal order in context "
                       "(docs/induction.md).")
    isub = i.add_subparsers(dest="induction_command", required=True, parser_class=type(i))
    s = isub.add_parser("scores", formatter_class=fmt, help="every head's induction scores on repeated random tokens",
                        description="Every head's scores on [BOS, r_1..r_L, r_1..r_L] (r uniform over the vocabulary "
                        "without special tokens): diagonal (mean A[q, q-L+1] over the second copy), detector "
                        "(TransformerLens' induction ratio, BOS excluded), previous-token and duplicate-token; "
                        "sorted by diagonal, descending.")
    s.add_argument("--model", required=True, help="smollm2-135m, gemma3-270m, or the path of a small LM written by "
                   "tokenpatch.lm.train_lm (required)")
    s.add_argument("--length", type=count(2), default=50, help="L, tokens per copy")
    s.add_argument("--sequences", type=count(1), default=20, help="random sequences S")
    s.add_argument("--seed", type=count(0), default=0, help="seed of the random tokens")
    s.add_argument("--top", type=count(1), default=10, help="rows printed without --json")
    s.add_argument("--json", action="store_true", help="print every head as a JSON list of objects")
    common(s)
    r = isub.add_parser("report", formatter_class=fmt, help="lag curve, serial recall and their dose-response",
                        description="On a real model: the head table, the lag curve (permuted single-token nouns, "
                        "the middle one repeated), few-shot serial recall, and both measured with the top-n "
                        "induction heads ablated against n random heads outside the top M. Writes "
                        "induction-NAME.md/.json/.png to --out (about 15 minutes on 2 cores for SmolLM2).")
    r.add_argument("--model", required=True, help="smollm2-135m or gemma3-270m (required)")
    r.add_argument("--out", default="results-induction", help="output folder")
    r.add_argument("--words", type=count(3), default=100, help="words per lag prompt (n)")
    r.add_argument("--prompts", type=count(2), default=64, help="lag prompts (P)")
    r.add_argument("--lists", type=count(2), default=20, help="serial-recall lists")
    r.add_argument("--draws", type=count(1), default=3, help="random-head draws per n")
    r.add_argument("--exclude-top", type=count(0), default=50, help="random heads come from outside the top M")
    r.add_argument("--seed", type=count(0), default=0, help="seed of every draw")
    common(r)


def run(args, usage) -> int:
    return {"scores": _scores, "report": _report}[args.induction_command](args, usage)


def _model(name: str, usage, quiet: bool):
    """``(model, inputs_of, pool, bos)`` for a real-model name or a small-LM checkpoint path."""
    from .pretrained import pretrained_names

    if name in pretrained_names():
        from .pretrained import load_pretrained

        model, tok = load_pretrained(name, progress=False if quiet else None)
        special = set(tok.all_special_ids)
        bos = tok.bos_token_id if tok.bos_token_id is not None else next(iter(sorted(special)), None)
        pool = [i for i in range(model.config.vocab_size) if i not in special]
        return model, None, pool, bos
    path = Path(name)
    if not path.exists():
        raise usage(f"--model {name!r} is neither a known model {list(pretrained_names())} nor an existing file")
    from .lm import BOS, lm_inputs, load_lm

    model = load_lm(path)
    return model, (lambda ids: lm_inputs(model, ids)), range(1, model.config.d_out), BOS


def _scores(args, usage) -> int:
    from .interp.induction import head_scores

    model, inputs_of, pool, bos = _model(args.model, usage, args.quiet)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and 2 * args.length + 1 > limit:
        raise usage(f"--length {args.length}: 2L + 1 = {2 * args.length + 1} positions exceed the model's {limit}")
    rows = head_scores(model, length=args.length, sequences=args.sequences, seed=args.seed, pool=pool, bos=bos,
                       inputs_of=inputs_of)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.model}: {len(rows)} heads, L = {args.length}, {args.sequences} sequences, seed {args.seed}")
    print("layer | head | kv group | diagonal | detector | previous-token | duplicate-token")
    for r in rows[: args.top]:
        print(f"{r['layer']:>5} | {r['head']:>4} | {r['kv_group']:>8} | {r['diagonal']:8.3f} | {r['detector']:8.3f} | "
              f"{r['previous_token']:14.3f} | {r['duplicate_token']:15.3f}")
    return 0


def _report(args, usage) -> int:
    from .pretrained import pretrained_names
    from .report_induction import run_model, write

    if args.model not in pretrained_names():
        raise usage(f"--model {args.model!r} is not a known model; choose one of {list(pretrained_names())}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise usage(f"--out {out} is a file; give a folder for the report")
    result = run_model(args.model, n_words=args.words, prompts=args.prompts, lists=args.lists, draws=args.draws,
                       exclude_top=args.exclude_top, seed=args.seed, progress=not args.quiet)
    print(f"report: {write(result, out)}")
    return 0
