"""Cost of ``tp.thought_patch``: time, peak memory, the least-squares share, streamed = one-shot.

Claims (``tokenpatch/thought.py``): the fit keeps only float64 sums, so with ``cache_bytes=0``
("streaming": the calibration states are recomputed from the inputs at every pass) its memory
does not grow with the number of calibration queries ``m``; with the default ``cache_bytes``
("cached": the per-layer states of all queries kept between layers while they fit) it is faster
and its memory grows as ``O(m)``. Targets: the least-squares work costs <= 20% of the forward
passes the fit needs, and the streamed fit agrees with the one-shot fit to 1e-10 in float64.

Setting: the shipped model in float64, a 16-token linear-regression prompt, ``m`` one-token
calibration queries ``[x; 0]`` (``x ~ N(0, I_4)``), default options (sequential, affine output,
ridge 0, batch_size 4096).

Per ``(m, mode)``, in a fresh subprocess (this file run with a hidden ``--worker`` argument,
the result passed back as JSON on stdout):

* ``seconds``  -- wall time of one ``tp.thought_patch`` call (best of ``--repeats``), after a
  warm-up fit on the first 64 queries (one-time library initialisation is not timed);
* ``peak MiB`` -- ``ru_maxrss`` of the worker at the end (whole process: interpreter, torch,
  model, queries, fit); ``increase MiB`` -- that minus the resident set measured after loading
  the model, building the queries and the warm-up fit, i.e. what the fit itself adds. The
  queries tensor (``m x 1 x 5`` float64, ``O(m)`` by itself) is built before that baseline:
  it counts in ``peak`` but not in ``increase``;
* ``LS ratio`` -- the time spent inside ``Sums.add``, ``solve``, ``residual`` and ``factor``
  (wrapped with timers in the worker only; an inner call of one in another is not counted
  twice) over the rest of the fit (forward passes, patch hooks, bookkeeping).

Agreement (at ``--agree-size``, default m = 1e4): ``max`` over the patch's deltas of
``max|a - b| / max|a|``, ``a`` the streamed fit (``batch_size=333, cache_bytes=0``) and ``b`` the
one-shot fit (``batch_size=m``, default cache), deltas dense (``LowRank.dense()``). At ridge 0 (the
default options, the number held against the target) and, for comparison, at ridge 1e-4: the two
fits sum the same terms in a different order, so they differ by about eps x the condition number
of the Gram matrices solved (recorded), which is 1e9-1e11 here at ridge 0.

Timing note: run it on an otherwise idle machine. With ``--threads 2`` on two cores shared with
another busy process (or an oversubscribed VM), OpenMP's spin-waiting made every fit 10-200x
slower here (m = 1e3 cached: 58 s instead of 0.3 s); the worker inherits the environment, so
``OMP_WAIT_POLICY=PASSIVE`` or ``--threads 1`` limits the damage. The load average before and
after, the CPU time of each fit and the OpenMP environment are recorded in the results.

Prints a markdown table; writes ``benchmarks/results/thought_fit.json``.

    python benchmarks/thought_fit.py                        # m = 1e3, 1e4, 1e5 (a few minutes)
    python benchmarks/thought_fit.py --sizes 1000,10000     # quicker
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import tokenpatch as tp

sys.path.insert(0, str(Path(__file__).parent))
from patch_cost import write_results  # noqa: E402

MODES = {
    "cached": {},
    "streaming": {"cache_bytes": 0},
    "cached, qr": {"solver": "qr"},
    "streaming, qr": {"cache_bytes": 0, "solver": "qr"},
}
LS_FUNCTIONS = ("solve", "residual", "factor")  # module-level functions; plus the method Sums.add
WARMUP = 64
ENV_KEYS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def log(msg: str) -> None:
    print(f"[thought_fit] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- worker side
def rss_mib() -> float:
    """The current resident set of this process (Linux ``/proc``), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmRSS in /proc/self/status")


def maxrss_mib() -> float:
    """``ru_maxrss`` of this process, MiB (kilobytes on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def setting(m: int, seed: int):
    model = tp.load_model(dtype="float64")
    prompt = (
        tp.tasks.linreg.task_of(model)
        .sample(1, torch.Generator().manual_seed(seed), dtype=torch.float64)
        .tokens[0, :-1]
    )  # [16, 5]
    g = torch.Generator().manual_seed(seed + 1)
    queries = torch.cat(
        [torch.randn(m, 1, 4, generator=g, dtype=torch.float64), torch.zeros(m, 1, 1, dtype=torch.float64)], -1
    )  # [m, 1, 5]
    return model, prompt, queries


class LSTimer:
    """Wall time spent inside the least-squares functions, outermost calls only."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.depth = 0
        self.targets: list[str] = []

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1

        return timed

    def install(self) -> None:
        """Wrap the functions where ``thought.py`` looks them up (its module globals) and where
        they are defined (``tokenpatch.thought.lstsq`` when present, for calls made there); ``Sums.add``
        on the class itself."""
        thought = importlib.import_module("tokenpatch.thought.front")
        try:
            modules = [thought, importlib.import_module("tokenpatch.thought.lstsq")]
        except ImportError:
            modules = [thought]
        for name in LS_FUNCTIONS:
            if not hasattr(thought, name):
                raise RuntimeError(f"tokenpatch.thought.front has no {name}: update LS_FUNCTIONS in {__file__}")
            for mod in modules:
                if hasattr(mod, name):
                    setattr(mod, name, self.wrap(name, getattr(mod, name)))
                    self.targets.append(f"{mod.__name__}.{name}")
        sums = next((mod.Sums for mod in modules if hasattr(mod, "Sums")), None)
        if sums is None:
            raise RuntimeError(f"no Sums class in {[mod.__name__ for mod in modules]}")
        sums.add = self.wrap("Sums.add", sums.add)
        self.targets.append(f"{sums.__module__}.Sums.add")
        qr = next((mod.QR for mod in modules if hasattr(mod, "QR")), None)
        if qr is not None:  # the streamed-QR accumulator (solver="qr")
            qr.add = self.wrap("QR.add", qr.add)
            self.targets.append(f"{qr.__module__}.QR.add")

    def reset(self) -> None:
        self.seconds, self.calls = {}, {}

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def record_cache_decision() -> list:
    """Wrap ``_Source.__init__`` so the worker can report whether the fit kept the states."""
    thought = importlib.import_module("tokenpatch.thought.front")
    seen: list = []
    source = getattr(thought, "_Source", None)
    if source is None:
        return seen
    init = source.__init__

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(getattr(self, "cached", None))

    source.__init__ = wrapped
    return seen


def fit_worker(spec: dict) -> dict:
    m, mode, repeats = spec["m"], spec["mode"], spec["repeats"]
    options = dict(MODES[mode], progress=False)
    model, prompt, queries = setting(m, spec["seed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.thought_patch(model, prompt, queries[:WARMUP], **options)  # one-time initialisation
    gc.collect()
    baseline, maxrss_before = rss_mib(), maxrss_mib()
    timer, cached = LSTimer(), record_cache_decision()
    timer.install()
    best = None
    for _ in range(repeats):
        timer.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0, c0 = time.perf_counter(), time.process_time()
            fit = tp.thought_patch(model, prompt, queries, **options)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or seconds < best["seconds"]:
            best = {
                "seconds": seconds,
                "cpu_s": cpu,
                "ls_s": timer.total,
                "ls_breakdown_s": dict(timer.seconds),
                "ls_calls": dict(timer.calls),
                "warnings": len(caught),
            }
        del fit
    peak = maxrss_mib()
    c = model.config
    return {
        "kind": "fit",
        "m": m,
        "mode": mode,
        **best,
        "forward_s": best["seconds"] - best["ls_s"],
        "ls_ratio": best["ls_s"] / (best["seconds"] - best["ls_s"]),
        "peak_mib": peak,
        "baseline_rss_mib": baseline,
        "increase_mib": peak - baseline,
        "maxrss_before_fit_mib": maxrss_before,
        "queries_mib": queries.numel() * queries.element_size() / 2**20,
        "states_cached": cached[-1] if cached else None,
        "cached_states_mib": 2 * m * queries.shape[1] * c.d_model * 8 / 2**20,
        "ls_targets": timer.targets,
        "batch_size": 4096,
        "d_model": c.d_model,
        "layers": c.n_layers,
    }


def dense(delta) -> torch.Tensor:
    return delta.dense() if isinstance(delta, tp.LowRank) else delta


def agree_worker(spec: dict) -> dict:
    m, ridge = spec["m"], spec["ridge"]
    model, prompt, queries = setting(m, spec["seed"])
    out = {"kind": "agreement", "m": m, "ridge": ridge, "solver": spec.get("solver", "normal")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        solver = spec.get("solver", "normal")
        a = tp.thought_patch(
            model, prompt, queries, ridge=ridge, batch_size=333, cache_bytes=0, solver=solver, progress=False
        ).patch
        out["streamed_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fit = tp.thought_patch(model, prompt, queries, ridge=ridge, batch_size=m, solver=solver, progress=False)
        b = fit.patch
        out["one_shot_s"] = time.perf_counter() - t0
    out["warnings"] = len(caught)
    conds = [c for f in fit.fits for c in (f.input_condition, f.output_condition) if c is not None]
    out["max_condition"] = max(conds) if conds else None
    if set(a.keys()) != set(b.keys()):
        raise RuntimeError(f"the two fits patch different parameters: {sorted(set(a) ^ set(b))}")
    per = {}
    for name in a.keys():
        da, db = dense(a[name]).double(), dense(b[name]).double()
        scale = float(da.abs().max())
        per[name] = float((da - db).abs().max()) / scale if scale > 0 else float((da - db).abs().max())
    worst = max(per, key=per.get)
    out.update(rel_diff=per[worst], worst_delta=worst, per_delta=per, target=1e-10, met=per[worst] <= 1e-10)
    # what the patches do: the patched no-prompt model on fresh queries (well determined even where
    # the solution's components along near-null directions of an ill-conditioned system are not)
    test = torch.cat(
        [
            torch.randn(1000, 1, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64),
            torch.zeros(1000, 1, 1, dtype=torch.float64),
        ],
        -1,
    )
    with torch.no_grad():
        ya, yb = tp.functional_call(model, a, test), tp.functional_call(model, b, test)
    out["output_rel_diff"] = float((ya - yb).abs().max() / yb.abs().max())
    return out


def worker(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    result = fit_worker(spec) if spec["kind"] == "fit" else agree_worker(spec)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- driver side
def run_worker(spec: dict, timeout: float, script: str = __file__) -> dict:
    """``script`` (this file by default) in a fresh interpreter with ``--worker spec``; the JSON it
    prints last (or an ``error`` entry). Other benchmarks run their own workers through it."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        return {**spec, "error": f"worker exited with status {proc.returncode}", "stdout_tail": proc.stdout[-2000:]}
    return {**json.loads(lines[-1]), "worker_wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000", help="comma-separated m (numbers like 1e4 allowed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="fits per configuration, the fastest reported")
    ap.add_argument(
        "--agree-size", type=float, default=1e4, help="m of the streamed/one-shot agreement check (0: skip)"
    )
    ap.add_argument(
        "--agree-ridges",
        default="0,1e-4",
        help="ridge of each agreement check: 0 (the default options) is the one reported against the "
        "target; a ridge that conditions the systems shows what rounding alone does",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per worker process before it is abandoned")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "thought_fit.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    torch.set_num_threads(args.threads)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    if load_before > 0.5:
        log(
            f"warning: 1-minute load average {load_before:.2f} before starting: another process is busy, the "
            "timings will not be reliable"
        )

    rows = []
    for m in sizes:
        for mode in MODES:
            log(f"m = {m:,} {mode} ...")
            spec = {
                "kind": "fit",
                "m": m,
                "mode": mode,
                "threads": args.threads,
                "repeats": args.repeats,
                "seed": args.seed,
            }
            row = run_worker(spec, args.timeout)
            rows.append(row)
            log(
                f"m = {m:,} {mode}: "
                + (
                    row["error"]
                    if "error" in row
                    else f"{row['seconds']:.2f} s, peak {row['peak_mib']:.0f} MiB (+{row['increase_mib']:.1f}), "
                    f"LS ratio {row['ls_ratio']:.1%}"
                )
            )
    agreements = []
    if args.agree_size:
        m = int(args.agree_size)
        for solver, ridge in [
            (sv, float(r)) for sv in ("normal", "qr") for r in args.agree_ridges.split(",") if r.strip()
        ]:
            log(
                f"agreement at m = {m:,}, {solver}, ridge {ridge:g} (streamed batch 333 / cache_bytes=0 against "
                f"one-shot batch {m}) ..."
            )
            spec = {
                "kind": "agree",
                "m": m,
                "ridge": ridge,
                "solver": solver,
                "threads": args.threads,
                "seed": args.seed,
            }
            agreements.append(run_worker(spec, args.timeout))
            a = agreements[-1]
            log("agreement: " + (a["error"] if "error" in a else f"{a['rel_diff']:.2e}"))
        rows.extend(agreements)
    total = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    rows.append(
        {
            "kind": "run",
            "total_s": total,
            "sizes": sizes,
            "cpu_count": os.cpu_count(),
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": load_after,
            "processor": platform.processor(),
            "env": {k: os.environ.get(k) for k in ENV_KEYS},
        }
    )

    print("| m | mode | seconds | peak MiB | increase MiB | LS ratio |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if r.get("kind") != "fit":
            continue
        if "error" in r:
            print(f"| {r['m']:,} | {r['mode']} | {r['error']} | | | |")
            continue
        print(
            f"| {r['m']:,} | {r['mode']} | {r['seconds']:.2f} | {r['peak_mib']:.1f} | {r['increase_mib']:.1f} "
            f"| {r['ls_ratio']:.1%} |"
        )
    fits = [r for r in rows if r.get("kind") == "fit" and "error" not in r]
    if fits:
        big = max(fits, key=lambda r: r["m"])
        print(
            f"\npeak: whole worker process (ru_maxrss); increase: over its RSS after loading the model, building the "
            f"queries and a {WARMUP}-query warm-up fit. The queries tensor is O(m) ({big['queries_mib']:.3g} MiB at "
            f"m = {big['m']:,}): in peak, not in increase. Cached mode budgets 2 x m x d_model float64 states "
            f"({big['cached_states_mib']:.0f} MiB at m = {big['m']:,}) while they fit in cache_bytes (2**30)."
        )
        worst = max(fits, key=lambda r: r["ls_ratio"])
        print(
            f"LS ratio = time in Sums.add/solve/residual/factor over the rest of the fit; target <= 20%: "
            f"{'met' if worst['ls_ratio'] <= 0.2 else 'NOT met'} (worst {worst['ls_ratio']:.1%}, m = "
            f"{worst['m']:,} {worst['mode']})"
        )
    for a in agreements:
        if "error" in a:
            print(f"agreement at m = {a['m']:,}, ridge {a['ridge']:g}: {a['error']}")
            continue
        print(
            f"solver {a['solver']}: streamed (batch 333, cache_bytes=0) vs one-shot (batch {a['m']:,}) at m = {a['m']:,}, ridge "
            f"{a['ridge']:g}: max rel. diff {a['rel_diff']:.2e} ({a['worst_delta']}; largest condition number "
            f"{a['max_condition']:.1e}); target 1e-10: {'met' if a['met'] else 'NOT met'}; patched outputs on 1000 "
            f"fresh queries differ by {a['output_rel_diff']:.2e} (relative to their max)"
        )
    print(
        f"total {total:.0f} s, {args.threads} threads; 1-minute load average {load_before:.2f} before, "
        f"{load_after:.2f} after (this run alone accounts for up to ~{args.threads})"
    )
    write_results(args, rows)


if __name__ == "__main__":
    main()
