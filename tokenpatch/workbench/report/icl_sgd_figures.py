"""The page of ``tokenpatch icl-sgd``: its figures and its markdown, from the numbers ``icl_sgd_page.measure``
writes (``docs/dynamics.md`` section 7)."""

from __future__ import annotations

from pathlib import Path

from tokenpatch.workbench.report import plots

__all__ = ["figures", "markdown"]


def _band(rows: list[dict]) -> tuple[list[float], list[float], list[float]]:
    return [r["mean"] for r in rows], [r["lo"] for r in rows], [r["hi"] for r in rows]


def figures(data: dict, paths: dict[str, Path]) -> None:
    st, un = data["steps"]["per_layer"], data["untrained"]["per_layer"]
    plots.per_layer(
        {
            "each demonstration's implicit step S_i = dW_i - dW_(i-1)": {
                "trained: vs -g_i": _band(st["gradient"]),
                "trained: vs another demonstration": _band(st["gradient_shuffled"]),
                "trained: vs another task": _band(st["gradient_other_run"]),
                "trained: vs online SGD step": _band(st["sgd_step"]),
                "untrained: vs -g_i": _band(un["gradient"]),
                "random matrix": _band(st["random"]),
            },
            f"after all {data['shots']}: cos(dW_k - dW_0, D_k), online SGD": {
                "trained": _band(st["sgd_weights"]),
                "trained, shuffled order": _band(st["shuffled_sgd_weights"]),
                "untrained": _band(un["sgd_weights"]),
            },
        },
        paths["steps"],
        f"{data['model']}: implicit steps against explicit gradients (mean over the layer's matrices and "
        f"{len(data['tasks'])} prompts, 95% intervals)",
    )
    s, k = data["steps"], data["shots"]
    plots.curves(
        {
            "per demonstration i: mean over every matrix and prompt": {
                "x": "demonstration i",
                "y": "cosine",
                "lines": {
                    "cos(S_i, -g_i)": (list(range(1, k + 1)), s["by_step"]["gradient"]),
                    "cos(S_i, online SGD step)": (list(range(1, k + 1)), s["by_step"]["sgd_step"]),
                    "cos(dW_i - dW_0, D_i)": (list(range(1, k + 1)), s["by_step"]["sgd_weights"]),
                    "random matrix": (list(range(1, k + 1)), s["by_step"]["random"]),
                },
            },
            "held-out answer NLL (mean over prompts)": {
                "x": "demonstrations read i",
                "y": "NLL (nats)",
                "lines": {
                    "in context (prefix i)": (list(range(k + 1)), s["heldout_icl"]),
                    f"online SGD, lr {s['chosen_lr']:g}": (list(range(k + 1)), s["heldout_sgd"]),
                },
            },
        },
        paths["curves"],
        f"{data['model']}: along the prompt",
    )
    m = data["whole"]["methods"]
    plots.per_layer(
        {
            "cos(dW_k - dW_0, D), whole updates": {
                **{f"token patch vs {k}": _band(v["token_patch"]) for k, v in m.items()},
                **{f"thought patch vs {k}": _band(v["thought_patch"]) for k, v in m.items() if k == "adam"},
                "untrained: token patch vs online SGD": _band(data["untrained"]["whole"]["token_patch"]),
            },
            "rank ceiling s_1(D) / |D|_F": {f"{k}": _band(v["ceiling"]) for k, v in m.items()},
            "SimAOU cos(h_C - h_0, h_FT - h_0), layer outputs": {
                **{k: _band(v["simaou"]) for k, v in m.items()},
                "untrained: online SGD": _band(data["untrained"]["whole"]["simaou"]),
            },
        },
        paths["whole"],
        f"{data['model']}: the whole update of a {data['shots']}-shot prompt against SGD and Adam on its demonstrations",
    )
    mon = data["monitor"]
    if mon["per_layer"] is None:  # only right or only wrong answers: nothing to separate
        return
    layers = list(range(len(mon["per_layer"])))
    flat = lambda v: ([layers[0], layers[-1]], [v["mean"], v["mean"]])  # noqa: E731
    plots.curves(
        {
            "flagging wrong answers: AUROC (0.5 = chance)": {
                "x": "layer",
                "y": "AUROC",
                "lines": {
                    "update norm |dW| of the layer": (layers, [r["mean"] for r in mon["per_layer"]]),
                    "pooled: norm over all layers": flat(mon["pooled"]),
                    "baseline: 1 - first-token probability": flat(mon["probability"]),
                    "baseline: - logit margin": flat(mon["margin"]),
                },
            }
        },
        paths["monitor"],
        f"{data['model']}: do the implicit updates of tp.generate tell right from wrong? "
        f"({mon['wrong']} wrong of {mon['answers']} answers)",
    )


def _iv(v: dict, fmt: str = "+.3f") -> str:
    return f"{v['mean']:{fmt}} [{v['lo']:{fmt}}, {v['hi']:{fmt}}]"


def markdown(data: dict, paths: dict[str, Path]) -> str:
    s, u = data["steps"], data["untrained"]
    o, ou = s["overall"], u["overall"]
    rows = [
        ("cos(S_i, -g_i): the demonstration's own gradient", "gradient"),
        ("another demonstration's gradient, same weights", "gradient_shuffled"),
        ("another task's gradient", "gradient_other_run"),
        ("a random matrix", "random"),
        ("cos(S_i, online SGD step)", "sgd_step"),
        ("online SGD step, shuffled order", "shuffled_sgd_step"),
        ("cos(dW_k - dW_0, D_k), after the pass", "sgd_weights"),
    ]
    steps = ["| measure | trained | untrained (random init) |", "|---|---|---|"]
    steps += [f"| {label} | {_iv(o[k])} | {_iv(ou[k])} |" for label, k in rows]
    sweep = ["| lr | held-out answer NLL after one pass |", "|---|---|"]
    sweep += [f"| {lr:g} | {v:.3f} |" for lr, v in zip(s["lrs"], s["heldout_after_pass"])]
    m = data["whole"]["methods"]
    whole = [
        "| update D | cos(token patch, D) | rank ceiling | cos(thought patch, D) | SimAOU |",
        "|---|---|---|---|---|",
    ]
    whole += [
        f"| {k} | {_iv(v['token_patch_overall'])} | {_iv(v['ceiling_overall'], '.3f')} | "
        f"{_iv(v['thought_patch_overall'])} | {_iv(v['simaou_overall'])} |"
        for k, v in m.items()
    ]
    acc = ["| method | accuracy (mean over tasks) | per task |", "|---|---|---|"]
    acc += [
        f"| {k} | {_iv(v, '.2f')} | {' / '.join(f'{x:.2f}' for x in v['per_task'])} |"
        for k, v in data["accuracy"].items()
    ]
    mon = data["monitor"]
    if mon["per_layer"] is None:
        monitor = [f"No AUROC: {mon['wrong']} of {mon['answers']} answers were wrong."]
    else:
        best = max(range(len(mon["per_layer"])), key=lambda i: abs(mon["per_layer"][i]["mean"] - 0.5))
        monitor = ["| score | AUROC for a wrong answer |", "|---|---|"]
        monitor += [
            f"| update norm, layer {best} (furthest from 0.5) | {_iv(mon['per_layer'][best], '.3f')} |",
            f"| update norm, pooled over layers | {_iv(mon['pooled'], '.3f')} |",
            f"| baseline: first-token probability | {_iv(mon['probability'], '.3f')} |",
            f"| baseline: logit margin | {_iv(mon['margin'], '.3f')} |",
        ]
    w = data["whole"]
    sec = data["seconds"]
    return "\n".join(
        [
            f"# In-context learning against explicit gradients: {data['model']}",
            "",
            f"`tokenpatch icl-sgd --model {data['model']}` ({sec['total'] / 60:.1f} min, {data['threads']} threads; "
            f"steps {sec['steps']:.0f} s, whole updates {sec['whole']:.0f} s, untrained control "
            f"{sec['untrained']:.0f} s, monitoring {sec['monitor']:.0f} s). Tasks {', '.join(data['tasks'])}, one "
            f"{data['shots']}-shot prompt each (first token {data['lead']}, format `{data['format']}`: the choice the "
            f"prompt-compression comparison made on its dev split), seed {data['seed']}. Every cosine is over the "
            f"{s['matrices']} matrices the token patch changes (the MLP's input readers and its output matrix, every "
            "layer), averaged per layer; intervals are 95% over the prompts. `docs/dynamics.md` section 7 says what "
            "each number is.",
            "",
            "## 1-2. Step by step",
            "",
            f"Online SGD at lr {s['chosen_lr']:g} (lowest held-out answer NLL after one pass):",
            "",
            *sweep,
            "",
            *steps,
            "",
            f"![step by step]({paths['steps'].name})",
            "",
            f"![along the prompt]({paths['curves'].name})",
            "",
            "## 3. Whole updates",
            "",
            f"Full-batch SGD (lr {w['lrs']['sgd']:g}, the online choice; {w['steps']['sgd']} steps) and Adam (lr "
            f"{w['lrs']['adam']:g}, {w['steps']['adam']} steps; held-out answer NLL after its steps "
            + ", ".join(f"{lr}: {v:.3f}" for lr, v in w["adam_heldout"].items())
            + f") on the {data['shots']} demonstrations, online SGD (one pass); the token patch of the whole prompt "
            "(at the first query) and its thought patch (the calibration split; per task the ridge the "
            "prompt-compression comparison chose on its dev split):",
            "",
            *whole,
            "",
            f"Greedy accuracy on {data['tests']} held-out queries per prompt:",
            "",
            *acc,
            "",
            f"![whole updates]({paths['whole'].name})",
            "",
            "## 4. Monitoring",
            "",
            f"{mon['answers']} test answers of the five prompts, {mon['wrong']} wrong (`tp.generate`, the update norms of "
            "the step that writes the answer's first token):",
            "",
            *monitor,
            "",
            f"![monitoring]({paths['monitor'].name})" if mon["per_layer"] is not None else "",
            "",
        ]
    )
