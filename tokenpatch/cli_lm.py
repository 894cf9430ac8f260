"""The command line's language-model commands: ``tokenpatch verify --model`` and ``tokenpatch generate``
(real pretrained models from ``tokenpatch.pretrained``; ``cli.py`` parses the arguments)."""

from __future__ import annotations

import json

import torch

from .cli import _check_out_file, _usage


def _check_model_name(name: str) -> None:
    from .pretrained import pretrained_names

    if name not in pretrained_names():
        raise _usage(f"--model {name!r} is not a known model; choose one of {list(pretrained_names())}")


def _pretrained(args):
    from .pretrained import load_pretrained

    _check_model_name(args.model)
    return load_pretrained(args.model, dtype=args.dtype, progress=None if not args.quiet else False)


def verify_lm(args) -> int:
    """``verify --model``: the token patches of every query token of ``--text`` read after ``--prompt``."""
    from .hooks import functional_call
    from .patching import strip_context, token_patch
    from .verify import verify

    _check_model_name(args.model)
    if args.checkpoint is not None:
        raise _usage("--checkpoint and --model exclude each other: a checkpoint is one of tokenpatch's own models")
    if not args.prompt or not args.query:
        raise _usage("--model needs --prompt TEXT (the context) and --query TEXT (read after it)")
    model, tokenizer = _pretrained(args)
    context = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    full = tokenizer(args.prompt + args.query, return_tensors="pt")["input_ids"]
    if full.shape[1] <= context.shape[1] or not torch.equal(full[0, : context.shape[1]], context[0]):
        raise _usage("the prompt's tokens change when the query is appended (a word split across them?); start "
                     "--query with a space or a new word")
    queries = list(range(context.shape[1], full.shape[1]))
    patch = token_patch(model, full, query=queries, progress=not args.quiet)
    result = verify(model, full, patch)
    with torch.no_grad():
        want = model(full).logits[0, queries].double()  # [Q, vocab]
        got = functional_call(model, patch, **strip_context(model, full, query=queries)).logits[:, 0].double()
    top1 = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    top5 = float(torch.stack([torch.isin(g.topk(5).indices, w.topk(5).indices).all() for g, w in zip(got, want)]).double().mean())
    logp, logq = want.log_softmax(-1), got.log_softmax(-1)
    kl = float((logp.exp() * (logp - logq)).sum(-1).max())
    dlogit = float((got - want).abs().max())
    ok = result.ok(1e-3 if args.dtype == "float32" else None)
    summary = {"model": args.model, "dtype": args.dtype, "prompt_tokens": int(context.shape[1]), "queries": len(queries),
               "max_logit_diff": dlogit, "top1_agreement": top1, "top5_agreement": top5, "max_kl": kl, "ok": ok}
    if args.json:
        print(json.dumps({**summary, **result.to_dict()}, indent=1))
    else:
        print(f"{args.model}, {args.dtype}: prompt of {context.shape[1]} tokens, {len(queries)} query tokens")
        print(result.table())
        print(f"max |logit diff| {dlogit:.2e}; top-1 agreement {top1:.0%}, top-5 {top5:.0%}; max KL {kl:.2e}; "
              f"{'OK' if ok else 'FAILED'} (per-layer relative error <= {1e-3 if args.dtype == 'float32' else 1e-10:g})")
    return 0 if ok else 1


_BARS = " ▁▂▃▄▅▆▇█"


def _sparkline(values: list[float], low: float, high: float) -> str:
    """One bar per value on a log scale from ``low`` to ``high`` (a space: at or below ``low``)."""
    import math

    span = math.log(high / low) if high > low > 0 else 1.0
    level = [0 if v <= low else round(math.log(v / low) / span * (len(_BARS) - 1)) for v in values]
    return "".join(_BARS[min(len(_BARS) - 1, lv)] for lv in level)


def generate_lm(args) -> int:
    from .generate import generate

    if args.plot:
        _check_out_file(args.plot, "--plot", may_exist=False)
    model, tokenizer = _pretrained(args)
    ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    gen = generate(model, ids, args.max_new_tokens, progress=not args.quiet)
    with torch.no_grad():
        model.generation_config.pad_token_id = model.generation_config.pad_token_id or tokenizer.pad_token_id
        ordinary = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1]:]
    patched = gen.tokens[0]
    norms = gen.update_norms[0]  # [n, L]
    if args.json:
        print(json.dumps({"model": args.model, "dtype": args.dtype, "prompt": args.prompt,
                          "with_prompt": tokenizer.decode(ordinary), "patched": tokenizer.decode(patched),
                          "tokens_with_prompt": ordinary.tolist(), "tokens_patched": patched.tolist(),
                          "margin": gen.margin[0].tolist(), "logit_error": gen.logit_error[0].tolist(),
                          "update_norms": norms.tolist()}, indent=1))
    else:
        print(f"{args.model}, {args.dtype}; prompt: {args.prompt!r}")
        print(f"with the prompt     : {tokenizer.decode(ordinary)!r}")
        print(f"prompt as patches   : {tokenizer.decode(patched)!r}")
        positive = norms[norms > 0]
        low, high = (float(positive.min()), float(positive.max())) if positive.numel() else (0.0, 0.0)
        print(f"{'step':>4}  {'with prompt':>14}  {'patched':>14}  {'margin':>8}  update norm per layer (0 .. "
              f"{norms.shape[1] - 1}; log scale {low:.2g} .. {high:.2g})")
        for t in range(len(patched)):
            a = tokenizer.decode(ordinary[t : t + 1]) if t < len(ordinary) else ""
            b = tokenizer.decode(patched[t : t + 1])
            mark = " " if t < len(ordinary) and int(ordinary[t]) == int(patched[t]) else "*"
            print(f"{t:>4}  {a!r:>14}  {b!r:>14}{mark} {float(gen.margin[0, t]):8.3f}  {_sparkline(norms[t].tolist(), low, high)}"
                  f"  max {float(norms[t].max()):.3g}")
    if args.plot:
        from .plots import update_norms_figure

        update_norms_figure(norms, [tokenizer.decode(t) for t in patched.view(-1, 1)], args.plot,
                            title=f"{args.model}: implicit update per layer and generated token")
        if not args.json:
            print(f"figure: {args.plot}")
    differ = [t for t in range(min(len(ordinary), len(patched))) if int(ordinary[t]) != int(patched[t])]
    return 0 if not differ or float(gen.margin[0, differ[0]]) < 1e-3 else 1
