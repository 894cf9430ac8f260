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


def run(args, usage) -> int:
    return {"scores": _scores}[args.induction_command](args, usage)


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
