"""The Markov-chain section of the report: training curves against the four ideal predictors,
the phase diagram over K x steps with K*_1 and K*_2, tau(N), circuit probes, phi patching and
the bridge to token patches (``docs/markov.md``). ``tokenpatch markov report`` runs it at full
scale; ``tokenpatch reproduce`` runs the ``REDUCED`` preset."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402

from tokenpatch.interp.bridge import phase_bridge
from tokenpatch.interp.circuits import (
    ablated,
    attention_patterns,
    chain_probe,
    phi,
    phi_patching,
    previous_token_score,
    statistical_induction_score,
)
from tokenpatch.interp.phases import cross_entropy
from tokenpatch.models.markov import MarkovModel, log_probs, model_inputs
from tokenpatch.stats import half_width
from tokenpatch.tasks.markov import STREAMS, MarkovTask
from tokenpatch.workbench.report.markov_figures import curves_figure, phase_figure, tau_figure
from tokenpatch.workbench.report.section import Section
from tokenpatch.workbench.train.markov import MarkovTrain, load_run
from tokenpatch.workbench.train.shipped import place_shipped
from tokenpatch.workbench.train.sweep import k_star, sweep_chains, sweep_lengths, transition_step

__all__ = ["FULL", "REDUCED", "markov_section", "probe_run"]

FULL = {
    "chains": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    "seeds": (0, 1, 2),
    "steps": 4000,
    "lengths": (16, 32, 64, 128),
    "length_seeds": (0, 1),
    "length_chains": 4096,
    "show": (4, 1024),
}
REDUCED = {
    "chains": (2, 16, 128, 1024),
    "seeds": (0,),
    "steps": 2000,
    "lengths": (),
    "length_seeds": (),
    "length_chains": 4096,
    "show": (2, 1024),
}


def probe_run(run_dir: Path, seed: int = 0) -> dict:
    """Circuit probes, ablations, phi patching and the bridge on one finished run (any depth and
    head count; phi patching and the chain probe need K >= 2)."""
    import torch

    model, task, meta = load_run(run_dir)
    batch = task.sample(256, np.random.default_rng([seed, STREAMS["probe"]]), "train")
    x = model_inputs(model, task, batch.states)
    pats = attention_patterns(model, x)

    def loss() -> float:
        return cross_entropy(log_probs(model, task, batch.states), batch.states).mean().item()

    ablations = {"clean": loss()}
    for l, block in enumerate(model.blocks):
        for h in range(block.mixer.n_heads):
            with ablated(model, heads=[(l, h)]):
                ablations[f"layer {l + 1} head {h}"] = loss()
        with ablated(model, mlps=[l]):
            ablations[f"layer {l + 1} MLP"] = loss()
    out = {
        "chains": task.chains,
        "layers": len(model.blocks),
        "final_label": meta["history"][-1]["train"]["label"],
        "references": meta["references"]["train"],
        "previous_token_score": previous_token_score(pats[0]).tolist(),  # per layer-1 head
        "ablation_loss": ablations,
    }
    if len(pats) > 1:
        score, base = statistical_induction_score(pats[1], batch.states)
        out["induction_score"], out["induction_baseline"] = score.tolist(), base  # per layer-2 head
    if task.chains >= 2:
        out["phi_patching"] = phi_patching(model, task, 256, seed=seed)
        if task.chains <= 64:  # enough sequences per chain for a held-out split
            out["chain_probe"] = chain_probe(phi(model, x), batch.chain, seed=seed)
    with torch.no_grad():
        out["bridge"] = phase_bridge(model, task, sequences=32, seed=seed)
    return out


def markov_section(
    out: Path,
    preset: dict = REDUCED,
    task: MarkovTask = MarkovTask(),
    shape: MarkovModel = MarkovModel(),
    workers: int = 2,
    progress: bool | None = None,
    runs_dir: Path | None = None,
    shipped: bool = True,
):
    """Run the sweeps of ``preset`` (runs kept under ``runs_dir``, default ``out/markov-runs``,
    so a second call reads them back) and return the report ``Section``. ``shipped``: with the
    ``REDUCED`` preset and the default task and model, start from the runs shipped with tokenpatch
    (``train.shipped``: read back, not trained again); ``False`` trains them."""
    t0 = time.perf_counter()
    out = Path(out)
    runs_dir = Path(runs_dir or out / "markov-runs")
    cfg = MarkovTrain(steps=preset["steps"])
    placed = []
    if shipped and preset == REDUCED and task == MarkovTask() and shape == MarkovModel():
        for k in preset["chains"]:
            run = f"K{k:05d}-s{preset['seeds'][0]}"
            if place_shipped(f"markov-{run}", runs_dir / "chains" / run / "model.safetensors"):
                placed.append(k)
    summary = sweep_chains(runs_dir / "chains", preset["chains"], preset["seeds"], task, shape, cfg, workers, progress)
    stars = k_star(summary)
    lengths = None
    if preset["lengths"]:
        lengths = sweep_lengths(
            runs_dir / "lengths",
            preset["lengths"],
            preset["length_seeds"],
            replace(task, chains=preset["length_chains"]),
            shape,
            cfg,
            workers,
            progress,
        )
        minimal = sweep_lengths(
            runs_dir / "minimal",
            (task.length,),
            preset["length_seeds"],
            replace(task, chains=preset["length_chains"]),
            replace(shape, minimal=True),
            cfg,
            workers,
            progress,
        )
    seed = preset["seeds"][0]
    small, large = preset["show"]
    show = {k: runs_dir / "chains" / f"K{k:05d}-s{seed}" for k in (small, large)}
    hist = {k: next(r["history"] for r in summary["runs"] if r["chains"] == k and r["seed"] == seed) for k in show}
    refs = {k: load_run(d)[2]["references"] for k, d in show.items()}
    figs = [
        curves_figure(
            {f"K = {k} training chains (seed {seed})": (hist[k], refs[k]) for k in show}, out / "markov-curves.png"
        ).name,
        phase_figure(summary, stars, out / "markov-phases.png").name,
    ]
    if lengths:
        figs.append(tau_figure(lengths, out / "markov-tau.png").name)
    probes = {str(k): probe_run(d, seed) for k, d in show.items()}
    data = {
        "task": task.to_dict(),
        "model": shape.to_dict(),
        "train": cfg.to_dict(),
        "preset": {k: list(v) if isinstance(v, tuple) else v for k, v in preset.items()},
        "k_star": stars,
        "shipped_runs": placed,
        "probes": probes,
        "seconds": time.perf_counter() - t0,
        "final": [
            {
                "chains": r["chains"],
                "seed": r["seed"],
                "step": r["history"][-1]["step"],
                "train": r["history"][-1]["train"],
                "fresh": r["history"][-1]["fresh"],
                "g1_to_g2": transition_step(r["history"]),
            }
            for r in summary["runs"]
        ],
    }
    if lengths:
        data["lengths"] = {
            "runs": [{k: r[k] for k in ("length", "seed", "tau")} for r in lengths["runs"]],
            "fit": lengths["fit"],
        }
        data["minimal"] = [
            {
                "seed": r["seed"],
                "tau": r["tau"],
                "loss": r["history"][-1]["fresh"]["loss"],
                "label": r["history"][-1]["fresh"]["label"],
                "full_tau": next(
                    (f["tau"] for f in lengths["runs"] if f["length"] == task.length and f["seed"] == r["seed"]), None
                ),
                "full_loss": next(
                    (
                        f["history"][-1]["fresh"]["loss"]
                        for f in lengths["runs"]
                        if f["length"] == task.length and f["seed"] == r["seed"]
                    ),
                    None,
                ),
            }
            for r in minimal["runs"]
        ]
    body = _markdown(data, figs, hist, refs, show)
    return Section("markov", "Markov-chain ICL phases", body, figs, _snake(data))


def _snake(obj):
    """The report's JSON keys in snake_case (``"2-gen"`` -> ``"2_gen"``, ``"layer-1 head"`` -> ``"layer_1_head"``)."""
    if isinstance(obj, dict):
        return {str(k).replace("-", "_").replace(" ", "_").lower(): _snake(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snake(v) for v in obj]
    return obj


def _fmt_star(s) -> str:
    if s is None:
        return "not found in the grid"
    return f"{s['geomean']:.3g} (geometric mean over {s['found']}/{s['seeds']} seeds; range {s['min']}-{s['max']})"


def _bracket(b, left: str, right: str) -> str:
    if b is None:
        return "not found"
    return f"in {left}{b[0]}, {'inf' if b[1] is None else b[1]}{right}"


def _markdown(data: dict, figs: list[str], hist: dict, refs: dict, show: dict) -> str:
    t, m, c = data["task"], data["model"], data["train"]
    lines = [
        f"Task: C = {t['states']} states, rows ~ Dirichlet({t['alpha']}), N = {t['length']}, x_1 ~ pi; model: "
        f"{m['n_layers']}-layer transformer, d_model {m['d_model']}, {m['n_heads']} head(s), learned positions; "
        f"AdamW lr {c['lr']}, batch {c['batch_size']}, {c['steps']} steps. Labels: least `KL(predictor || model)` "
        "on 256 sequences from the training chains (U uniform, G1/G2 1-/2-gen, M1/M2 1-/2-mem; `A/B`: within 0.01 nats).",
        *(
            [
                f"The runs K = {', '.join(map(str, data['shipped_runs']))} were trained by this recipe and shipped "
                "with tokenpatch (read back here; `tokenpatch reproduce --full` trains them)."
            ]
            if data.get("shipped_runs")
            else []
        ),
        "",
        f"![training curves]({figs[0]})",
        "",
        "| K | final label | loss | 1-gen | 2-gen | 1-mem | 2-mem | true |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in show:
        r = refs[k]["train"]
        h = hist[k][-1]["train"]
        lines.append(
            f"| {k} | {h['label']} | {h['loss']:.3f} | {r['1-gen']:.3f} | {r['2-gen']:.3f} | {r['1-mem']:.3f} | "
            f"{r['2-mem']:.3f} | {r['true']:.3f} |"
        )
        seq = [hh["train"]["label"] for hh in hist[k]]
        lines.append(
            f"|   | labels over training: {' -> '.join(x for i, x in enumerate(seq) if i == 0 or x != seq[i - 1])} | | | | | | |"
        )
    s = data["k_star"]
    lines += [
        "",
        f"![phase diagram]({figs[1]})",
        "",
        f"- K*_1 (smallest K closer to 2-gen than to 2-mem on fresh chains at the end): {_fmt_star(s['k1'])}",
        f"- K*_2 (largest K whose final model is nearest to 2-mem on its training chains): {_fmt_star(s['k2'])}",
        "- per seed (the grid brackets each estimate): "
        + "; ".join(
            f"seed {seed}: K*_1 {_bracket(v['k1_bracket'], '(', ']')}, K*_2 {_bracket(v['k2_bracket'], '[', ')')}"
            for seed, v in s["per_seed"].items()
        ),
    ]
    if "lengths" in data:
        f = data["lengths"]["fit"]
        lines += ["", f"![tau vs N]({figs[2]})", "", "| N | seed | tau (steps) |", "|---|---|---|"]
        lines += [
            f"| {r['length']} | {r['seed']} | {'-' if r['tau'] is None else round(r['tau'])} |"
            for r in data["lengths"]["runs"]
        ]
        if "power" in f:
            lines += [
                "",
                f"Fits in log space: tau = {f['n_over_log_n']['c']:.3g} N/log N (rms log residual "
                f"{f['n_over_log_n']['rms_log']:.3f}); tau = {f['power']['c']:.3g} N^{f['power']['a']:.2f} "
                f"(rms {f['power']['rms_log']:.3f}).",
            ]
    if "minimal" in data:
        lines += [
            "",
            f"The minimal model (paper A's eq. XII7: layer 1 replaced by the hard previous-state "
            f"concatenation, one layer reading [x_n; x_(n-1); n]) at N = {t['length']}, the same K and steps, "
            "on fresh chains:",
            "",
            "| seed | tau, minimal | tau, 2-layer | final loss, minimal | final loss, 2-layer | final label, minimal |",
            "|---|---|---|---|---|---|",
        ]
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        loss = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines += [
            f"| {m['seed']} | {fmt(m['tau'])} | {fmt(m['full_tau'])} | {loss(m['loss'])} | {loss(m['full_loss'])} | "
            f"{m['label']} |"
            for m in data["minimal"]
        ]
    lines += [
        "",
        "Circuits, phi patching and the bridge to token patches (256 training-chain sequences; "
        "KL to the donor / recipient chain's row at the final state, mean ± 95% half-width):",
        "",
    ]
    lines += [
        "| K | phase | prev-token score, layer-1 heads | stat.-induction score, layer-2 heads (uniform) | "
        "loss: clean, then each head and MLP ablated (zero) |",
        "|---|---|---|---|---|",
    ]
    for k, p in data["probes"].items():
        ind = (
            "-"
            if "induction_score" not in p
            else (f"{', '.join(f'{v:.2f}' for v in p['induction_score'])} ({p['induction_baseline']:.2f})")
        )
        abl = "; ".join(f"{name} {v:.3f}" for name, v in p["ablation_loss"].items())
        lines.append(
            f"| {k} | {p['final_label']} | {', '.join(f'{v:.2f}' for v in p['previous_token_score'])} | {ind} | {abl} |"
        )
    lines += ["", "| K | phi from | KL to donor | KL to recipient |", "|---|---|---|---|"]
    for k, p in data["probes"].items():
        for cond, row in p.get("phi_patching", {}).items():
            don, rec = row["kl_donor"], row["kl_recipient"]
            lines.append(
                f"| {k} | {cond.replace('_', ' ')} | {don['mean']:.3f} ± {half_width(don):.3f} | "
                f"{rec['mean']:.3f} ± {half_width(rec):.3f} |"
            )
    lines += [
        "",
        "| K | chain probe on phi (accuracy / chance) | cos(phi, thought vector) raw / centred / context part | "
        "token patch norm per layer | step-norm exponent per layer |",
        "|---|---|---|---|---|",
    ]
    for k, p in data["probes"].items():
        b = p["bridge"]
        probe = f"{p['chain_probe']['accuracy']:.2f} / {p['chain_probe']['chance']:.2f}" if "chain_probe" in p else "-"
        lines.append(
            f"| {k} | {probe} | {b['phi_cosine']['raw']:.2f} / {b['phi_cosine']['centred']:.2f} / "
            f"{b['phi_cosine']['context_vector']:.2f} | {', '.join(f'{v:.2f}' for v in b['update_norm'])} | "
            f"{', '.join(f'{v:.2f}' for v in b['step_exponent'])} |"
        )
    lines += ["", f"Section time: {data['seconds']:.0f} s."]
    return "\n".join(lines)
