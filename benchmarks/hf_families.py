"""Every Hugging Face block design tokenpatch patches, on a tiny random float64 model of each.

Claim (``docs/hugging-face.md``): for every ``model_type`` tokenpatch accepts, the patched lone token
reproduces every layer's hidden state and the with-context logits to float64 rounding, and so do
``tp.generate``, ``tp.trajectory`` and a one-query ``tp.thought_patch``. This script prints the table
of the docs: per tiny model (``tokenpatch.testing.TINY_HF``; norms and biases moved off their init)
its design, the patch kinds it uses and the worst error of each path, and writes
``benchmarks/results/hf_families.json``. ``tests/test_hf.py`` asserts the same bounds.

    python benchmarks/hf_families.py                       # every row (a few minutes), then the table
    python benchmarks/hf_families.py --only lfm2 jamba     # these rows (added to the results file), the table
    python benchmarks/hf_families.py --table               # the table of the results file, measuring nothing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.arch import adapter_for
from tokenpatch.testing import EAGER_ONLY, FLOAT32_INSIDE, TINY_HF, float64_everywhere, float64_norms, tiny_hf_model


def errors(name: str) -> dict:
    """The worst absolute error of each path on the tiny model ``name`` (float64)."""
    model = tiny_hf_model(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, 101, (2, 12), generator=g)
    out = {"verify": tp.verify(model, tp.token_patch(model, x, query=[-1, -4, 3]), x).max_abs}
    gen = tp.generate(model, x[:, :9], max_new_tokens=8)
    out["generate"] = float(gen.logit_error.max())
    try:  # the prefixes run as one left-padded batch
        traj = tp.trajectory(model, x[:1, :8], query=-1)
        out["trajectory"] = max(
            tp.verify(model, traj.patch(i), traj.prefix_inputs(x[:1, :8], i)).max_abs for i in (2, 7)
        )
    except tp.InputError:  # eager attention (Gemma 2): transformers' own forward gives NaN with padding
        out["trajectory"] = None
    prompt, query = x[0], x[1:, :1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.ThoughtWarning)  # one calibration query: the minimum-norm interpolant
        fit = tp.thought_patch(model, prompt, query, progress=False)
    with torch.no_grad():
        want = model(torch.cat([prompt[None], query], 1)).logits[:, -1]
        got = tp.functional_call(model, fit.patch, query).logits[:, -1]
    out["thought_patch"] = float((got - want).abs().max())
    return out


def _cell(error: float | None) -> str:
    return "NaN in eager + padding" if error is None else f"{error:.0e}"


def describe(name: str) -> dict:
    """What the table says of the tiny model ``name`` besides its errors: its ``model_type``, design,
    the kinds of its layers (their token mixers, ``Mixer.kind``; Nemotron-H's sublayers without one
    too), and its layer 0's input and output sides."""
    model = tiny_hf_model(name)
    adapter = adapter_for(model)
    family, sites = adapter.family(model), adapter.sites(model, 0)
    layer = next(n for n, m in model.named_modules() if m is adapter.layers(model)[0]) + "."
    mixers = dict.fromkeys(
        (family.at(x).recurrent.kind if family.at(x).recurrent else "attention") for x in adapter.layers(model)
    )
    mixers.update(dict.fromkeys(m.kind for m in family.mixers if m.beside))  # beside the attention (Falcon-H1)
    return {
        "model_type": model.config.model_type,
        "design": family.name,
        "mixers": " + ".join(mixers),
        "inputs": ", ".join(n.removeprefix(layer).rpartition(".")[0] for n in sites.inputs) or "none (parallel)",
        "output": "none (no MLP)" if sites.output is None else sites.output.kind + _divided(sites.output.scale),
    }


def _divided(scale) -> str:
    """The output side's divisor as the table prints it: none, a constant, or a factor per channel (ZAYA)."""
    if isinstance(scale, torch.Tensor):
        return " / per channel"
    return "" if scale == 1 else f" / {scale:g}"


def table(rows: dict) -> None:
    """The docs' table: every measured tiny model, in ``TINY_HF``'s order."""
    print(
        "| tiny model | `model_type` | design | layer kinds | input side | output side | verify | generate "
        "| trajectory | thought patch |"
    )
    print("|---|---|---|---|---|---|---:|---:|---:|---:|")
    for name in TINY_HF:
        if name in rows:
            r = {**rows[name], **describe(name)}
            print(
                f"| {name} | {r['model_type']} | {r['design']} | {r['mixers']} | {r['inputs']} | {r['output']} "
                f"| {r['verify']:.0e} | {r['generate']:.0e} | {_cell(r['trajectory'])} | {r['thought_patch']:.0e} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_families.json"))
    ap.add_argument("--only", nargs="+", choices=sorted(TINY_HF), help="these tiny models only (rows added to --out)")
    ap.add_argument("--table", action="store_true", help="print the table of --out, measuring nothing")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    out = Path(args.out)
    rows = json.loads(out.read_text())["models"] if (args.only or args.table) and out.exists() else {}
    for name in [] if args.table else args.only or TINY_HF:
        inside = float64_everywhere() if name in FLOAT32_INSIDE else contextlib.nullcontext()
        with float64_norms(), inside:  # transformers' float32 casts (norms; scans, routers) made float64
            err = errors(name)
        if name in EAGER_ONLY:  # eager attention's float32 softmax: the prompt cache and the full forward differ
            err["attention"] = "eager"
        rows[name] = {**describe(name), **err}
        done = ", ".join(f"{k} {v:.0e}" for k, v in err.items() if isinstance(v, float))
        print(f"[hf_families] {name}: {done}", file=sys.stderr, flush=True)
        rows = {n: rows[n] for n in TINY_HF if n in rows}  # the table's order; saved row by row
        out.write_text(json.dumps({"torch": torch.__version__, "models": rows}, indent=1) + "\n")
    table(rows)


if __name__ == "__main__":
    main()
