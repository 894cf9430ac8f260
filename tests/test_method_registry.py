"""The registry of compared methods (``tokenpatch/workbench/registry.py``) is the single source of what
the prompt-compression comparison runs: every registered method is extracted, scored, named in the
report and drawn, in the registry's order, and an extra method registered here flows through
``extract`` and ``compare`` without an edit anywhere else."""

from __future__ import annotations

import inspect
import re

import pytest

pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import build  # noqa: E402
from test_baselines import CharTokenizer  # noqa: E402

import tokenpatch as tp  # noqa: E402
from tokenpatch.baselines.vectors import task_vectors  # noqa: E402
from tokenpatch.tasks.wordpairs import WordPairs  # noqa: E402
from tokenpatch.workbench import registry  # noqa: E402
from tokenpatch.workbench.compare import METHODS, compare  # noqa: E402
from tokenpatch.workbench.methods import steered  # noqa: E402
from tokenpatch.workbench.registry import REGISTRY, Compared, entry_of  # noqa: E402
from tokenpatch.workbench.report.compress import BASELINES, goal  # noqa: E402
from tokenpatch.workbench.report.compress_page import PUBLISHED, drawn, markdown  # noqa: E402

WORDS = [chr(97 + i % 26) + chr(97 + i // 26) + chr(97 + 3 * i % 26) for i in range(40)]
TASK = WordPairs("rev", "word -> reversed", tuple((w, (w[::-1],)) for w in WORDS))
SMALL = dict(shots=2, test=4, calibration=6, dev=4, rank=2, n_heads=2, effect_prompts=2, timing_rows=2)


def _run(res: dict) -> dict:
    tasks = {"rev": {k: v for k, v in res.items() if k != "patches"}}
    return {"model": "tiny", "shots": 2, "seed": 0, "seconds": 1.0, "threads": 1, "tasks": tasks, "goal": goal(tasks)}


def test_the_registry_is_well_formed():
    """Keys unique and snake_case, no entry owns another's rows, every setting an option of
    ``extract``, and compare's name table and the report's lists read from it."""
    keys = [e.key for e in REGISTRY]
    assert len(set(keys)) == len(keys) and all(re.fullmatch(r"[a-z_]+", k) for k in keys)
    options = set(inspect.signature(registry.extract).parameters) - {"model", "enc", "methods", "registry"}
    for e in REGISTRY:
        assert set(e.settings) <= options, e.key
        rows = [e.key_of(n=3, k=1.0, rank=2, hybrid=1.0)]
        assert [x.key for x in REGISTRY if x.owns(rows[0])] == [e.key]  # its rows are its own alone
    assert METHODS == {e.key: e.name for e in REGISTRY}
    assert set(BASELINES) == {e.key for e in REGISTRY if e.baseline}
    assert PUBLISHED == ("zero_shot", "task_vector", "icl")
    assert [e.key for e in registry.wanted(())] == ["zero_shot", "icl"]  # every run has the floor and the reference


@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")
def test_every_registered_method_is_extracted_compared_reported_and_drawn(float64_gemma_norms):
    """One comparison with every row asked for, on a model with a norm after its MLP (the
    through-the-norm row): each entry gives at least one row, every row is one entry's, in the
    registry's order, named as it says, closed form as it says; the report names each and the figure
    draws each (the KL bar for all but the reference)."""
    more = dict(ridge=(0.01, 0.1), sampled=(2,), bake_times=(1,), hybrid=1, norm_steps=(1,))
    res = compare(build("gemma3"), CharTokenizer(), TASK, **SMALL, **more)
    rows = res["methods"]
    owners = [entry_of(k) for k in rows]
    assert None not in owners
    assert {e.key for e in owners} == {e.key for e in REGISTRY}  # every registered method extracted and scored
    order = [e.key for e in REGISTRY]
    assert [order.index(e.key) for e in owners] == sorted(order.index(e.key) for e in owners)
    assert rows["thought_patch_rank"]["name"] == "thought patch (rank 2)"
    assert rows["prompt_baking_1x"]["name"] == "prompt baking (LoRA rank 2, 1x time)"
    assert (
        rows["thought_patch_sampled_2"]["name"] == "thought patch (self-written: 2 continuations, their demonstrations)"
    )
    assert all(k in rows[key] for key in rows for k in entry_of(key).chosen_on_dev)  # each reports its choices
    assert entry_of(res["closed_form_choice"]).closed_form
    assert {k for k in rows if registry.closed_form(k)} == {
        "thought_patch",
        "thought_patch_rank",
        "thought_patch_gcv",
        "thought_patch_norm",
        "thought_patch_sampled_2",
    }
    run = _run(res)
    text = markdown(run)
    assert all(f"| {r['name']} |" in text for r in rows.values())  # named in the report
    assert [(k, name) for k, name, _ in drawn(run)] == [(k, r["name"]) for k, r in rows.items()]  # drawn
    assert [k for k, _, kl in drawn(run) if not kl] == ["icl"]


def _extract_half_task_vector(x, entry):
    """A made-up baseline: the task vector of the middle layer, at half strength, nothing chosen."""
    tv = task_vectors(x.model, x.dummy)
    layer = len(tv.vectors) // 2
    half = tv.only(layer)
    half = type(half)(half.site, {i: 0.5 * v for i, v in half.vectors.items()}, half.mode, half.position)
    return x.steering(entry, half, 0.0, {"layer": layer})


EXTRA = Compared(
    "half_task_vector",
    "task vector at half strength",
    _extract_half_task_vector,
    steered,
    baseline=True,
    min_shots=3,
    why_shots="the made-up baseline wants three demonstrations",
)


def test_an_extra_registered_method_flows_through_extract_and_compare():
    """A new baseline is one entry and its extraction function: registered beside the floor and the
    reference, it is extracted, scored, named and its shots checked, with nothing else edited."""
    mine = (*registry.wanted(()), EXTRA)
    res = compare(build("llama"), CharTokenizer(), TASK, **{**SMALL, "shots": 3}, registry=mine)
    rows = res["methods"]
    assert list(rows) == ["zero_shot", "icl", "half_task_vector"]
    row = rows["half_task_vector"]
    assert row["name"] == "task vector at half strength" and row["layer"] == 1 and row["n"] == 4
    assert row["kl"] != rows["zero_shot"]["kl"] and row["bytes"] > 0  # it steers
    assert res["closed_form_choice"] is None  # not closed form: no thought patch in this run
    assert "| task vector at half strength |" in markdown(_run(res))
    with pytest.raises(tp.InputError, match="the made-up baseline wants three demonstrations: it needs shots >= 3"):
        compare(build("llama"), CharTokenizer(), TASK, **SMALL, registry=mine)
    other = compare(build("llama"), CharTokenizer(), TASK, **{**SMALL, "shots": 3}, methods=(), registry=mine)
    assert list(other["methods"]) == ["zero_shot", "icl"]  # ``methods`` names registered keys
