"""Dev-split studies of the thought patch on a real language model (``docs/prompt-compression.md`` §5).

The comparison (``tokenpatch compress --model NAME --task ...``) chooses each setting on the dev
split. This script asks, on the same dev split and never the test split, how the thought patch's
``KL(ICL || patch)`` at the dev queries' answer position moves with:

* ``--study norm``: Gauss-Newton steps through the post-MLP norm (``thought_patch(norm_steps=k)``,
  ``thought.through_norm``; Gemma 2/3 only), on the calibration split's 40 labelled queries at the
  ridge the comparison chose for the task;
* ``--study size``: the number of calibration demonstrations: the 40 labelled ones, then the first
  ``N`` demonstrations the prompted model writes itself (``sample_calibration``, cut by
  ``demonstrations``), ``N`` up to 800, at the same ridge and at a tenth of it;
* ``--study hybrid``: what the closed form leaves to gradient steps, and at what cost: prompt
  baking (``baselines.bake``, a rank-4 LoRA on KL to the prompted model over the 40 labelled
  queries) for ``K`` full-batch Adam steps, from the plain model and from the closed-form thought
  patch (the hybrid), with the seconds each took.

The prompt is the comparison's: its first token and format, read from
``benchmarks/results/compression-NAME.json`` (``--lead`` overrides the first token), ten shots,
seed 0. Prints a table; writes ``benchmarks/results/compression_dev-NAME.json`` and, for the size
study, ``docs/compression-calibration-size-NAME.png``.

    TOKENPATCH_CACHE=/tmp/tpcache python benchmarks/compression_dev.py --model gemma3-270m --study norm
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import tokenpatch as tp  # noqa: E402
from tokenpatch.baselines.baking import bake  # noqa: E402
from tokenpatch.tasks.wordpairs import load_task  # noqa: E402
from tokenpatch.thought.calibration import batched, demonstration_start, demonstrations, sample_calibration  # noqa: E402
from tokenpatch.workbench.extract import SAMPLE_LENGTH, dev_kl, patched  # noqa: E402
from tokenpatch.workbench.methods import Encoded, Method, answer_logits  # noqa: E402
from tokenpatch.workbench.report.compress import FORMATS  # noqa: E402
from tokenpatch.workbench.zoo import pretrained  # noqa: E402

ROOT = Path(__file__).parent
SIZES = (40, 100, 200, 400, 800)  # self-written demonstrations per fit
SETTING_KEYS = ("norm_steps", "calibration", "demonstrations", "ridge", "start", "steps")  # what a row measured


def comparison(name: str) -> dict:
    path = ROOT / "results" / f"compression-{name.replace('-', '_')}.json"
    if not path.exists():
        sys.exit(f"compression_dev: {path} is missing: run the comparison for {name} first")
    return json.loads(path.read_text())


def setting(model, tokenizer, task: str, run: dict, lead: list[int]):
    fmt = FORMATS[run["prompting"]["chosen"]["format"]]
    splits = load_task(task).split(0, demos=10, calibration=40, dev=30, test=100)
    enc = Encoded(tokenizer, splits, 10, fmt, lead)
    prompt = torch.tensor(enc.prefix + enc.demos)
    labelled = batched([q + a for q, a in zip(enc.query["calibration"], enc.answer["calibration"])])
    reference = answer_logits(model, enc.batch("dev", True), Method("ICL", prompted=True))
    return enc, prompt, labelled, reference


def fit_kl(model, enc, prompt, calibration, reference, ridge: float, **options) -> tuple[float, float, list]:
    fit, seconds = _fit(model, prompt, calibration, ridge, **options)
    return dev_kl(model, enc, patched(model, "", fit.patch, 0.0, {}), reference), seconds, fit.fits


def _fit(model, prompt, calibration, ridge: float, **options):
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.ThoughtWarning)
        fit = tp.thought_patch(model, prompt, calibration, ridge=ridge, keep_bos=True, output="affine", **options)
    return fit, time.perf_counter() - start


def study_hybrid(model, enc, prompt, labelled, reference, ridge: float, steps: list[int]) -> list[dict]:
    fit, fit_s = _fit(model, prompt, labelled, ridge)
    rows = [
        {
            "start": "thought patch",
            "steps": 0,
            "dev_kl": dev_kl(model, enc, patched(model, "", fit.patch, 0.0, {}), reference),
            "seconds": fit_s,
        }
    ]
    for k in steps:
        for start, base, extra in (("plain model", None, 0.0), ("thought patch", fit.patch, fit_s)):
            (b,) = bake(model, prompt, labelled, seconds=1e9, rank=4, keep_bos=True, base=base, max_steps=k)
            kl = dev_kl(model, enc, patched(model, "", b.patch, 0.0, {}), reference)
            rows.append(
                {
                    "start": start,
                    "steps": b.steps,
                    "dev_kl": kl,
                    "seconds": extra + b.seconds,
                    "kl_calibration": b.losses[-1],
                }
            )
            print(
                f"  {start} + {b.steps} steps: dev KL {kl:.3f} ({extra + b.seconds:.0f} s)", file=sys.stderr, flush=True
            )
    return rows


def study_norm(model, enc, prompt, labelled, reference, ridge: float, steps: list[int]) -> list[dict]:
    rows = []
    for k in steps:
        kl, seconds, fits = fit_kl(model, enc, prompt, labelled, reference, ridge, norm_steps=k)
        errors = [f.norm_error for f in fits if f.norm_error]
        rows.append(
            {
                "norm_steps": k,
                "ridge": ridge,
                "dev_kl": kl,
                "fit_s": seconds,
                "norm_error_first": [e[0] for e in errors],
                "norm_error_last": [e[-1] for e in errors],
            }
        )
        print(f"  norm_steps {k}: dev KL {kl:.3f} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    return rows


def study_size(model, enc, prompt, labelled, reference, ridge: float, continuations: int) -> list[dict]:
    begin = demonstration_start(enc.fmt.demos(enc.demo_pairs))
    start = enc.tokenizer(begin, add_special_tokens=False)["input_ids"] if begin else None
    t0 = time.perf_counter()
    rows = sample_calibration(model, prompt, continuations, SAMPLE_LENGTH, start=start, seed=0)
    pieces = demonstrations(enc.tokenizer, rows, enc.fmt.separator)
    sampling = time.perf_counter() - t0
    print(f"  {len(pieces)} demonstrations from {continuations} continuations", file=sys.stderr, flush=True)
    out = []
    for lam in (ridge, ridge / 10):
        kl, seconds, _ = fit_kl(model, enc, prompt, labelled, reference, lam)
        out.append({"calibration": "labelled", "demonstrations": 40, "ridge": lam, "dev_kl": kl, "fit_s": seconds})
        for n in [s for s in SIZES if s <= len(pieces)]:
            kl, seconds, _ = fit_kl(model, enc, prompt, batched(pieces[:n]), reference, lam)
            positions = sum(len(p) for p in pieces[:n])
            out.append(
                {
                    "calibration": "self-written",
                    "demonstrations": n,
                    "positions": positions,
                    "ridge": lam,
                    "dev_kl": kl,
                    "fit_s": seconds,
                    "sampling_s": sampling,
                }
            )
            print(
                f"  ridge {lam:g}, {n} demonstrations: dev KL {kl:.3f} ({seconds:.0f} s)", file=sys.stderr, flush=True
            )
    return out


def figure(name: str, results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (task, rows) in enumerate(results.items()):
        for j, lam in enumerate(sorted({r["ridge"] for r in rows}, reverse=True)):
            mine = [r for r in rows if r["ridge"] == lam and r["calibration"] == "self-written"]
            color = f"C{i}"
            ax.plot(
                [r["demonstrations"] for r in mine],
                [r["dev_kl"] for r in mine],
                "o-" if j == 0 else "s--",
                color=color,
                label=f"{task}, ridge {lam:g}",
            )
            (lab,) = [r for r in rows if r["ridge"] == lam and r["calibration"] == "labelled"]
            ax.plot([40], [lab["dev_kl"]], "*" if j == 0 else "x", color=color, markersize=12)
    ax.set_xscale("log")
    ax.set_yscale("log")
    sizes = sorted({r["demonstrations"] for rows in results.values() for r in rows})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("calibration demonstrations (stars / crosses: the 40 labelled ones)")
    ax.set_ylabel("dev KL(ICL || thought patch), nats")
    ax.set_title(f"{name}: the thought patch against its calibration size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tasks", default="country_capital,present_past,singular_plural")
    ap.add_argument("--study", choices=["norm", "size", "hybrid"], default="norm")
    ap.add_argument("--norm-steps", default="0,1,3")
    ap.add_argument("--bake-steps", default="5,20")
    ap.add_argument("--continuations", type=int, default=512)
    ap.add_argument("--ridge", type=float, default=None, help="instead of the ridge the comparison chose on dev")
    ap.add_argument("--lead", default=None, help="the first token's text (default: the comparison's dev choice)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = comparison(args.model)
    model, tokenizer = pretrained.load_pretrained(args.model, dtype=torch.float32, progress=False)
    lead_text = args.lead or run["prompting"]["chosen"]["lead_text"]
    lead = [tokenizer.convert_tokens_to_ids(lead_text)]
    results = {}
    for task in args.tasks.split(","):
        ridge = args.ridge if args.ridge is not None else float(run["tasks"][task]["methods"]["thought_patch"]["ridge"])
        print(f"{args.model} {task} (ridge {ridge:g}, first token {lead_text!r})", file=sys.stderr, flush=True)
        enc, prompt, labelled, reference = setting(model, tokenizer, task, run, lead)
        if args.study == "norm":
            steps = [int(k) for k in args.norm_steps.split(",")]
            results[task] = study_norm(model, enc, prompt, labelled, reference, ridge, steps)
        elif args.study == "hybrid":
            steps = [int(k) for k in args.bake_steps.split(",")]
            results[task] = study_hybrid(model, enc, prompt, labelled, reference, ridge, steps)
        else:
            results[task] = study_size(model, enc, prompt, labelled, reference, ridge, args.continuations)
    out = ROOT / "results" / f"compression_dev-{args.model.replace('-', '_')}.json"
    saved = json.loads(out.read_text()) if out.exists() else {}
    earlier = saved.get(args.study, {}).get("tasks", {})
    for task, rows in results.items():  # a rerun with other settings adds to the rows it does not repeat
        same = {json.dumps({k: v for k, v in r.items() if k in SETTING_KEYS}, sort_keys=True) for r in rows}
        kept = [
            r
            for r in earlier.get(task, [])
            if json.dumps({k: v for k, v in r.items() if k in SETTING_KEYS}, sort_keys=True) not in same
        ]
        results[task] = kept + rows
    saved[args.study] = {"lead": lead_text, "threads": args.threads, "tasks": {**earlier, **results}}
    out.write_text(json.dumps(saved, indent=1))
    print(f"wrote {out}")
    if args.study == "size":
        png = ROOT.parent / "docs" / f"compression-calibration-size-{args.model}.png"
        figure(args.model, results, png)
        print(f"wrote {png}")
    for task, rows in results.items():
        for r in rows:
            print(task, {k: v for k, v in r.items() if not isinstance(v, list)})


if __name__ == "__main__":
    main()
