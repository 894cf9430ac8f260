"""Cost of ``tp.thought_patch`` on real language models, against one prompted forward pass.

Claim (``docs/thought-patches.md``, ``docs/prompt-compression.md`` §3): a thought patch's fit costs a small multiple of one
forward pass of its calibration set read after the prompt. The unit is that pass done the cheap
way: the prompt run once, its keys and values shared by every calibration query (a copy of the
cache per batch), so the unit is ``P + sum_j T_j`` tokens, not ``m (P + T)``. Goal: fit <= 3x it.

What the fit runs (``tokenpatch/thought/engine.py``): the same with-prompt pass (the targets, every
layer recorded), then per layer, without the prompt, two layer forwards of the calibration
tokens (the input side's anchors, the output side's with the input change in place, from which
the stream into the next layer is written; Gemma's post-MLP norm adds a third) and the least
squares (float64; in sample space while positions are fewer than features).

Setting: ``smollm2-135m`` and ``gemma3-270m`` (float32, ``--threads`` torch threads), the
10-shot past-tense prompt of ``tokenpatch compress`` (``Q: x\\nA: y`` demonstrations after the
tokenizer's leading token) and two calibration sets: the word-pair calibration split (40 queries
with their answers, the comparison's) and self-written calibration (``sample_calibration``,
64 continuations of 32 tokens, the prompt-alone path). Per model and set, best of ``--repeats``:

* ``shared-KV forward`` -- the unit: ``model.base_model`` on the prompt, then on each batch of
  queries with a copy of the prompt's cache;
* ``full forward``      -- ``[prompt; q]`` run whole for every query (what the fit did before);
* ``fit``               -- ``tp.thought_patch(model, prompt, queries, ridge=0.1, keep_bos=True)``,
  its least-squares share (``solve``, ``residual``, ``factor``, ``Sums.add``) beside it.

Prints a markdown table; writes ``benchmarks/results/thought_fit_lm.json``.

    TOKENPATCH_CACHE=/tmp/tpcache OMP_WAIT_POLICY=PASSIVE python benchmarks/thought_fit_lm.py   # ~3 minutes
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
import warnings
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.tasks.wordpairs import Format, load_task
from tokenpatch.thought import lstsq
from tokenpatch.thought.calibration import batched, sample_calibration
from tokenpatch.workbench.methods import Encoded
from tokenpatch.workbench.zoo import pretrained

sys.path.insert(0, str(Path(__file__).parent))
from patch_cost import write_results  # noqa: E402

LS = ("solve", "residual", "factor")


def setting(tokenizer, model, which: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prompt ``[P]`` and the calibration batches (same-length rows per batch)."""
    splits = load_task("present_past").split(0, demos=10, calibration=40, dev=30, test=100)
    enc = Encoded(tokenizer, splits, 10, Format())
    prompt = torch.tensor(enc.prefix + enc.demos)
    if which == "sampled (64 x 32)":
        start = tokenizer("Q:", add_special_tokens=False)["input_ids"]
        return prompt, [sample_calibration(model, prompt, 64, 32, start=start)]
    return prompt, batched([q + a for q, a in zip(enc.query["calibration"], enc.answer["calibration"])])


@torch.no_grad()
def shared_kv_forward(model, prompt: torch.Tensor, batches: list[torch.Tensor]) -> None:
    cache = model.base_model(input_ids=prompt[None], use_cache=True).cache
    for q in batches:
        kv = copy.deepcopy(cache)
        kv.batch_repeat_interleave(q.shape[0])
        model.base_model(input_ids=q, cache=kv, use_cache=True)


@torch.no_grad()
def full_forward(model, prompt: torch.Tensor, batches: list[torch.Tensor]) -> None:
    for q in batches:
        model.base_model(input_ids=torch.cat([prompt.expand(q.shape[0], -1), q], 1), use_cache=False)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class LSTimer:
    """Wall time inside the least-squares functions of ``lstsq`` (outermost calls only)."""

    def __init__(self):
        self.seconds, self.depth = 0.0, 0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth, start = 1, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth, self.seconds = 0, self.seconds + time.perf_counter() - start

        return timed


def measure(name: str, repeats: int) -> list[dict]:
    model, tokenizer = pretrained.load_pretrained(name, dtype=torch.float32, progress=False)
    rows = []
    for which in ("word pairs (40 queries)", "sampled (64 x 32)"):
        prompt, batches = setting(tokenizer, model, which)
        unit = best(lambda: shared_kv_forward(model, prompt, batches), repeats)
        whole = best(lambda: full_forward(model, prompt, batches), repeats)
        timer = LSTimer()
        originals = {f: getattr(lstsq, f) for f in LS}
        for module in (lstsq, tp.thought.fit, tp.thought.engine):  # every place that imported them
            for f in LS:
                if hasattr(module, f):
                    setattr(module, f, timer.wrap(originals[f]))
        add = lstsq.Sums.add
        lstsq.Sums.add = timer.wrap(add)
        fits = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tp.ThoughtWarning)
                for _ in range(repeats):
                    timer.seconds = 0.0
                    start = time.perf_counter()
                    tp.thought_patch(model, prompt, batches, ridge=0.1, keep_bos=True)
                    fits.append((time.perf_counter() - start, timer.seconds))
        finally:
            lstsq.Sums.add = add
            for module in (lstsq, tp.thought.fit, tp.thought.engine):
                for f in LS:
                    if hasattr(module, f):
                        setattr(module, f, originals[f])
        fit, ls = min(fits)
        positions = sum(q.numel() for q in batches)
        rows.append(
            {
                "model": name,
                "calibration": which,
                "prompt_tokens": int(prompt.numel()),
                "positions": int(positions),
                "shared_kv_forward_s": unit,
                "full_forward_s": whole,
                "fit_s": fit,
                "least_squares_s": ls,
                "fit_over_forward": fit / unit,
                "fit_over_full_forward": fit / whole,
            }
        )
        print(f"[thought_fit_lm] {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "thought_fit_lm.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for name in args.models.split(",") for row in measure(name, args.repeats)]
    print("| model | calibration | positions | shared-KV forward s | full forward s | fit s | LS s | fit / forward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['calibration']} | {r['positions']} | {r['shared_kv_forward_s']:.2f} | "
            f"{r['full_forward_s']:.2f} | {r['fit_s']:.2f} | {r['least_squares_s']:.2f} | "
            f"{r['fit_over_forward']:.1f}x |"
        )
    write_results(args, rows)


if __name__ == "__main__":
    main()
