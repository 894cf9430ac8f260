"""The report's real-language-model section (``tokenpatch.workbench.report.real_models``): a one-line note that loads
nothing when no model is installed (and ``reproduce`` still succeeds), and on SmolLM2 the numbers
the section states are the ones it measured and meet the real-model targets."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import non_snake_keys

import tokenpatch as tp
from tokenpatch.workbench.report import reproduce as report
from tokenpatch.workbench.report.real_models import (
    LAYER_TOL,
    LIBRARY_TOL,
    N_QUERIES,
    NEW_TOKENS,
    PROMPT,
    real_models_section,
)
from tokenpatch.workbench.report.section import Section
from tokenpatch.workbench.zoo import pretrained

FIGURE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def bad_keys(data: dict) -> list[str]:
    return non_snake_keys(json.loads(json.dumps(data)))  # as results.json will hold it


def nothing_installed(monkeypatch) -> None:
    def missing(name):
        raise tp.UnsupportedModelError(
            f"{name} needs the Python packages transformers, gguf, accelerate; missing here: "
            f"transformers; install them with: {pretrained.HF_INSTALL}"
        )

    def never(*args, **kwargs):
        raise AssertionError("load_pretrained called although no model is installed")

    monkeypatch.setattr(pretrained, "check_requirements", missing)
    monkeypatch.setattr(pretrained, "load_pretrained", never)


def test_skipped_without_models_is_one_line_and_loads_nothing(monkeypatch, tmp_path):
    nothing_installed(monkeypatch)
    section = real_models_section(tmp_path, progress=False)
    assert section.key == "real_models" and section.title == "Real language models"
    assert "\n" not in section.body and section.body.startswith("Skipped")
    assert pretrained.HF_INSTALL in section.body and "to include it" in section.body
    for spec in pretrained.PRETRAINED.values():
        if pretrained.find_spec(spec.module) is None:  # a model package missing here: its command is named
            assert spec.install in section.body
    assert section.figures == [] and list(tmp_path.iterdir()) == []
    assert section.data["skipped"] is True and set(section.data["missing"]) == {"smollm2_135m", "gemma3_270m"}
    assert bad_keys(section.data) == []


def test_reproduce_succeeds_with_the_note(monkeypatch, tmp_path):
    """``reproduce`` with no model installed: the other sections (stubbed here: they have their own
    tests) and the one-line note, numbered like any section, in report.md and results.json."""
    nothing_installed(monkeypatch)
    stubbed = {
        key: (lambda out, progress, _key=key: Section(_key, _key.title(), "stub", [], {}))
        for key in report.SECTIONS
        if key not in ("real_models", "prompt_compression")  # the two that run here, as their notes
    }
    path = report.reproduce(tmp_path, progress=False, sections={**dict.fromkeys(report.SECTIONS), **stubbed})
    text = path.read_text()
    body, compression = text.split("## 8. Real language models\n\n", 1)[1].split("## 9. Prompt compression", 1)
    compression = compression.split("## 10. ", 1)[0]
    assert body.strip().count("\n") == 0 and body.startswith("Skipped")
    assert compression.split("\n\n", 1)[1].strip().count("\n") == 0 and "Skipped" in compression
    data = json.loads((tmp_path / "results.json").read_text())
    assert list(data["sections"])[-4:] == ["real_models", "prompt_compression", "markov", "induction"]
    assert data["sections"]["real_models"]["skipped"] is True and data["sections"]["prompt_compression"]["skipped"]
    assert bad_keys(data) == []


@pytest.mark.slow
def test_section_on_smollm2(smollm2, pretrained_cache_dir, monkeypatch, tmp_path):
    """SmolLM2 only (Gemma reported as missing): every number the section writes is the one in its
    data, and meets the targets; the figures exist; the results keys are snake_case."""
    model, tokenizer = smollm2
    monkeypatch.setenv("TOKENPATCH_CACHE", str(pretrained_cache_dir))  # the fixture's cache: no conversion
    real_check = pretrained.check_requirements

    def only_smollm2(name):
        if name != "smollm2-135m":
            raise tp.UnsupportedModelError(f"{name}: not installed in this test; install it with: pip install it")
        real_check(name)

    monkeypatch.setattr(pretrained, "check_requirements", only_smollm2)
    section = real_models_section(tmp_path, progress=False)
    data = section.data
    assert section.key == "real_models" and not data["skipped"]
    assert list(data["models"]) == ["smollm2_135m"] and list(data["missing"]) == ["gemma3_270m"]
    assert "Not included: **gemma3-270m**" in section.body
    assert bad_keys({"title": section.title, "figures": section.figures, **data}) == []

    r = data["models"]["smollm2_135m"]
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert r["prompt_tokens"] == ids.shape[1] >= 64 and len(r["queries"]) == N_QUERIES
    per_layer = [e["max_rel"] for e in r["verify"]["per_layer"][:-1]]
    assert len(per_layer) == r["n_layers"] == 30 and r["verify"]["n"] == N_QUERIES
    assert r["layer_max_rel"] == max(per_layer) <= LAYER_TOL and r["layer_target_met"]
    assert f"**{r['layer_max_rel']:.2e}** (met)" in section.body
    # the stricter float32 rule of our own models is reported beside it, met or not as the number says: float32
    # rounding through 30 real layers is the machine's (1.18e-4 on one 2-core machine, below 1e-4 on another)
    assert r["library_rule_met"] == (r["layer_max_rel"] <= LIBRARY_TOL)
    rule = "met" if r["library_rule_met"] else "NOT MET"
    assert f"the same, against the library's float32 rule ({LIBRARY_TOL:g}) | {rule} |" in section.body
    assert section.body.count("NOT MET") == (rule == "NOT MET")  # nothing else is not met
    assert r["decided_agree"] == r["n_decided"] and f"{r['top1_agree']}/{N_QUERIES}" in section.body
    assert r["n_decided"] == sum(m >= 1e-2 for m in r["query_margins"])
    assert r["max_logit_diff"] < 1e-2

    g = r["generation"]
    with torch.no_grad():  # ordinary greedy decoding again, independently of the section
        ordinary = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id,
        )[0, ids.shape[1] :]
    assert g["ordinary_tokens"] == ordinary.tolist() and g["compared"] == len(ordinary)
    assert len(g["tokens"]) == NEW_TOKENS and g["tokens"][: g["compared"]] == g["ordinary_tokens"]
    assert g["identical"] and "**yes**" in section.body and g["agree_with_context"] == NEW_TOKENS
    assert g["smallest_margin"] == min(g["margins"][: g["compared"]]) and f"{g['smallest_margin']:.2e}" in section.body
    assert tokenizer.decode(ordinary).replace("\n", "\\n") in section.body
    assert torch.tensor(g["update_norms"]).shape == (NEW_TOKENS, 30)
    assert "zero_scale" not in r  # a Llama: no post-feedforward norm

    shown = FIGURE.findall(section.body)
    assert shown == section.figures == ["real_models_layers.png", "real_models_smollm2_135m_update_norms.png"]
    for name in shown:
        assert (tmp_path / name).stat().st_size > 10_000  # a real PNG


def test_reproduce_runs_the_sections_asked_for(tmp_path):
    """``sections=``: a list of keys runs those sections only, in report order; a wrong key is one clear error."""
    stub = lambda out, progress: Section("model", "Stub", "stub", [], {"x": 1})  # noqa: E731
    report.reproduce(tmp_path, progress=False, sections={"model": stub})
    data = json.loads((tmp_path / "results.json").read_text())
    assert list(data["sections"]) == ["model"] and data["sections"]["model"]["x"] == 1
    with pytest.raises(tp.InputError, match=r"unknown report sections \['modle'\]"):
        report.reproduce(tmp_path, progress=False, sections=["modle"])
    with pytest.raises(tp.InputError, match="with a checkpoint only"):
        report.reproduce(tmp_path, checkpoint="x.safetensors", progress=False, sections=["markov"])
