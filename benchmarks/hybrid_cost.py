"""Cost of all-position token patches on small hybrid and recurrent models, against their forward.

Claim (``docs/recurrent-layers.md``, "Cost"): a token patch of a model with recurrent layers costs its
with-context pass plus the no-context pass (every query a one-token sequence run from a zero state,
its MLPs skipped), about two forwards; an attention-only model of the same size needs no second pass
(a token alone's attention output is ``o_proj`` of its values).

Setting: the tiny designs of ``tokenpatch.testing.TINY_HF`` widened to ``--width`` (hidden size; MLP
``3 x``, heads of 32), ``--layers`` layers, float32, random weights, ``--threads`` torch threads, batch 1,
``--length`` random token ids. Per model, ``--repeats`` rounds of ``body`` (``model.base_model(ids)``:
the forward without the LM head, which ``token_patch`` never runs) and ``patch all``
(``tp.token_patch(model, ids, query="all")``) interleaved; the ratio per round, reported as the median
and the spread (min-max) of the rounds. Prints a markdown table; writes ``benchmarks/results/hybrid_cost.json``.

    python benchmarks/hybrid_cost.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.testing import tiny_hf_model

# (tiny model, what its layers mix tokens by)
MODELS = (
    ("llama", "attention (lone token: o_proj of its values)"),
    ("lfm2", "gated short convolution, attention every 3rd layer"),
    ("qwen3_5_text", "Gated DeltaNet, gated attention every 3rd layer"),
    ("jamba_dense", "Mamba, attention every 2nd layer"),
    ("mamba2", "Mamba 2, no MLP"),
)


def widened(name: str, width: int, layers: int) -> dict:
    """Config overrides that widen the tiny design ``name`` (its layer pattern kept, cycled)."""
    kw = {"hidden_size": width, "intermediate_size": 3 * width, "num_hidden_layers": layers}
    if name == "mamba2":
        return {**kw, "num_heads": width * 2 // 16, "head_dim": 16}
    kw.update(num_attention_heads=width // 32, num_key_value_heads=width // 64, head_dim=32)
    if name == "lfm2":
        kw["layer_types"] = ["conv" if i % 3 != 2 else "full_attention" for i in range(layers)]
    if name == "qwen3_5_text":
        kw["layer_types"] = ["linear_attention" if i % 3 != 2 else "full_attention" for i in range(layers)]
        kw.update(linear_num_key_heads=width // 64, linear_num_value_heads=width // 32)
        kw.update(linear_key_head_dim=32, linear_value_head_dim=32)
    return kw


def measure(name: str, args) -> dict:
    model = tiny_hf_model(name, **widened(name, args.width, args.layers)).float()
    ids = torch.randint(1, 100, (1, args.length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.base_model(ids)
        tp.token_patch(model, ids, query="all")  # warm-up
        ratios, body = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model.base_model(ids)
            t1 = time.perf_counter()
            tp.token_patch(model, ids, query="all")
            t2 = time.perf_counter()
            ratios.append((t2 - t1) / (t1 - t0))
            body.append(t1 - t0)
    return {
        "body_s": statistics.median(body),
        "x_body": statistics.median(ratios),
        "x_body_min": min(ratios),
        "x_body_max": max(ratios),
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hybrid_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    print(f"| model | mixer | body s | patch all / body (median, min-max of {args.repeats}) |")
    print("|---|---|---:|---:|")
    for name, mixer in MODELS:
        r = rows[name] = {"mixer": mixer, **measure(name, args)}
        print(
            f"| {name} | {mixer} | {r['body_s']:.3f} | {r['x_body']:.2f}x ({r['x_body_min']:.2f}-{r['x_body_max']:.2f}) |",
            flush=True,
        )
    meta = {k: getattr(args, k) for k in ("width", "layers", "length", "repeats", "threads")}
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, **meta, "models": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
