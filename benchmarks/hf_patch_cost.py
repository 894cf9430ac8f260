"""Cost of token patches and of ``tp.generate`` on real Hugging Face models, against one forward pass.

Claim (``docs/hugging-face.md``): a token patch of a transformers model costs one with-context
pass of its base model, each layer's patch made as the layer finishes from its recorded states (a
token alone's attention output is ``o_proj`` of its own values: no no-context pass), so patches
of every layer for all positions cost about one forward pass of the base model. Target: ``tp.token_patch(model,
ids, query="all")`` on a 512-token prompt <= 1.15x one with-context pass of the model's body
``model.base_model(ids)`` (without the LM head, which token_patch never runs).
``tp.generate`` costs one incremental with-context step plus two one-token passes per token,
against one incremental step for ordinary greedy decoding with the KV cache.

Setting: ``smollm2-135m`` (Llama, 30 layers) and ``gemma3-270m`` (Gemma 3, 18 layers, vocabulary
262k) from ``tokenpatch.workbench.zoo.pretrained``, float32, ``--threads`` torch threads, batch 1, a 512-token
prompt of random token ids from ``[100, 20000)`` (fixed seed; added/special tokens excluded).

Per ``(model, what)``, in a fresh subprocess (this file with a hidden ``--worker`` argument, the
result passed back as JSON on stdout): load the model and the inputs, record the RSS, run ``what``
once (the warm-up, and the call whose memory is measured), read ``ru_maxrss``; then ``--repeats``
rounds of ``what``, ``forward`` and ``body`` interleaved; per round the ratios of calls run side by side,
reported as the median of the rounds and their spread (min-max). ``what``:

* ``forward``       -- ``model(ids)`` under ``no_grad``: logits at all 512 positions (the unit);
* ``body``          -- ``model.base_model(ids)``: the same without the LM head (token_patch runs
                       the base model; Gemma's 262k-row head is over half of ``forward``);
* ``patch last``    -- ``tp.token_patch(model, ids)``: all layers, one query (the last position);
* ``patch all``     -- ``tp.token_patch(model, ids, query="all")``: all layers, all 512 positions;
* ``tp.generate``   -- ``tp.generate(model, ids[:, :64], max_new_tokens=N)``, time / N;
* ``HF generate``   -- ``model.generate(ids[:, :64], do_sample=False, max_new_tokens=N)`` with
                       ``generation_config.eos_token_id = None`` (runs the full N), time / N.
                       Both per-token times include the 64-token prefill (one pass of it each).

``x fwd`` / ``x body``: the time over ``forward`` / ``body`` timed in the same worker, interleaved
with it (same process, same load; the ``forward`` row's own ``x fwd`` is 1 by construction).
``first-touched MiB``: the minor page faults of the median round's call (and of the ``body`` call beside it),
as MiB: memory the kernel had to hand over and zero for it (4 KiB pages). The factors a call returns are
new memory, so at least their size is touched for the first time in every call; with the default
allocator about 0.07x of SmolLM2's body. ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's huge pages for large
tensors) or glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` change how much, and are
recorded with the results.
``peak MiB``: ``ru_maxrss`` of the worker (interpreter, torch, model, inputs, one call of ``what``);
``increase MiB``: that minus the RSS after loading the model and the inputs and reading every
weight once (the cached safetensors are memory-mapped: unread, the weights would count as part of
the first call); ``factors MiB``: the bytes of the patch returned (its factors and vectors), beside
the increase of the ``forward`` row (its activations and logits). Load average before
and after is recorded; run on an otherwise idle machine. On two cores shared with another busy
process, OpenMP's spin-waiting made whole workers ~10x slower here (``thought_fit.py``);
``OMP_WAIT_POLICY=PASSIVE`` (recorded with the results) avoided it.

Prints a markdown table; writes ``benchmarks/results/hf_patch_cost.json``.

    TOKENPATCH_CACHE=/tmp/tpcache python benchmarks/hf_patch_cost.py      # a few minutes
    OMP_WAIT_POLICY=PASSIVE python benchmarks/hf_patch_cost.py              # on a shared machine
    OMP_WAIT_POLICY=PASSIVE python benchmarks/hf_patch_cost.py --what forward,body,"patch all"   # the target only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.errors import UnsupportedModelError
from tokenpatch.lowrank import LowRank
from tokenpatch.workbench.zoo.pretrained import check_requirements, load_pretrained

sys.path.insert(0, str(Path(__file__).parent))
from patch_cost import write_results  # noqa: E402
from thought_fit import ENV_KEYS, maxrss_mib, rss_mib, run_worker  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")
WHATS = ("forward", "body", "patch last", "patch all", "tp.generate", "HF generate")
PER_TOKEN = ("tp.generate", "HF generate")
CONTEXT, PROMPT, LOW, HIGH = 512, 64, 100, 20000
TARGET = 1.15  # x body
# how the process gets fresh memory: PyTorch's huge pages for large tensors, glibc's malloc thresholds
MEMORY_ENV = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def log(msg: str) -> None:
    print(f"[hf_patch_cost] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- worker side
def random_ids(tokenizer, seed: int) -> torch.Tensor:
    """``[1, CONTEXT]`` ids drawn uniformly from ``[LOW, HIGH)`` minus the added and special tokens."""
    banned = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    pool = torch.tensor([i for i in range(LOW, HIGH) if i not in banned])
    return pool[torch.randint(len(pool), (1, CONTEXT), generator=torch.Generator().manual_seed(seed))]


def factors_mib(patch) -> float:
    """The memory held by a patch's deltas (low-rank factors and dense vectors), MiB."""
    tensors = []
    for name in patch:
        delta = patch[name]
        tensors += [delta.u, delta.v] if isinstance(delta, LowRank) else [delta]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def minor_faults() -> int:
    """The process's minor page faults so far (``ru_minflt``): each is a 4 KiB page touched for the first time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fns: dict, repeats: int) -> dict[str, list[tuple[float, float, int]]]:
    """Per key, the (wall seconds, CPU seconds, minor page faults) of each of ``repeats`` rounds, the calls
    interleaved within each round so that drift in machine load hits them alike (a round's ratios
    compare calls run side by side)."""
    rounds: dict[str, list[tuple[float, float, int]]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0, c0, f0 = time.perf_counter(), time.process_time(), minor_faults()
            fn()
            rounds[key].append((time.perf_counter() - t0, time.process_time() - c0, minor_faults() - f0))
    return rounds


def worker(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    model, tokenizer = load_pretrained(spec["model"], progress=False)  # cache_dir: $TOKENPATCH_CACHE
    ids, n = random_ids(tokenizer, spec["seed"]), spec["new_tokens"]
    prompt = ids[:, :PROMPT]
    model.generation_config.eos_token_id = None  # HF generate runs all n tokens
    out: dict = {}

    def hf_generate():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n)
        if got.shape[1] != PROMPT + n:
            raise RuntimeError(f"model.generate produced {got.shape[1] - PROMPT} tokens, not {n}")
        out["tokens"] = got[0, PROMPT:].tolist()

    def tp_generate():
        gen = tp.generate(model, prompt, max_new_tokens=n, progress=False)
        out.update(
            tokens=gen.tokens[0].tolist(), agree=int(gen.agree.sum()), max_logit_error=float(gen.logit_error.max())
        )

    forward, body = torch.no_grad()(model), torch.no_grad()(model.base_model)
    fns = {
        "forward": lambda: forward(ids),
        "body": lambda: body(ids),
        "patch last": lambda: out.update(factors_mib=factors_mib(tp.token_patch(model, ids, progress=False))),
        "patch all": lambda: out.update(
            factors_mib=factors_mib(tp.token_patch(model, ids, query="all", progress=False))
        ),
        "tp.generate": tp_generate,
        "HF generate": hf_generate,
    }
    with torch.no_grad():  # the weights are memory-mapped: page them in, or the first call's RSS includes them
        for t in [*model.parameters(), *model.buffers()]:
            t.sum()
    gc.collect()
    baseline = rss_mib()
    fns[spec["what"]]()  # warm-up: the call whose memory is measured
    peak = maxrss_mib()
    fns["forward"](), fns["body"]()  # their warm-ups
    rounds = timed({k: fns[k] for k in dict.fromkeys((spec["what"], "forward", "body"))}, spec["repeats"])
    unit = n if spec["what"] in PER_TOKEN else 1
    walls = {k: [w for w, _, _ in v] for k, v in rounds.items()}
    # per round, the call over the forward / body run beside it; the median of the rounds, and their spread
    x_forward = [w / unit / f for w, f in zip(walls[spec["what"]], walls["forward"])]
    x_body = [w / unit / b for w, b in zip(walls[spec["what"]], walls["body"])]
    seconds = statistics.median(walls[spec["what"]])
    c = model.config
    out.update(
        seconds=seconds,
        cpu_s=statistics.median(cpu for _, cpu, _ in rounds[spec["what"]]),
        faults=statistics.median(f for _, _, f in rounds[spec["what"]]),
        body_faults=statistics.median(f for _, _, f in rounds["body"]),
        per_unit_s=seconds / unit,
        forward_s=statistics.median(walls["forward"]),
        body_s=statistics.median(walls["body"]),
        x_forward=statistics.median(x_forward),
        x_body=statistics.median(x_body),
        x_body_rounds=x_body,
        x_body_fastest=min(walls[spec["what"]]) / unit / min(walls["body"]),
        peak_mib=peak,
        baseline_rss_mib=baseline,
        increase_mib=peak - baseline,
        layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        d_mlp=c.intermediate_size,
        vocab=c.vocab_size,
    )
    sys.stdout.write("\n" + json.dumps({**spec, **out}) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- driver side
def touched_mib(faults: float) -> float:
    """Minor page faults as MiB of memory touched for the first time (4 KiB pages)."""
    return faults * 4 / 1024


def note(row: dict, rows: list[dict]) -> str:
    """The generate rows: tp.generate against HF decoding per token, and whether the tokens match."""
    if row["what"] != "tp.generate":
        return ""
    hf = next((r for r in rows if r["model"] == row["model"] and r["what"] == "HF generate" and "error" not in r), None)
    text = f"with-context argmax agrees {row['agree']}/{len(row['tokens'])}"
    if hf is None:
        return text
    same = sum(a == b for a, b in zip(row["tokens"], hf["tokens"]))
    return (
        f"{row['per_unit_s'] / hf['per_unit_s']:.2f}x HF decoding per token; tokens = HF's {same}/{len(hf['tokens'])}; "
        + text
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per configuration after a warm-up, the median reported"
    )
    ap.add_argument(
        "--what", default=",".join(WHATS), help=f"comma-separated rows to measure (default: all of {', '.join(WHATS)})"
    )
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated by the two generate rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per worker process before it is abandoned")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_patch_cost.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    whats = [w.strip() for w in args.what.split(",") if w.strip()]
    unknown = [w for w in whats if w not in WHATS]
    if unknown:
        sys.exit(f"hf_patch_cost: --what {unknown}: not a row; choose among {', '.join(WHATS)}")
    models = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            check_requirements(name)
            models.append(name)
        except (UnsupportedModelError, tp.InputError) as exc:
            log(f"skipping {name}: {exc}")
    if not models:
        sys.exit("hf_patch_cost: no model can be loaded here (see above); nothing measured")
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    if load_before > 0.5:
        log(
            f"warning: 1-minute load average {load_before:.2f} before starting: another process is busy, the "
            "timings will not be reliable"
        )

    rows = []
    for name in models:
        for what in whats:
            log(f"{name} {what} ...")
            spec = {
                "model": name,
                "what": what,
                "threads": args.threads,
                "repeats": args.repeats,
                "new_tokens": args.new_tokens,
                "seed": args.seed,
            }
            row = run_worker(spec, args.timeout, script=__file__)
            rows.append(row)
            log(
                f"{name} {what}: "
                + (
                    row["error"]
                    if "error" in row
                    else f"{row['per_unit_s']:.3f} s, {row['x_forward']:.2f}x forward, peak {row['peak_mib']:.0f} MiB"
                )
            )
    total, load_after = time.perf_counter() - start, os.getloadavg()[0]

    print(
        "| model | what | seconds | x fwd | x body | x body spread | peak MiB | increase MiB | factors MiB "
        "| first-touched MiB (body's) | note |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['what']} | {r['error']} | | | | | | | | |")
            continue
        factors = f"{r['factors_mib']:.0f}" if "factors_mib" in r else ""
        unit = " / token" if r["what"] in PER_TOKEN else ""
        print(
            f"| {r['model']} | {r['what']} | {r['per_unit_s']:.3f}{unit} | {r['x_forward']:.2f} | {r['x_body']:.2f} "
            f"| {min(r['x_body_rounds']):.2f}-{max(r['x_body_rounds']):.2f} "
            f"| {r['peak_mib']:.0f} | {r['increase_mib']:.0f} | {factors} "
            f"| {touched_mib(r['faults']):.0f} ({touched_mib(r['body_faults']):.0f}) | {note(r, rows)} |"
        )
    print(
        f"\nprompt {CONTEXT} random tokens (generate: its first {PROMPT}, {args.new_tokens} new tokens, time / token "
        f"incl. the prefill); x fwd / x body: over model(ids) / model.base_model(ids) on the {CONTEXT} tokens, "
        f"timed interleaved in the same worker, the median of {args.repeats} rounds (spread: their min-max); seconds: "
        "the median call; peak: ru_maxrss of the worker; increase: over its RSS after loading "
        "(weights paged in); first-touched: minor page faults of the median round, as MiB."
    )
    verdicts = {}
    for name in models:
        r = next((r for r in rows if r["model"] == name and r["what"] == "patch all"), None)
        if r is None or "error" in r:
            print(f"{name}: all positions: not measured ({r['error'] if r else 'no row'})")
            continue
        verdicts[name] = r["x_body"] <= TARGET
        fwd = next((f for f in rows if f["model"] == name and f["what"] == "forward" and "error" not in f), None)
        memory = f"; factors {r['factors_mib']:.0f} MiB" + (
            f" (the forward's increase: {fwd['increase_mib']:.0f} MiB)" if fwd else ""
        )
        memory += (
            f"; memory touched for the first time per call {touched_mib(r['faults']):.0f} MiB "
            f"(the body's beside it: {touched_mib(r['body_faults']):.0f} MiB)"
        )
        print(
            f"{name}: patches of all layers and all {CONTEXT} positions cost {r['x_body']:.2f}x the body's forward "
            f"(median of {len(r['x_body_rounds'])} rounds, spread {min(r['x_body_rounds']):.2f}-{max(r['x_body_rounds']):.2f}) "
            f"without the LM head ({r['x_forward']:.2f}x the full forward){memory}; target <= {TARGET}x the body: "
            f"{'met' if verdicts[name] else 'NOT met'}"
        )
    print(
        f"total {total:.0f} s, {args.threads} threads; 1-minute load average {load_before:.2f} before, "
        f"{load_after:.2f} after (this run alone accounts for up to ~{args.threads})"
    )
    rows.append(
        {
            "kind": "run",
            "total_s": total,
            "models": models,
            "target": TARGET,
            "target_met": verdicts,
            "cpu_count": os.cpu_count(),
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": load_after,
            "processor": platform.processor(),
            "env": {k: os.environ.get(k) for k in (*ENV_KEYS, *MEMORY_ENV)},
        }
    )
    write_results(args, rows)


if __name__ == "__main__":
    main()
