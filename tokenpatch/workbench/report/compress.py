"""Prompt compression on the pretrained models, as a table (``docs/prompt-compression.md``):
``compare`` on word-pair tasks for each method, with the goal's three checks and Hendel et al.'s
published numbers beside ours (context, not targets).

``run_model`` runs one model over the main tasks and, while fewer than ``min_informative`` of
them are informative (ICL at least 20 points above zero-shot on the test split), the reserve
tasks; with an ``out`` folder it keeps each finished task there (its thought patches and a
``NAME-TASK-result.json``), and a rerun reads finished tasks back instead of running them again;
``markdown`` and ``figure`` present it; ``compression_section`` is the reduced run of
``tokenpatch reproduce``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch_files import save_patch
from tokenpatch.tasks.wordpairs import MAIN_TASKS, RESERVE_TASKS, Format, WordPairs, load_task
from tokenpatch.thought.held_out import RIDGE_GRID
from tokenpatch.workbench.compare import compare
from tokenpatch.workbench.methods import Encoded, Method, answer_logits, leading_tokens
from tokenpatch.workbench.registry import REGISTRY, Compared, entry_of
from tokenpatch.workbench.report.compress_page import figure, markdown
from tokenpatch.workbench.report.section import Section, differences, part_inputs, read_part, write_part
from tokenpatch.workbench.zoo import pretrained

log = logging.getLogger(__name__)

KEY = "prompt_compression"
TITLE = "Prompt compression on real language models"
# the thought patch's ridge, chosen per task on the dev split (KL to ICL); SmolLM2 chose the lowest
# and Gemma 3 the highest of (0.01, 0.1, 1, 10), so the grid goes a step further at both ends
RIDGES = RIDGE_GRID
# reproduce's default run (--full: compression_section's defaults): the thought patch's ridge given, what the
# dev split chooses from RIDGES for its task and model (one fit where the choice makes one per ridge), the
# function vector's head effects on 16 of the 40 calibration prompts, the prefill timed on 8 queries.
REDUCED = {"ridge": 0.01, "effect_prompts": 16, "timing_rows": 8}
BASELINES = tuple(e.key for e in REGISTRY if e.baseline)  # the goal's accuracy check (the registry's baselines)
# The prompt formats tried on dev (with each candidate first token): Todd et al.'s "Q: x\nA: y" blocks,
# and one pair per line with an arrow.
FORMATS = {"qa": Format(), "arrow": Format("{x} ->", " {y}", "\n")}
# The full comparison's extra rows (compare's options): self-written calibration of 16 and 128
# continuations, prompt baking at 1x and 10x the thought patch's fit time, the hybrid at 1x, and
# (on a model with a norm after its MLPs) the fit through the norm, its Gauss-Newton steps chosen
# on dev from 1, 3 and 10.
FULL = {"sampled": (16, 128), "bake_times": (1.0, 10.0), "hybrid": 1.0, "norm_steps": (1, 3, 10)}


def run_model(
    name: str,
    tasks: list[str | WordPairs] | None = None,
    *,
    shots: int = 10,
    test: int | None = 100,
    seed: int = 0,
    ridge=RIDGES,
    rank: int = 4,
    min_informative: int = 5,
    prompting: str | dict = "dev",
    out: Path | None = None,
    progress: bool | None = None,
    **options,
) -> dict:
    """``compare`` on ``tasks`` (names of shipped tasks, or ``WordPairs`` read from a user's file; default:
    the main tasks, then reserves until ``min_informative`` are informative) for the pretrained model
    ``name``; thought patches are saved to ``out``.
    ``prompting``: ``"dev"`` chooses the first token and the prompt format for every method alike
    on the dev split (``choose_prompting``, over the main or the given tasks); ``{"lead": ids,
    "format": key of FORMATS}`` fixes them; ``"default"``: the tokenizer's BOS and ``Q:``/``A:``.
    ``options``: more of ``compare``'s (``calibration``, ``dev``, ``n_heads``, ``layers``, the extra
    rows of ``FULL``...).

    With ``out``, each task is kept there as it finishes (``result_path``); a rerun reads a finished
    task back (``"read_back"`` lists them) when it ran with the same settings, and refuses, before the
    model loads, a folder whose finished tasks ran with others (nothing is mixed or overwritten)."""
    t0 = time.perf_counter()
    given = {t.name: t for t in tasks or () if isinstance(t, WordPairs)}  # a user's tasks, by name
    queue = [t.name if isinstance(t, WordPairs) else t for t in tasks] if tasks else [*MAIN_TASKS, *RESERVE_TASKS]
    settings = lambda task: {  # noqa: E731  what a task's result depends on
        "model": name,
        "task": task,
        **({"pairs": _digest(given[task])} if task in given else {}),
        "shots": shots,
        "test": test,
        "seed": seed,
        "ridge": ridge,
        "rank": rank,
        "prompting": prompting,
        "options": options,
    }
    saved = {}
    for task in queue if out is not None else []:
        path = result_path(out, name, task)
        before = part_inputs(path)
        changed = differences(before, settings(task)) if before is not None else ""
        if changed:
            raise InputError(
                f"{path} is a finished {task} run with other settings ({changed}); rerun with its "
                "settings to resume, or give a new folder"
            )
        data = read_part(path, settings(task))
        if data is not None and all((Path(out) / p).exists() for p in data["patch_files"]):
            saved[task] = data
    if saved:
        log.info("%s: read back %d finished tasks from %s (%s)", name, len(saved), out, ", ".join(saved))
    model, tokenizer = (None, None) if set(queue) <= set(saved) else _load(name)
    chosen: dict | None = None

    def prompt_choice() -> dict:
        nonlocal chosen
        if chosen is None:
            on = [given[t] if t in given else load_task(t) for t in (queue if tasks else MAIN_TASKS)]
            chosen = choose_prompting(
                model, tokenizer, on, prompting, shots=shots, seed=seed, **_split_options(options)
            )
        return chosen

    results: dict[str, dict] = {}
    earlier = 0.0
    for task in queue:
        informative = sum(r["informative"] for r in results.values())
        if not tasks and task in RESERVE_TASKS and informative >= min_informative:
            break
        if task in saved:
            results[task], earlier = saved[task]["result"], earlier + saved[task]["seconds"]
            continue
        if model is None:
            model, tokenizer = _load(name)
        log.info("%s: %s", name, task)
        t1 = time.perf_counter()
        pick = prompt_choice()["chosen"]
        res = compare(
            model,
            tokenizer,
            given[task] if task in given else load_task(task),
            shots=shots,
            seed=seed,
            test=test,
            ridge=ridge,
            rank=rank,
            lead=pick["lead"],
            fmt=FORMATS[pick["format"]],
            progress=progress,
            **options,
        )
        patches = res.pop("patches")
        if out is not None:
            files = []
            for method, patch in patches.items():
                files.append(f"{_slug(name)}-{task}-{method}.safetensors")
                save_patch(patch, Path(out) / files[-1])
            data = {"result": res, "seconds": time.perf_counter() - t1, "patch_files": files}
            write_part(result_path(out, name, task), settings(task), data)
        results[task] = res
        log.info("%s", _line(task, res))
    return {
        "model": name,
        "shots": shots,
        "seed": seed,
        "seconds": time.perf_counter() - t0 + earlier,
        "threads": torch.get_num_threads(),
        "prompting": chosen,
        "tasks": results,
        "read_back": [t for t in results if t in saved],
        "goal": goal(results),
    }


def _split_options(options: dict) -> dict:
    return {k: options[k] for k in ("calibration", "dev") if k in options}


END_OF_TEXT = re.compile(r"endoftext|^</?s>$|^<(bos|eos)>$", re.IGNORECASE)


def document_markers(tokenizer) -> list[int]:
    """The special tokens a model may have seen where a document begins: its BOS and EOS, and any
    special token named like an end of text (``<|endoftext|>``, ``</s>``, ``<eos>``), whatever
    role the tokenizer gives it (SmolLM2 files ``<|endoftext|>`` as its *unknown* token)."""
    ids = [tokenizer.bos_token_id, tokenizer.eos_token_id]
    special = zip(getattr(tokenizer, "all_special_tokens", ()), getattr(tokenizer, "all_special_ids", ()))
    ids += [tid for tok, tid in special if END_OF_TEXT.search(tok)]
    return list(dict.fromkeys(int(t) for t in ids if t is not None))


def choose_prompting(
    model, tokenizer, tasks: list[WordPairs], how: str | dict = "dev", *, shots: int = 10, seed: int = 0, **split
) -> dict:
    """The first token and the prompt format every method of the comparison uses. ``how="dev"``: each
    candidate lead (the tokenizer's own prefix, ``leading_tokens``; each of ``document_markers``) with each of
    ``FORMATS``, scored by ICL on the dev split of every task in ``tasks``: the dev answers whose first
    token ICL ranks first, ties broken by that token's mean log-probability; the best wins (ICL's
    prompt at its best, then every method reads the same). A dict fixes the choice; ``"default"``
    is the BOS with ``Q:``/``A:``. Returns ``{"chosen": {...}, "candidates": [...]}``."""
    own = leading_tokens(tokenizer)
    if how == "default" or isinstance(how, dict):
        pick = (
            {"lead": own, "format": "qa"} if how == "default" else {"lead": list(how["lead"]), "format": how["format"]}
        )
        if pick["format"] not in FORMATS:
            raise InputError(f"prompting format {pick['format']!r} is not one of {sorted(FORMATS)}")
        return {"chosen": {**pick, "lead_text": tokenizer.decode(pick["lead"])}, "candidates": []}
    if how != "dev":
        raise InputError(f"prompting must be 'dev', 'default' or {{'lead': ids, 'format': name}}, got {how!r}")
    leads = [own] + [[tid] for tid in document_markers(tokenizer)]
    leads = [lead for i, lead in enumerate(leads) if lead not in leads[:i]]
    candidates = []
    for lead in leads:
        for key, fmt in FORMATS.items():
            hits = n = 0
            logp_sum = 0.0
            for task in tasks:
                enc = Encoded(tokenizer, task.split(seed, demos=max(shots, 10), **split), shots, fmt, lead)
                logp = answer_logits(model, enc.batch("dev", True), Method("ICL", prompted=True)).cpu()
                first = enc.first("dev")
                hits += int((logp.argmax(-1) == first).sum())
                logp_sum += float(logp.gather(1, first[:, None]).sum())
                n += len(first)
            candidates.append(
                {
                    "lead": lead,
                    "lead_text": tokenizer.decode(lead),
                    "format": key,
                    "hits": hits,
                    "n": n,
                    "logp": logp_sum / n,
                }
            )
    best = max(candidates, key=lambda c: (c["hits"], c["logp"]))
    return {"chosen": {k: best[k] for k in ("lead", "lead_text", "format")}, "candidates": candidates}


def _digest(task: WordPairs) -> str:
    """What a user's task holds (a changed file is another task: its finished result is not read back)."""
    return hashlib.sha256(json.dumps([task.description, task.pairs]).encode()).hexdigest()[:16]


def _load(name: str):
    return pretrained.load_pretrained(name, dtype=torch.float32, progress=False)


def result_path(out: Path, name: str, task: str) -> Path:
    """Where ``run_model`` keeps the finished ``task`` of the model ``name`` in ``out``."""
    return Path(out) / f"{_slug(name)}-{task}-result.json"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower())


def _line(task: str, res: dict) -> str:
    m = res["methods"]
    return f"{task}: " + ", ".join(f"{k} {v['correct']}/{v['n']} (KL {v['kl']:.2f})" for k, v in m.items())


def goal(results: dict[str, dict]) -> dict:
    """The goal's checks on the informative tasks (``docs/prompt-compression.md`` §5), for each task's closed-form thought patch chosen on
    dev (``closed_form_choice``): its KL to ICL is the lowest of every method but ICL and the thought
    patch's own variants (on at least 4 tasks and 4 of 5); its mean share of the ICL-over-zero-shot
    gain (goal 0.9); and at equal wall time it is closer to ICL than prompt baking (the baking row
    with the smallest budget at least the thought patch's time, else the largest). Also: its accuracy
    against each of ``BASELINES``."""
    informative = [t for t, r in results.items() if r["informative"]]
    lowest_kl, at_least, shares, closer, choices = [], [], [], [], {}
    for t in informative:
        m = results[t]["methods"]
        key = results[t].get("closed_form_choice") or "thought_patch"
        choices[t] = key
        mine = m[key]
        others = {k: v["kl"] for k, v in m.items() if _rival(k)}
        if mine["kl"] <= min(others.values()):
            lowest_kl.append(t)
        if all(mine["correct"] >= m[b]["correct"] for b in BASELINES if b in m):
            at_least.append(t)
        shares.append(mine["gain_recovered"])
        baking = sorted((v["extraction_s"], k) for k, v in m.items() if _part(k, lambda e: e.equal_time))
        if baking:
            later = [k for s_, k in baking if s_ >= mine["extraction_s"]]
            rival = later[0] if later else baking[-1][1]
            closer.append([t, rival, mine["kl"] < m[rival]["kl"]])
    mean_share = sum(shares) / len(shares) if shares else None
    enough = max(4, -(-4 * len(informative) // 5))  # 4 of 5
    return {
        "informative": informative,
        "choices": choices,
        "lowest_kl": lowest_kl,
        "accuracy_at_least_baselines": at_least,
        "mean_gain_recovered": mean_share,
        "closer_than_baking": closer,
        "met": len(lowest_kl) >= enough
        and mean_share is not None
        and mean_share >= 0.9
        and bool(closer)
        and all(ok for _, _, ok in closer),
    }


def _part(key: str, part: Callable[[Compared], bool]) -> bool:
    """Whether the row ``key``'s registry entry plays ``part`` (one of ``Compared``'s report fields)."""
    entry = entry_of(key)
    return entry is not None and part(entry)


def _rival(key: str) -> bool:
    """Whether the row ``key`` is one the thought patch must beat in KL: neither the reference (ICL)
    nor a thought patch or its variant."""
    return not _part(key, lambda e: e.reference or e.ours)


def compression_section(
    out: Path,
    name: str = "smollm2-135m",
    task: str = "present_past",
    test: int = 40,
    dev: int = 15,
    ridge=RIDGES,
    effect_prompts: int | None = None,
    timing_rows: int = 32,
    progress: bool | None = None,
    **options,
):
    """The run of ``tokenpatch reproduce``: one task, one model, ``test`` queries, ``dev`` dev pairs for
    the baselines' choices (the full table uses 30), the thought patch's ``ridge`` (several: chosen on
    dev), the function vector's head effects on ``effect_prompts`` calibration prompts (None: all), the
    prefill timed on ``timing_rows`` queries (``REDUCED``: the default run's; ``options``: more of
    ``compare``'s)."""
    try:
        pretrained.check_requirements(name)
    except UnsupportedModelError as exc:
        return Section(KEY, TITLE, f"Skipped: {exc}", [], {"skipped": True, "reason": str(exc)})
    run = run_model(
        name,
        [task],
        test=test,
        prompting="default",
        ridge=ridge,
        progress=progress,
        dev=dev,
        effect_prompts=effect_prompts,
        timing_rows=timing_rows,
        **options,
    )
    png = figure(run, Path(out) / "compression.png")
    effects = "all" if effect_prompts is None else effect_prompts
    body = (
        f"A reduced run: one task, {test} test queries, {dev} dev pairs, the function vector's head effects on {effects} "
        f"calibration prompts, the prefill timed on {timing_rows} queries (the full table: `tokenpatch compress --model "
        f"{name} --task all`, docs/prompt-compression.md).\n\n" + markdown(run) + f"\n\n![compression]({png.name})"
    )
    return Section(KEY, TITLE, body, [png.name], {"skipped": False, **run})
