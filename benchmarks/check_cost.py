"""Cost of the per-call safety check of ``tp.functional_call`` on the shipped model.

Claim: the check that a patch belongs to the model it runs on (parameter names and shapes, and
the model's fingerprint) adds less than 5% to a ``functional_call`` with a one-query patch.

Three timings, interleaved in one process (best of ``--rounds`` rounds of ``--calls`` calls):

* ``unchecked``  -- the patched forward alone: the patch's hooks registered, ``model(x)``;
* ``ours``       -- ``tp.functional_call(model, patch, x)``: the same with the check;
* ``naive``      -- the same forward after the check tokenpatch 0.1 ran on every call: a walk
                    over the modules and ``float(p.sum())`` of every parameter (one device sync
                    per parameter on a GPU).

Prints a table and writes ``benchmarks/results/check_cost.json``.

    python benchmarks/check_cost.py
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.run import hooked
from tokenpatch.tasks.linreg import task_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "check_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = tp.load_model()
    batch = task_of(model).sample(8, torch.Generator().manual_seed(0))
    patch = tp.token_patch(model, batch.tokens)[3, 0]  # one (sequence, query) patch
    x = batch.tokens[3:4, -1:]  # [1, 1, 5]: the query alone

    def unchecked():
        with hooked(model, patch, False, False):
            return model(x)

    def ours():
        return tp.functional_call(model, patch, x)

    def naive():
        key = tuple((n, id(p), p.data_ptr(), p._version, float(p.sum())) for n, p in model.named_parameters())
        return key, unchecked()

    methods = {"unchecked": unchecked, "ours": ours, "naive": naive}
    best = {k: float("inf") for k in methods}
    with torch.no_grad():
        for fn in methods.values():
            fn()
        torch.testing.assert_close(ours(), unchecked(), rtol=0, atol=0)
        for _ in range(args.rounds):
            for key, fn in methods.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                best[key] = min(best[key], (time.perf_counter() - t0) / args.calls)
    n_params = sum(1 for _ in model.parameters())
    row = {f"{k}_us": v * 1e6 for k, v in best.items()}
    row["ours_overhead"] = best["ours"] / best["unchecked"] - 1
    row["naive_overhead"] = best["naive"] / best["unchecked"] - 1
    print(f"shipped model ({n_params} parameter tensors), one-query patch, input [1, 1, 5], {args.threads} threads")
    print(f"{'':>10}  {'us/call':>9}  {'overhead':>9}")
    print(f"{'unchecked':>10}  {row['unchecked_us']:9.1f}  {'':>9}")
    print(f"{'ours':>10}  {row['ours_us']:9.1f}  {100 * row['ours_overhead']:8.1f}%")
    print(f"{'naive':>10}  {row['naive_us']:9.1f}  {100 * row['naive_overhead']:8.1f}%")
    verdict = "met" if row["ours_overhead"] < 0.05 else "NOT met"
    print(
        f"\nthe per-call safety check adds {100 * row['ours_overhead']:.1f}% to functional_call (target < 5%: {verdict})"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "calls": args.calls,
        "rounds": args.rounds,
        "parameters": n_params,
    }
    out.write_text(json.dumps({"meta": meta, "row": row}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
