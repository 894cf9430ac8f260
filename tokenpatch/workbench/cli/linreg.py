"""``tokenpatch train | verify | compress`` on our own models (a checkpoint, or the shipped one): the
linear-regression transformer. ``--model NAME`` hands ``verify`` to ``lm.py`` and ``compress`` to ``lm_compress.py`` (real
pretrained language models). Each command is a ``check_*`` (no torch) and a run (imports torch).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from tokenpatch.errors import FileFormatError
from tokenpatch.workbench.cli import lm, lm_compress
from tokenpatch.workbench.cli.args import check_out_file, new_file, read_header, usage
from tokenpatch.workbench.cli.defaults import HEADED_LAYERS, MODEL_FORMAT

if TYPE_CHECKING:
    import torch

__all__ = ["check_checkpoint", "check_train", "train", "check_verify", "verify", "check_compress", "compress"]


def check_checkpoint(path: str | None) -> None:
    if path is not None:
        read_header(path, MODEL_FORMAT)


def check_train(args) -> None:
    check_out_file(args.out, "--out", may_exist=True)
    if args.export is not None:
        check_out_file(args.export, "--export", may_exist=False)
    out = Path(args.out)
    if out.exists():  # only a training checkpoint of tokenpatch is resumed or replaced
        try:
            names, _ = read_header(args.out, MODEL_FORMAT)
        except (FileFormatError, OSError) as exc:
            raise usage(
                f"--out {out} exists and is not a tokenpatch training checkpoint; "
                "choose another path (nothing is overwritten)"
            ) from exc
        if "train.rng" not in names and not args.no_resume:
            raise usage(
                f"--out {out} holds weights only (an export), so training cannot resume from it; choose another path"
            )
    if any(k in HEADED_LAYERS for k in (args.layer, args.interleave)) and args.d_model % args.heads:
        raise usage(f"d_model={args.d_model} is not divisible by n_heads={args.heads}")
    if (args.interleave is None) != (args.interval is None):
        raise usage("--interleave and --interval go together (a hybrid: --interleave KIND --interval N)")


def train(args) -> int:
    from tokenpatch.models.icl import ICLConfig, read_checkpoint, save_model
    from tokenpatch.tasks.linreg import LinRegTask
    from tokenpatch.workbench.train.linreg import TrainConfig, train

    out = Path(args.out)
    task = LinRegTask(dim=args.dim, n_context=args.context, noise=args.noise)
    model_config = ICLConfig(
        d_in=task.d_in,
        d_out=1,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        layer=args.layer,
        norm=args.norm,
        residual=not args.no_residual,
        interleave=args.interleave or "",
        interval=args.interval or 0,
    )
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, checkpoint_every=args.checkpoint_every
    )
    train(out, model_config, task, cfg, resume=not args.no_resume, progress=not args.quiet)
    model, doc, _ = read_checkpoint(out)
    ev = doc["meta"]["eval"]
    print(
        f"{out}: in-context MSE {ev['mse_model']:.4f} = {100 * ev['ratio_zero']:.1f}% of the zero predictor "
        f"({ev['mse_zero']:.4f}); least squares {ev['mse_least_squares']:.4f}, ridge {ev['mse_ridge']:.4f}"
    )
    if args.export is not None:
        with new_file(args.export, "--export") as tmp:
            save_model(model, tmp, meta=doc["meta"])
        print(f"weights-only copy: {args.export}")
    return 0


def check_verify(args) -> None:
    if args.model is not None:
        lm.check_verify(args)
        return
    if args.prompt is not None:
        raise usage("--prompt is for a language model: add --model NAME")
    args.query = args.query or "last"
    if args.query not in ("last", "all"):
        raise usage(f"--query {args.query!r}: on a checkpoint it is 'last' or 'all' (query text needs --model NAME)")
    check_checkpoint(args.checkpoint)


def verify(args) -> int:
    if args.model is not None:
        return lm.verify_lm(args)
    import torch

    from tokenpatch.models.icl import load_model
    from tokenpatch.patching import token_patch
    from tokenpatch.tasks.linreg import task_of
    from tokenpatch.verify import verify

    model = load_model(args.checkpoint, dtype=args.dtype)
    task = task_of(model)
    tokens = task.sample(args.tasks, torch.Generator().manual_seed(args.seed), dtype=model.read_in.weight.dtype).tokens
    patch = token_patch(model, tokens, query=-1 if args.query == "last" else "all", progress=not args.quiet)
    result = verify(model, patch, tokens)
    ok = result.ok()
    if args.json:
        print(
            json.dumps(
                {"checkpoint": args.checkpoint or "shipped", "tolerance": result.target, "ok": ok, **result.to_dict()},
                indent=1,
            )
        )
    else:
        print(
            f"{args.checkpoint or 'shipped checkpoint'}: {model.config.describe()}, {args.dtype}, "
            f"{args.tasks} tasks, query {args.query} ({result.n} patches)"
        )
        print(result.table())
        print(
            f"max abs {result.max_abs:.2e}, max rel {result.max_rel:.2e}: {'OK' if ok else 'FAILED'} ({result.target})"
        )
    return 0 if ok else 1


def check_tensor_file(path: str, key: str, flag: str) -> None:
    """``path`` is a safetensors file with a tensor named ``key``, by its header."""
    try:
        names, _ = read_header(path)
    except FileFormatError as exc:
        raise usage(f"{flag} {path} is not a safetensors file ({exc})") from None
    if key not in names:
        names = sorted(names)
        raise usage(
            f"{flag} {path} holds {names[:4]}{' and more' if len(names) > 4 else ''}, not a tensor named {key!r}"
        )


def tensor(path: str, key: str, flag: str) -> torch.Tensor:
    """Tensor ``key`` of the safetensors file ``path`` (float64)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except SafetensorError as exc:
        raise usage(f"{flag} {path} is not a safetensors file ({exc})") from None
    if key not in tensors:
        names = sorted(tensors)
        raise usage(
            f"{flag} {path} holds {names[:4]}{' and more' if len(names) > 4 else ''}, not a tensor named {key!r}"
        )
    return tensors[key].double()


def check_compress(args) -> None:
    if args.model is not None:
        lm_compress.check_compress(args)
        return
    for flag, value in (("--task", args.task), ("--task-file", args.task_file), ("--lora", args.lora)):
        if value is not None:
            raise usage(f"{flag} is for a language model: add --model NAME")
    check_out_file(args.out, "--out", may_exist=False)
    check_checkpoint(args.checkpoint)
    if args.prompt is not None:
        check_tensor_file(args.prompt, "prompt", "--prompt")
    if args.queries is not None:
        check_tensor_file(args.queries, "queries", "--queries")


def compress(args) -> int:
    if args.model is not None:
        return lm_compress.compress_lm(args)
    args.test = 1000 if args.test is None else args.test
    import torch

    from tokenpatch.models.icl import load_model
    from tokenpatch.patch_files import save_patch
    from tokenpatch.tasks.linreg import task_of
    from tokenpatch.thought.front import ThoughtWarning, evaluate_thought_patch, thought_patch

    model = load_model(args.checkpoint, dtype="float64")
    task = task_of(model)
    g = torch.Generator().manual_seed(args.seed)
    draw = lambda n: torch.cat(
        [
            torch.randn(n, 1, task.dim, generator=g, dtype=torch.float64),  # noqa: E731
            torch.zeros(n, 1, 1, dtype=torch.float64),
        ],
        -1,
    )
    prompt = (
        tensor(args.prompt, "prompt", "--prompt")
        if args.prompt
        else task.sample(1, g, dtype=torch.float64).tokens[0, :-1]
    )
    queries = tensor(args.queries, "queries", "--queries") if args.queries else draw(args.calibration or 1024)
    if queries.ndim == 2:
        queries = queries[:, None]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ThoughtWarning)
        patch = thought_patch(
            model,
            prompt,
            queries,
            ridge=args.ridge or 0.0,
            mode=args.mode,
            rank=args.rank,
            output=None if args.output_side == "none" else args.output_side,
            progress=not args.quiet,
        ).patch
    with new_file(args.out, "--out") as tmp:
        save_patch(patch, tmp)
    fits = patch.meta["thought"]["fits"]
    print(
        f"{args.out}: thought patch of a {prompt.shape[0]}-token prompt from {queries.shape[0]} calibration queries "
        f"({fits[0]['n']} positions), {args.mode} fit, ridge {args.ridge or 0.0:g}"
    )
    print("layer | input residual | rank | condition | output residual | rank | condition")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for f in fits:
        print(
            f"{f['layer']:>5} | {fmt(f['input_residual'], '.2e'):>14} | {fmt(f['input_rank'], 'd'):>4} | "
            f"{fmt(f['input_condition'], '.1e'):>9} | {fmt(f['output_residual'], '.2e'):>15} | "
            f"{fmt(f['output_rank'], 'd'):>4} | {fmt(f['output_condition'], '.1e'):>9}"
        )
    ill = [w for w in caught if issubclass(w.category, ThoughtWarning)]
    if ill:
        print(
            f"note: {len(ill)} of the least-squares systems were rank-deficient or ill-conditioned (conditions above); "
            "they took the minimum-norm solution. --ridge (e.g. 1e-6) regularises them"
        )
    if args.test:
        ev = evaluate_thought_patch(model, prompt, draw(args.test), patch)
        print(
            f"on {args.test} fresh queries without the prompt: {100 * ev['gap_closed']['thought_patch']:.2f}% of the "
            f"prompt's effect kept (output MSE to the with-prompt model {ev['mse_to_context']['thought_patch']:.3e}, "
            f"without the patch {ev['mse_to_context']['no_prompt']:.3e})"
        )
    return 0
