"""Exactness sweep: float64 error of token patches over every architecture combination.

Claim (DESIGN.md section 4): in float64 the patched no-context pass matches the with-context
pass to <= 1e-10 (in practice ~1e-15) for every combination of contextual layer x norm placement
x residual x query mode x removed chunk, for a single block and for 3-layer models. The test
suite checks the bound with hypothesis-drawn sizes; this script prints the worst error per
combination on fixed random models (norm parameters and biases moved off their init) and
writes ``benchmarks/results/exactness.json``.

    python benchmarks/exactness.py
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.testing import perturbed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "exactness.json"))
    args = ap.parse_args()
    rows = []
    combos = itertools.product(
        sorted(tp.LAYERS), ["none", "pre", "post"], [True, False], ["last", "all"], ["context", "chunk"], [1, 3]
    )
    for layer, norm, residual, query, remove, depth in combos:
        worst = 0.0
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            cfg = tp.ICLConfig(
                d_in=6 if depth == 1 else 3,
                d_model=6,
                n_layers=depth,
                n_heads=2,
                d_mlp=10,
                layer=layer,
                norm=norm,
                residual=residual,
            )
            model = perturbed((tp.Block(cfg) if depth == 1 else tp.ICLTransformer(cfg)).double(), seed)
            x = torch.randn(2, 9, cfg.d_in, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            patch = tp.token_patch(
                model, x, -1 if query == "last" else "all", None if remove == "context" else slice(3, 6)
            )
            worst = max(worst, tp.verify(model, patch, x).max_abs)
        rows.append(
            {
                "layer": layer,
                "norm": norm,
                "residual": residual,
                "query": query,
                "remove": remove,
                "depth": depth,
                "max_abs": worst,
            }
        )
    by_layer = {}
    for r in rows:
        by_layer[r["layer"]] = max(by_layer.get(r["layer"], 0.0), r["max_abs"])
    print(f"{len(rows)} combinations x {args.seeds} seeds, float64; worst max abs error per contextual layer:")
    for layer, err in by_layer.items():
        print(f"  {layer:>8}  {err:.2e}")
    worst = max(r["max_abs"] for r in rows)
    print(f"overall worst {worst:.2e} (bound 1e-10: {'met' if worst <= 1e-10 else 'NOT met'})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seeds": args.seeds, "worst": worst, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
