"""The command line's language-model commands: ``tokenpatch verify --model`` and ``tokenpatch generate``
(real pretrained models from ``tokenpatch.workbench.zoo.pretrained``; ``compress --model`` is
``lm_compress.py``). ``main.py`` parses the arguments and runs the ``check_*`` function of a command,
which needs no torch, before the command."""

from __future__ import annotations

import json
from pathlib import Path

from tokenpatch.workbench.cli.args import (
    check_out_file,
    new_file,
    read_header,
    usage,
)
from tokenpatch.workbench.cli.defaults import LORA_CONFIG, PATCH_FORMAT
from tokenpatch.workbench.zoo.pretrained import load_pretrained, pretrained_names, record_mismatch


def _check_name(name: str) -> None:
    if name not in pretrained_names():
        raise usage(f"--model {name!r} is not a known model; choose one of {list(pretrained_names())}")


def check_model(args) -> None:
    """``--model`` names a known model and comes without ``--checkpoint``."""
    _check_name(args.model)
    if args.checkpoint is not None:
        raise usage("--checkpoint and --model exclude each other: a checkpoint is one of tokenpatch's own models")


def pretrained_for(args):
    """``(model, tokenizer)`` of ``--model``, float32, cached as ``load_pretrained`` does."""
    return load_pretrained(
        args.model, dtype=getattr(args, "dtype", "float32"), progress=None if not args.quiet else False
    )


def check_verify(args) -> None:
    check_model(args)
    if not args.prompt or not args.query:
        raise usage("--model needs --prompt TEXT (the context) and --query TEXT (read after it)")


def verify_lm(args) -> int:
    """``verify --model``: the token patches of every query token of ``--text`` read after ``--prompt``."""
    import torch

    from tokenpatch.patching import strip_context, token_patch
    from tokenpatch.run import functional_call
    from tokenpatch.verify import REAL_MODEL_RULE, tolerance, verify

    model, tokenizer = pretrained_for(args)
    context = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    full = tokenizer(args.prompt + args.query, return_tensors="pt")["input_ids"]
    if full.shape[1] <= context.shape[1] or not torch.equal(full[0, : context.shape[1]], context[0]):
        raise usage(
            "the prompt's tokens change when the query is appended (a word split across them?); start "
            "--query with a space or a new word"
        )
    queries = list(range(context.shape[1], full.shape[1]))
    patch = token_patch(model, full, query=queries, progress=not args.quiet)
    result = verify(model, patch, full)
    with torch.no_grad():
        want = model(full).logits[0, queries].double()  # [Q, vocab]
        got = functional_call(model, patch, **strip_context(model, full, query=queries)).logits[:, 0].double()
    top1 = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    top5 = float(
        torch.stack([torch.isin(g.topk(5).indices, w.topk(5).indices).all() for g, w in zip(got, want)]).double().mean()
    )
    logp, logq = want.log_softmax(-1), got.log_softmax(-1)
    kl = float((logp.exp() * (logp - logq)).sum(-1).max())
    dlogit = float((got - want).abs().max())
    rule = REAL_MODEL_RULE if args.dtype == "float32" else args.dtype  # tp.TOLERANCES
    ok = result.ok(rule=rule)
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "prompt_tokens": int(context.shape[1]),
        "queries": len(queries),
        "max_logit_diff": dlogit,
        "top1_agreement": top1,
        "top5_agreement": top5,
        "max_kl": kl,
        "ok": ok,
    }
    if args.json:
        print(json.dumps({**summary, **result.to_dict()}, indent=1))
    else:
        print(f"{args.model}, {args.dtype}: prompt of {context.shape[1]} tokens, {len(queries)} query tokens")
        print(result.table())
        print(
            f"max |logit diff| {dlogit:.2e}; top-1 agreement {top1:.0%}, top-5 {top5:.0%}; max KL {kl:.2e}; "
            f"{'OK' if ok else 'FAILED'} (per layer: {tolerance(rule)[0].replace('_', ' ')} <= {tolerance(rule)[1]:g})"
        )
    return 0 if ok else 1


_BARS = " ▁▂▃▄▅▆▇█"


def _sparkline(values: list[float], low: float, high: float) -> str:
    """One bar per value on a log scale from ``low`` to ``high`` (a space: at or below ``low``)."""
    import math

    span = math.log(high / low) if high > low > 0 else 1.0
    level = [0 if v <= low else round(math.log(v / low) / span * (len(_BARS) - 1)) for v in values]
    return "".join(_BARS[min(len(_BARS) - 1, lv)] for lv in level)


def check_generate(args) -> None:
    _check_name(args.model)
    if args.patch is not None and args.plot is not None:
        raise usage("--plot draws the update norms of token patches; with --patch there are none: drop --plot")
    if args.patch:  # by its header: a patch of another model fails here, before the model loads
        _refuse_lora(args.patch)
        _, doc = read_header(args.patch, PATCH_FORMAT)
        why = record_mismatch(args.model, (doc.get("meta") or {}).get("model"))
        if why:
            raise usage(
                f"--patch {args.patch} is not a patch of {args.model}: {why}; make one with "
                f"tokenpatch compress --model {args.model}"
            )
    elif args.plot is not None:
        check_out_file(args.plot, "--plot", may_exist=False)


def _refuse_lora(path: str) -> None:
    """``--patch`` a peft LoRA adapter (the folder ``compress --lora`` writes, or its weights file) is refused
    by name, with what to pass instead."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    if not (folder / LORA_CONFIG).is_file() or (p.is_file() and not p.name.endswith(".safetensors")):
        return
    if p.is_file():
        names, _ = read_header(path)
        if not any(".lora_A." in n or ".lora_B." in n for n in names):
            return
    raise usage(
        f"--patch {path} is a peft LoRA adapter{' folder' if p.is_dir() else chr(39) + 's weights'} (written by "
        f"compress --lora), not a tokenpatch patch file: pass the patch file compress --out wrote, or load the "
        f"adapter with peft.PeftModel.from_pretrained(model, {str(folder)!r})"
    )


def generate_lm(args) -> int:
    if args.patch:
        return generate_with_patch(args)
    import torch

    from tokenpatch.generate import generate

    model, tokenizer = pretrained_for(args)
    ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    gen = generate(model, ids, args.max_new_tokens, progress=not args.quiet)
    with torch.no_grad():
        model.generation_config.pad_token_id = model.generation_config.pad_token_id or tokenizer.pad_token_id
        ordinary = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1] :]
    patched = gen.tokens[0]
    norms = gen.update_norms[0]  # [n, L]
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "dtype": args.dtype,
                    "prompt": args.prompt,
                    "with_prompt": tokenizer.decode(ordinary),
                    "patched": tokenizer.decode(patched),
                    "tokens_with_prompt": ordinary.tolist(),
                    "tokens_patched": patched.tolist(),
                    "margin": gen.margin[0].tolist(),
                    "logit_error": gen.logit_error[0].tolist(),
                    "update_norms": norms.tolist(),
                },
                indent=1,
            )
        )
    else:
        print(f"{args.model}, {args.dtype}; prompt: {args.prompt!r}")
        print(f"with the prompt     : {tokenizer.decode(ordinary)!r}")
        print(f"prompt as patches   : {tokenizer.decode(patched)!r}")
        positive = norms[norms > 0]
        low, high = (float(positive.min()), float(positive.max())) if positive.numel() else (0.0, 0.0)
        print(
            f"{'step':>4}  {'with prompt':>14}  {'patched':>14}  {'margin':>8}  update norm per layer (0 .. "
            f"{norms.shape[1] - 1}; log scale {low:.2g} .. {high:.2g})"
        )
        for t in range(len(patched)):
            a = tokenizer.decode(ordinary[t : t + 1]) if t < len(ordinary) else ""
            b = tokenizer.decode(patched[t : t + 1])
            mark = " " if t < len(ordinary) and int(ordinary[t]) == int(patched[t]) else "*"
            print(
                f"{t:>4}  {a!r:>14}  {b!r:>14}{mark} {float(gen.margin[0, t]):8.3f}  {_sparkline(norms[t].tolist(), low, high)}"
                f"  max {float(norms[t].max()):.3g}"
            )
    if args.plot:
        from tokenpatch.workbench.report.plots import update_norms_figure

        with new_file(args.plot, "--plot") as tmp:
            update_norms_figure(
                norms,
                [tokenizer.decode(t) for t in patched.view(-1, 1)],
                tmp,
                title=f"{args.model}: implicit update per layer and generated token",
            )
        if not args.json:
            print(f"figure: {args.plot}")
    differ = [t for t in range(min(len(ordinary), len(patched))) if int(ordinary[t]) != int(patched[t])]
    return 0 if not differ or float(gen.margin[0, differ[0]]) < 1e-3 else 1


def generate_with_patch(args) -> int:
    """``generate --patch``: greedy decoding of ``--prompt`` (a query, no context) with the thought patch
    in place, beside the same decoding without it."""
    import torch

    from tokenpatch.patch_files import load_patch
    from tokenpatch.run import apply
    from tokenpatch.workbench.methods import leading_tokens

    patch = load_patch(args.patch)
    model, tokenizer = pretrained_for(args)
    lead = list(patch.prefix)  # a keep_bos thought patch's BOS, which it needs in front of every input
    if not lead and patch.meta.get("thought", {}).get("keep_bos"):  # a file written before Patch.prefix
        lead = leading_tokens(tokenizer)
    ids = torch.tensor([lead + tokenizer(args.prompt, add_special_tokens=False)["input_ids"]])
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or tokenizer.pad_token_id
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1] :]
        with apply(model, patch):
            patched = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1] :]
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "patch": args.patch,
                    "query": args.prompt,
                    "without_patch": tokenizer.decode(plain),
                    "with_patch": tokenizer.decode(patched),
                },
                indent=1,
            )
        )
    else:
        print(f"{args.model}; query {args.prompt!r}, no prompt in the context")
        print(f"without the patch : {tokenizer.decode(plain)!r}")
        print(f"with the patch    : {tokenizer.decode(patched)!r}")
    return 0
