"""``tokenpatch compress --model``: the word-pair comparison (``--task``, ``--task-file``) and a user's
own prompt into a patch file (``--prompt``), on a pretrained language model. Each command is a check
that needs no torch, then the run (``main.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenpatch.errors import InputError
from tokenpatch.tasks.wordpairs import MAIN_TASKS, needed_pairs, parse_pairs, task_names
from tokenpatch.workbench.cli.args import (
    check_new_folder,
    check_out_file,
    check_out_folder,
    new_file,
    read_text_file,
    usage,
)
from tokenpatch.workbench.cli.lm import check_model, pretrained_for

__all__ = ["check_compress", "compress_lm", "LINE_LIMIT"]

# The longest line --task-file and --queries take, in characters: a word pair or a calibration query, which
# the prompt and the model read whole (a 2 MB line would ask the model for hundreds of GB).
LINE_LIMIT = 2000


def _tasks(args) -> list[str] | None:
    """The word-pair tasks of ``--task`` (None: all)."""
    if args.task in ("all", "main"):
        return None if args.task == "all" else list(MAIN_TASKS)
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in task_names()]
    if unknown or not tasks:
        raise usage(
            f"--task {args.task!r}: unknown task {unknown[:1] or ['(none)']}; choose from "
            f"{task_names()}, 'main' or 'all'"
        )
    return tasks


def _slug(args) -> str:
    return args.model.replace("-", "_").replace(".", "_")


def _outputs(args) -> dict[str, Path]:
    return {k: Path(args.out) / f"compress-{_slug(args)}.{k}" for k in ("json", "md", "png")}


def _lines(path: str, flag: str) -> list[str]:
    """The lines of the UTF-8 text file ``path``, each at most ``LINE_LIMIT`` characters."""
    lines = read_text_file(path, flag).splitlines()
    for n, line in enumerate(lines, 1):
        if len(line) > LINE_LIMIT:
            raise usage(
                f"{flag} {path} line {n} is {len(line):,} characters long; a line holds one "
                f"{'word pair' if flag == '--task-file' else 'calibration query'}, at most {LINE_LIMIT:,} "
                "characters: shorten it or split it"
            )
    return lines


def _query_lines(path: str) -> list[str]:
    lines = [ln for ln in _lines(path, "--queries") if ln.strip()]
    if not lines:
        raise usage(f"--queries {path} has no non-empty line; write one calibration query per line")
    return lines


def _task_file(args):
    """The user's word-pair task of ``--task-file`` (named after the file), every line checked."""
    path = Path(args.task_file)
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", path.stem).strip("_") or "task"
    try:
        text = "\n".join(_lines(args.task_file, "--task-file"))
        task = parse_pairs(text, name, f"--task-file {args.task_file}")
    except InputError as exc:
        raise usage(str(exc)) from None
    need = needed_pairs(args.shots)
    if len(task.pairs) < need:
        raise usage(
            f"--task-file {args.task_file} holds {len(task.pairs)} pairs; the comparison needs at least {need} "
            f"({max(args.shots, 10)} demonstrations, 40 calibration, 30 dev, then test pairs)"
        )
    return task


def check_compress(args) -> None:
    check_model(args)
    given = [
        flag
        for flag, v in (("--task", args.task), ("--task-file", args.task_file), ("--prompt", args.prompt))
        if v is not None
    ]
    if len(given) != 1:
        raise usage(
            "--model needs one of --task TASK (the comparison on word-pair tasks), --task-file FILE (the "
            "comparison on your own word pairs) or --prompt TEXT with --queries FILE (compress your own prompt)"
            + (f"; got {' and '.join(given)}" if given else "")
        )
    if args.prompt is not None:
        if not args.prompt.strip():
            raise usage("--prompt holds only whitespace; give the prompt's text")
        if args.queries and args.calibration:
            raise usage("--calibration N samples calibration queries; --queries FILE gives them: pass one")
        check_out_file(args.out, "--out", may_exist=False)
        if args.lora is not None:
            check_new_folder(args.lora, "--lora")
            out, lora = Path(args.out).resolve(), Path(args.lora).resolve()
            if out == lora or lora in out.parents:
                raise usage(
                    f"--out {args.out} would be {'the --lora folder' if out == lora else 'inside the --lora folder'} "
                    f"{args.lora} (a LoRA adapter goes to a new or empty folder of its own): give another --out "
                    "or --lora"
                )
        if args.queries:
            _query_lines(args.queries)
        return
    if args.lora is not None:
        raise usage(
            f"--lora goes with --prompt (your own prompt into one patch); {given[0]} compares methods on word pairs"
        )
    check_out_folder(args.out, "--out", f" with {given[0]}")
    _tasks(args) if args.task is not None else _task_file(args)
    for p in _outputs(args).values():
        check_out_file(str(p), "--out", may_exist=False)
    if args.output_side != "affine":
        raise usage(
            "--output-side: the comparison fits the thought patch with its affine output side; for the "
            "thought vector alone it reports the 'thought vector' row"
        )
    if args.test == 0:
        raise usage("--test 0: the comparison needs test pairs (at least 1; default 100)")
    if args.shots < 2:
        raise usage(f"--shots {args.shots}: the function vector's corrupted prompts need at least 2 demonstrations")


def compress_lm(args) -> int:
    """``compress --model``: the word-pair comparison (``--task``, or ``--task-file`` for your own pairs) or
    your own prompt into a patch file (``--prompt TEXT --queries FILE``)."""
    return _compress_prompt(args) if args.prompt is not None else _compare_tasks(args, Path(args.out))


def _compare_tasks(args, out) -> int:
    from tokenpatch.workbench.report.compress import FULL, RIDGES, run_model
    from tokenpatch.workbench.report.compress_page import figure, markdown

    tasks, paths = (_tasks(args) if args.task is not None else [_task_file(args)]), _outputs(args)
    out.mkdir(parents=True, exist_ok=True)
    run = run_model(
        args.model,
        tasks,
        shots=args.shots,
        test=100 if args.test is None else args.test,
        seed=args.seed,
        ridge=RIDGES if args.ridge is None else args.ridge,
        rank=args.rank or 4,
        out=out,
        progress=not args.quiet,
        **FULL,
    )
    text = markdown(run)
    with new_file(paths["json"], "--out") as tmp:
        tmp.write_text(json.dumps(run, indent=1))
    with new_file(paths["md"], "--out") as tmp:
        tmp.write_text(f"# Prompt compression: {args.model}\n\n{text}\n\n![figure]({paths['png'].name})\n")
    with new_file(paths["png"], "--out") as tmp:
        figure(run, tmp)
    print(text)
    back = run["read_back"]
    print(
        f"wrote {', '.join(str(p) for p in paths.values())} and the thought patches"
        + (
            f"; read back {len(back)} finished task{'s' * (len(back) > 1)} ({', '.join(back)}) from an earlier run"
            if back
            else ""
        )
    )
    return 0


def _compress_prompt(args) -> int:
    import torch

    from tokenpatch.lora import save_lora
    from tokenpatch.patch_files import save_patch
    from tokenpatch.thought.calibration import (
        DEFAULTS,
        batched,
        demonstration_separator,
        demonstration_start,
        demonstrations,
        sample_calibration,
    )
    from tokenpatch.thought.front import thought_patch
    from tokenpatch.thought.held_out import MIN_ROWS, RIDGE_GRID, choose_ridge
    from tokenpatch.workbench.methods import leading_tokens

    lines = _query_lines(args.queries) if args.queries else None
    model, tokenizer = pretrained_for(args)
    lead = leading_tokens(tokenizer)
    prompt = torch.tensor(lead + tokenizer(args.prompt, add_special_tokens=False)["input_ids"])
    limit = getattr(model.config, "max_position_embeddings", None)
    if lines is None:  # the prompted model writes its own, begun like the prompt's demonstrations
        _check_positions(args, len(prompt), DEFAULTS["length"], limit, "a continuation of {} tokens")
        begin = demonstration_start(args.prompt)
        start = tokenizer(begin, add_special_tokens=False)["input_ids"] if begin else None
        continuations = sample_calibration(
            model,
            prompt,
            n=args.calibration or DEFAULTS["n"],
            length=DEFAULTS["length"],
            temperature=DEFAULTS["temperature"],
            start=start,
            seed=args.seed,
            progress=not args.quiet,
        )  # [n, length]
        rows = continuations.tolist()
        source = f"{len(rows)} continuations it wrote itself" + (f" (each begun {begin!r})" if begin else "")
        separator = demonstration_separator(args.prompt)
        pieces = demonstrations(tokenizer, continuations, separator) if separator else []
        if pieces and (args.ridge is not None or len(pieces) >= MIN_ROWS):  # each demonstration a query of its own
            rows = pieces
            source += f", cut into the {len(pieces)} demonstrations they hold"
        elif pieces:
            source += f", whole (the {len(pieces)} demonstrations they hold are too few to choose the ridge on)"
    else:
        rows = [tokenizer(line, add_special_tokens=False)["input_ids"] for line in lines]
        rows = [r for r in rows if r]
        _check_positions(
            args, len(prompt), max(map(len, rows), default=0), limit, "its longest --queries line ({} tokens)"
        )
        source = f"{len(rows)} calibration queries"
    queries = batched(rows)  # [b, T] batches, one per length
    ridge, how = args.ridge, ""
    if ridge is None and len(rows) < MIN_ROWS:  # too few to hold a quarter out: the grid's middle
        ridge = RIDGE_GRID[len(RIDGE_GRID) // 2]  # the middle of the grid choose_ridge would search (1.0)
        how = (
            f" ({len(rows)} calibration queries are too few to choose it on a held-out quarter of them, "
            f"{MIN_ROWS} at least; --ridge sets it)"
        )
    elif ridge is None:  # chosen on a held-out quarter of the calibration queries, by KL to the prompted model
        ridge, scores = choose_ridge(
            model,
            prompt,
            rows,
            keep_bos=bool(lead),
            seed=args.seed,
            progress=not args.quiet,
            output=None if args.output_side == "none" else args.output_side,
            rank=args.rank,
        )
        how = (
            " (chosen on a held-out quarter of them, KL to the prompt: "
            + ", ".join(f"{k:g}: {v:.3f}" for k, v in scores.items())
            + ")"
        )
    patch = thought_patch(
        model,
        prompt,
        queries,
        ridge=ridge,
        keep_bos=bool(lead),
        output=None if args.output_side == "none" else args.output_side,
        rank=args.rank,
        progress=not args.quiet,
    ).patch
    with new_file(args.out, "--out") as tmp:
        save_patch(patch, tmp)
    print(
        f"{args.out}: thought patch of a {len(prompt)}-token prompt from {source}, "
        f"ridge {ridge:g}{how}; answer without the prompt: tokenpatch generate --model {args.model} "
        f"--patch {args.out} --prompt QUERY"
    )
    if args.lora is not None:
        Path(args.lora).parent.mkdir(parents=True, exist_ok=True)
        export = save_lora(model, patch, args.lora)
        print(f"{export}; load it with peft.PeftModel.from_pretrained(model, {str(args.lora)!r})")
    return 0


def _check_positions(args, prompt: int, query: int, limit: int | None, what: str) -> None:
    """The prompt and its longest query fit in the model's ``limit`` positions (checked before any work)."""
    if limit is not None and prompt + query > limit:
        raise usage(
            f"--prompt is {prompt} tokens; with {what.format(query)} it runs past {args.model}'s {limit} "
            f"positions: shorten it to at most {limit - query} tokens"
        )
