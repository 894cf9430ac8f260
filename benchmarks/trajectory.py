"""Cost of ``tp.trajectory``: the patches of every context prefix, one pass vs one per prefix.

Claim: the trajectory over ``N`` prefixes costs about two forward passes (one for the context,
one for the ``N + 1`` virtual query rows), not ``N`` of them. Targets: >= 50x faster than calling
``tp.token_patch`` on every truncated input at N = 512, and <= 3x one with-context forward pass.

Methods, in one process on the same inputs:

* ``forward``     -- one with-context forward pass (no grad): the unit of cost;
* ``ours``        -- ``tp.trajectory(model, x)``: factors of every layer and every prefix;
* ``per_prefix``  -- ``tp.token_patch(model, x[:, [0..i-1] + [query]])`` for i = 0..N.

Peak memory is the net tensor memory a call allocates (``patch_cost.peak_bytes``); the largest
single allocation of ``ours`` is recorded beside the size of one dense ``d_mlp x d_model`` update
(the code never forms one: every product is ``[rows] x [cols]`` factors; the largest tensors are
the MLP activations of the query rows and the attention scores). Prints a table; writes
``benchmarks/results/trajectory.json``.

    python benchmarks/trajectory.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import tokenpatch as tp
from tokenpatch.tasks.linreg import task_of

sys.path.insert(0, str(Path(__file__).parent))
from patch_cost import peak_bytes, timed, write_results  # noqa: E402


def largest_allocation(fn) -> int:
    """The largest single tensor allocation (bytes) made while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0)


def per_prefix(model, x):
    q = x.shape[1] - 1
    return [tp.token_patch(model, x[:, list(range(i)) + [q]], progress=False) for i in range(q + 1)]


def bench(name: str, model, x, repeats: int) -> dict:
    model.eval()
    fwd = lambda: torch.no_grad()(model)(x)  # noqa: E731
    ours = lambda: tp.trajectory(model, x, progress=False)  # noqa: E731
    naive = lambda: per_prefix(model, x)  # noqa: E731
    fwd(), ours()
    c = model.config
    row = {"model": name, "batch": x.shape[0], "context": x.shape[1] - 1, "layers": c.n_layers, "d_model": c.d_model}
    row.update({f"{k}_s": v for k, v in timed({"forward": fwd, "ours": ours}, repeats).items()})
    row["per_prefix_s"] = timed({"per_prefix": naive}, 1)["per_prefix"]
    for key, fn in (("forward", fwd), ("ours", ours)):
        row[f"{key}_peak_mb"] = peak_bytes(fn) / 2**20
    row["ours_largest_alloc_mb"] = largest_allocation(ours) / 2**20
    row["one_dense_update_mb"] = c.hidden * c.d_model * x.element_size() / 2**20
    row["ours_over_forward"] = row["ours_s"] / row["forward_s"]
    row["per_prefix_over_ours"] = row["per_prefix_s"] / row["ours_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trajectory.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    shipped = tp.load_model()
    x = task_of(shipped).sample(64, torch.Generator().manual_seed(0)).tokens  # [64, 17, 5]
    rows.append(bench("shipped (10-layer Pre-LN)", shipped, x, args.repeats))
    torch.manual_seed(0)
    wide = tp.ICLTransformer(tp.ICLConfig(d_in=5, d_model=256, n_layers=10, n_heads=8, norm="pre")).eval()
    x = torch.randn(1, 513, 5, generator=torch.Generator().manual_seed(1))  # N = 512 context tokens
    rows.append(bench("wide (d_model 256, 10 layers)", wide, x, args.repeats))

    print(
        f"{'model':<30} {'batch':>5} {'N':>4} {'fwd s':>7} {'ours s':>7} {'prefix s':>9} {'ours/fwd':>8} "
        f"{'prefix/ours':>11} {'ours MB':>8} {'max alloc MB':>12} {'dense MB':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:<30} {r['batch']:>5} {r['context']:>4} {r['forward_s']:7.3f} {r['ours_s']:7.3f} "
            f"{r['per_prefix_s']:9.2f} {r['ours_over_forward']:8.2f} {r['per_prefix_over_ours']:11.1f} "
            f"{r['ours_peak_mb']:8.1f} {r['ours_largest_alloc_mb']:12.2f} {r['one_dense_update_mb']:8.2f}"
        )
    w = rows[-1]
    print(
        f"\nwide model, N = 512: one-pass trajectory {w['per_prefix_over_ours']:.0f}x faster than per-prefix "
        f"token_patch (target >= 50x: {'met' if w['per_prefix_over_ours'] >= 50 else 'NOT met'}), "
        f"{w['ours_over_forward']:.2f}x one forward pass (target <= 3x: {'met' if w['ours_over_forward'] <= 3 else 'NOT met'})"
    )
    write_results(args, rows)


if __name__ == "__main__":
    main()
