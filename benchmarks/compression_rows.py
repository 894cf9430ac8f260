"""Add rows to a finished prompt-compression comparison without running it all again.

A full comparison (``tokenpatch compress --model NAME --task ...``) takes 15-20 minutes a task on
2 cores. A method added later (here the thought patch refined through a post-MLP norm,
its Gauss-Newton step count chosen per task on the dev split from ``--norm-steps``, a grid
chosen with ``benchmarks/compression_dev.py``) is run on
the same tasks, splits, prompt (the run's first token and format) and ridge (the one the run chose
on dev for the thought patch), by the same ``compare``; the thought patch is run again beside it
and must reproduce the saved row (its KL to ICL within 5%; the two are recorded, saved and now:
float32 rounding of a changed code path moves them a little), which shows the setting is the same. The new rows go into the run's JSON; the closed-form choice
(lowest dev KL) and the goal are recomputed; the table is printed and the figure redrawn.

    TOKENPATCH_CACHE=/tmp/tpcache python benchmarks/compression_rows.py --model gemma3-270m --norm-steps 1,3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.tasks.wordpairs import load_task
from tokenpatch.workbench.compare import closed_form, compare
from tokenpatch.workbench.report.compress import FORMATS, goal
from tokenpatch.workbench.report.compress_page import figure, markdown
from tokenpatch.workbench.zoo import pretrained

ROOT = Path(__file__).parent
NEW = ("thought_patch_norm",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--norm-steps", required=True, help="the step counts chosen from on dev, e.g. 1,3")
    ap.add_argument("--tasks", default=None, help="comma-separated (default: every task of the run)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ROOT / "results" / f"compression-{args.model.replace('-', '_')}.json"
    run = json.loads(path.read_text())
    model, tokenizer = pretrained.load_pretrained(args.model, dtype=torch.float32, progress=False)
    chosen = run["prompting"]["chosen"]
    steps = tuple(int(k) for k in args.norm_steps.split(","))
    tasks = args.tasks.split(",") if args.tasks else list(run["tasks"])
    t0 = time.perf_counter()
    reproduced = {}  # the saved thought patch row and the same row now: [saved, now]
    for task in tasks:
        saved = run["tasks"][task]
        ridge = float(saved["methods"]["thought_patch"]["ridge"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tp.ThoughtWarning)
            res = compare(
                model,
                tokenizer,
                load_task(task),
                shots=run["shots"],
                seed=run["seed"],
                test=saved["splits"]["test"],
                ridge=ridge,
                lead=chosen["lead"],
                fmt=FORMATS[chosen["format"]],
                norm_steps=steps,
                methods=("thought_patch", *NEW),
            )
        again, before = res["methods"]["thought_patch"], saved["methods"]["thought_patch"]
        if abs(again["kl"] - before["kl"]) > 0.05 * before["kl"]:
            sys.exit(
                f"{task}: the thought patch does not reproduce the saved row ({again['correct']} correct, KL "
                f"{again['kl']:.5f}; saved {before['correct']}, {before['kl']:.5f}): not the same setting"
            )
        reproduced[task] = {k: [before[k], again[k]] for k in ("correct", "kl", "dev_kl")}
        for key in NEW:
            if key in res["methods"]:
                saved["methods"][key] = {k: v for k, v in res["methods"][key].items()}
        rows = saved["methods"]
        saved["closed_form_choice"] = min(
            (k for k in rows if closed_form(k) and rows[k].get("dev_kl") is not None), key=lambda k: rows[k]["dev_kl"]
        )
        new = rows.get(NEW[0], {})
        print(
            f"{task}: thought patch reproduced ({again['correct']}, KL {again['kl']:.3f}); {NEW[0]}: "
            f"{new.get('correct')} correct, KL {new.get('kl', float('nan')):.3f}, dev KL {new.get('dev_kl', float('nan')):.3f}",
            file=sys.stderr,
            flush=True,
        )
    run["goal"] = goal(run["tasks"])
    run["added_rows"] = {
        "rows": list(NEW),
        "norm_steps": list(steps),
        "tasks": tasks,
        "seconds": time.perf_counter() - t0,
        "threads": args.threads,
        "thought_patch_saved_and_now": reproduced,
    }
    path.write_text(json.dumps(run, indent=1))
    png = ROOT.parent / "docs" / f"compression-{args.model}.png"
    figure(run, png)
    print(markdown(run))
    print(f"wrote {path} and {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
