"""``tokenpatch compress --model smollm2-135m --prompt TEXT`` with every kind of prompt (issue 41, items 4 and 6):
a greeting, an instruction, a persona, plain text, arrow pairs without a label, a one-line ``Q: .. A: ..``, a
few-shot prompt, one calibration continuation, a queries file with a byte-order mark. Each ends with a patch
file (``tp.load_patch`` reads it), or with one line on stderr and exit status 2 before the model is asked
(a whitespace-only prompt). No path prints a traceback.

The command runs in this process (``main``), on SmolLM2's tokenizer and real weights, with the model loaded
once: the cases but one on SmolLM2 cut to its first two layers and the ridge grid cut to two values (what
the command does between the model's calls is the same; the fits are 15 times cheaper), the README's
instruction case on the whole model with one continuation. About a minute in all on 2 cores."""

from __future__ import annotations

import copy

import pytest

import tokenpatch as tp
from tokenpatch.thought import held_out
from tokenpatch.workbench.cli import lm_compress
from tokenpatch.workbench.cli.main import main

pytestmark = pytest.mark.slow

LM = "smollm2-135m"

PROMPTS = {  # the kinds of prompt a new user tries; none but "few-shot" holds demonstrations the model can go on with
    "greeting": "Hello",
    "instruction": "Translate the English word into French.",
    "persona": "You are a pirate. Answer every question like one.",
    "plain text": "The river ran cold through the valley, past the mill and the old stone bridge.",
    "arrow pairs": "hot -> cold\nbig -> small\n",
    "one line Q A": "Q: hot A: cold",
    "few-shot": "Q: hot\nA: cold\n\nQ: big\nA: small\n\nQ: up\nA: down",
}


@pytest.fixture(scope="module")
def shallow(smollm2):
    """SmolLM2 cut to its first two layers (its embeddings, final norm and head kept), and its tokenizer."""
    model, tokenizer = smollm2
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 2
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:2]
    small = type(model)(config).eval()
    keep = {
        k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2
    }
    small.load_state_dict(keep)
    return small, tokenizer


@pytest.fixture
def run(monkeypatch, capsys, tmp_path):
    """``run(model, *argv) -> (status, stdout, stderr, loads)``: the command in this process on ``model``."""
    loads = []

    def go(model, *argv):
        monkeypatch.setattr(lm_compress, "pretrained_for", lambda args: loads.append(1) or model)
        status = main(["compress", "--model", LM, *argv, "--quiet"])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return status, out, err, len(loads)

    return go


def _patched(status, out, err, path) -> tp.Patch:
    assert status == 0, err
    assert path.is_file() and f"{path}: thought patch" in out, (out, err)
    patch = tp.load_patch(path)
    assert patch.static and list(patch.keys())
    return patch


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_every_kind_of_prompt_ends_with_a_patch(shallow, run, tmp_path, monkeypatch, kind):
    """8 continuations: the ridge is chosen on a held-out quarter of them (two ridges here), or of the
    demonstrations cut from them."""
    monkeypatch.setattr(held_out.choose_ridge, "__defaults__", ((0.1, 10.0),))
    path = tmp_path / "p.safetensors"
    status, out, err, _ = run(shallow, "--prompt", PROMPTS[kind], "--calibration", "8", "--out", str(path))
    _patched(status, out, err, path)
    assert "chosen on a held-out quarter of them" in out, out


def test_one_continuation_on_the_whole_model(smollm2, run, tmp_path):
    """``--calibration 1``: too few to hold a quarter out; the ridge is the grid's middle, and said so."""
    path = tmp_path / "p.safetensors"
    status, out, err, _ = run(smollm2, "--prompt", "Answer in one word.", "--calibration", "1", "--out", str(path))
    _patched(status, out, err, path)
    assert "ridge 1 (1 calibration queries are too few to choose it on a held-out quarter" in out, out


def test_a_queries_file_with_a_byte_order_mark(shallow, run, tmp_path):
    """A BOM in front of the queries file is not part of the first query (its tokens would differ)."""
    queries = tmp_path / "queries.txt"
    queries.write_text("\ufeffhot\nbig\n", encoding="utf-8")
    seen, tokenizer = [], shallow[1]

    class Watch:
        def __call__(self, text, **kwargs):
            seen.append(text)
            return tokenizer(text, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    path = tmp_path / "p.safetensors"
    status, out, err, _ = run(
        (shallow[0], Watch()), "--prompt", "Opposites.", "--queries", str(queries), "--ridge", "1", "--out", str(path)
    )
    _patched(status, out, err, path)
    assert "hot" in seen and not any("\ufeff" in s for s in seen), seen


@pytest.mark.parametrize("prompt", [" ", "\n\n", " \t\n "])
def test_a_whitespace_prompt_is_one_line_before_the_model(shallow, run, tmp_path, prompt):
    status, out, err, loads = run(shallow, "--prompt", prompt, "--out", str(tmp_path / "p.safetensors"))
    assert status == 2 and loads == 0, (status, err)
    assert err.strip().splitlines() == [
        "tokenpatch compress: error: --prompt holds only whitespace; give the prompt's text"
    ]
    assert not (tmp_path / "p.safetensors").exists()
