"""A token alone's attention output with the key-value repeat folded into ``o_proj``, against the
repeat done first, on all-position token patches of the real models (paired, one process each).

Claim (``docs/hugging-face.md``, "Cost"): a token alone gives its own value weight 1, so its attention
output is ``W_o [v; ...; v]``, each of the ``K`` key-value heads repeated for the ``G`` query heads sharing
it. Summing the ``G`` column blocks of ``W_o`` first (``arch.hf_modules._lone_attention``) makes the product
``G`` times smaller (SmolLM2: 9 query heads on 3 value heads; Gemma 3 270M: 4 on 1), which shows in
``tp.token_patch(model, ids, query="all")`` on 512 positions. Both variants are timed in one process,
interleaved with ``model.base_model(ids)`` (the unit), the fastest of ``--repeats`` rounds each
(``hf_patch_cost.timed``); the two patches' factors differ by float32 rounding (relative, printed).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/lone_attention.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import tokenpatch as tp
import tokenpatch.arch.hf_modules as hf_modules
from tokenpatch.lowrank import LowRank
from tokenpatch.workbench.zoo.pretrained import load_pretrained

sys.path.insert(0, str(Path(__file__).parent))
from hf_patch_cost import MODELS, random_ids, timed  # noqa: E402
from patch_cost import write_results  # noqa: E402

FOLDED = hf_modules._lone_attention


def repeated(o_proj, v, head_dim):
    """``o_proj`` on the values with each key-value head repeated for its query heads (before folding)."""
    groups = o_proj.in_features // v.shape[-1]
    return o_proj(v.unflatten(-1, (-1, head_dim)).repeat_interleave(groups, -2).flatten(-2))


def parts(delta) -> list[torch.Tensor]:
    return [delta.u, delta.v] if isinstance(delta, LowRank) else [delta]


def patch_with(fn, model, ids):
    hf_modules._lone_attention = fn
    try:
        return tp.token_patch(model, ids, query="all")
    finally:
        hf_modules._lone_attention = FOLDED


@torch.no_grad()
def measure(name: str, repeats: int) -> dict:
    model, tokenizer = load_pretrained(name, progress=False)
    ids = random_ids(tokenizer, 0)
    a, b = patch_with(FOLDED, model, ids), patch_with(repeated, model, ids)  # warm-up, and the same patch
    gap = max(  # relative, over every factor and vector of every layer
        float((x - y).abs().max() / y.abs().max()) for k in a for x, y in zip(parts(a[k]), parts(b[k]))
    )
    best = timed(
        {
            "body": lambda: model.base_model(input_ids=ids, use_cache=False),
            "folded": lambda: patch_with(FOLDED, model, ids),
            "repeated": lambda: patch_with(repeated, model, ids),
        },
        repeats,
    )
    body = best["body"][0]
    row = {"model": name, "body_s": body, "folded_x_body": best["folded"][0] / body}
    row.update(repeated_x_body=best["repeated"][0] / body, max_delta_gap=gap)
    print(
        f"| {name} | {body:.3f} | {row['repeated_x_body']:.2f} | {row['folded_x_body']:.2f} | {gap:.0e} |",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lone_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | body s | patch all, repeat first (x body) | folded (x body) | deltas differ by |")
    print("|---|---:|---:|---:|---:|")
    write_results(args, [measure(name, args.repeats) for name in args.models.split(",")])


if __name__ == "__main__":
    main()
