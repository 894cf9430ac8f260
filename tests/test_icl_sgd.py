"""ICL against explicit gradients on Hugging Face models (``tokenpatch icl-sgd``): the explicit gradient
is the autograd gradient of the stated loss at the implicit weights, patches that change a module's
input included; and the whole measurement runs end to end on a tiny model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import build, float64_gemma_norms  # noqa: F401 (a fixture)

import tokenpatch as tp
from tokenpatch.dynamics.online_sgd import gradient_at, matrix_deltas
from tokenpatch.workbench import icl_sgd
from tokenpatch.workbench.report import icl_sgd_figures, icl_sgd_page


class CharTokenizer:
    """One token per character (ids 3..), 0 pads, 1 ends: enough for the word-pair prompts."""

    pad_token_id, eos_token_id = 0, 1

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3 + ord(c) % 97 for c in text]}

    def batch_decode(self, rows, skip_special_tokens: bool = True) -> list[str]:
        return ["".join(chr(97 + (int(t) - 3) % 26) for t in row if int(t) > 2) for row in rows]


def _runs(tasks=("country_capital", "present_past")) -> icl_sgd.Runs:
    from tokenpatch.tasks.wordpairs import load_task
    from tokenpatch.workbench.report.compress import FORMATS

    return icl_sgd.encode_runs(CharTokenizer(), [load_task(t) for t in tasks], [2], FORMATS["arrow"], 3, 4, 0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_answer_nll_is_the_full_logits_one(family, float64_gemma_norms):  # noqa: F811
    """Logits only at the answer predictors: the same numbers as every position's logits, row by row."""
    model = build(family)
    batch, answer = _runs().heldout(4)
    got = icl_sgd.answer_nll(model, batch, answer)
    logp = model(**batch, use_cache=False).logits.log_softmax(-1)  # [B, T, vocab]
    ids = batch["input_ids"]
    for b, a in enumerate(answer.tolist()):
        t = ids.shape[1]
        want = -sum(float(logp[b, p, ids[b, p + 1]]) for p in range(t - 1 - a, t - 1))
        assert abs(float(got[b] - want)) < 1e-12, (b, float(got[b]), float(want))
    assert answer.min() < answer.max()  # rows of different answer lengths in one batch


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_gradient_at_the_implicit_weights_is_autograds(family, float64_gemma_norms):  # noqa: F811
    model = build(family)
    for p in model.parameters():
        p.requires_grad_(False)
    runs = _runs()
    patch = tp.token_patch(model, runs.prefix(2), progress=False)  # an input change and an output matrix per layer
    names = sorted(matrix_deltas(model, patch))
    assert any(n.endswith("gate_proj.weight") for n in names) and any(n.endswith("down_proj.weight") for n in names)
    loss, _ = icl_sgd.losses(model, runs)
    got = gradient_at(model, loss, 1, names, patch=patch)
    batch, answer = runs.example(1)
    for b in range(2):
        twin = copy.deepcopy(model)
        with tp.apply(twin, patch[b, 0]):  # W + W D on the readers: the weights the patch stands for
            params = dict(twin.named_parameters())
            for n in names:
                params[n].requires_grad_(True)
            one = {k: v[b : b + 1] for k, v in batch.items()}
            want = torch.autograd.grad(
                icl_sgd.answer_nll(twin, one, answer[b : b + 1]).sum(), [params[n] for n in names]
            )
        for n, w in zip(names, want):
            assert torch.allclose(got[n].dense()[b], w, rtol=0, atol=1e-10), (b, n)
        assert max(float(w.abs().max()) for w in want) > 1e-4


def test_the_page_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    model = build("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    monkeypatch.setitem(
        icl_sgd_page.SETTINGS, "tiny", ([2], "arrow", {"country_capital": 1.0, "present_past": 0.1, "antonym": 1.0})
    )
    monkeypatch.setattr(icl_sgd_page, "FULL", {"sgd": 2, "adam": 2})
    data = icl_sgd_page.measure(model, CharTokenizer(), "tiny", shots=3, tests=3, monitor=3, seed=0, progress=False)
    s = data["steps"]
    assert s["chosen_lr"] in s["lrs"] and len(s["per_layer"]["gradient"]) == 3
    assert len(s["heldout_icl"]) == len(s["heldout_sgd"]) == 4 and data["untrained"]["lrs"] == [s["chosen_lr"]]
    for key in ("gradient", "gradient_shuffled", "gradient_other_run", "random", "sgd_step", "sgd_weights"):
        v = s["overall"][key]
        assert -1 <= v["lo"] <= v["mean"] <= v["hi"] <= 1, key
    assert set(data["whole"]["methods"]) == {"online_sgd", "sgd", "adam"}
    w = data["whole"]
    held = {float(k): v for k, v in w["adam_heldout"].items()}
    assert set(held) == set(icl_sgd_page.ADAM_LRS) and w["lrs"]["adam"] == min(held, key=held.get)
    for rec in data["whole"]["methods"].values():
        assert 0 < rec["ceiling_overall"]["mean"] <= 1 and len(rec["simaou"]) == 3
    assert set(data["accuracy"]) == {"icl", "zero_shot", "thought_patch", "online_sgd", "sgd", "adam"}
    mon = data["monitor"]
    assert mon["answers"] == 9 and len(mon["detail"]["norms"][0]) == 3 and len(mon["detail"]["right"]) == 9
    paths = {k: tmp_path / f"x.{k}" for k in ("md", "json")}
    paths |= {k: tmp_path / f"x-{k}.png" for k in ("steps", "curves", "whole", "monitor")}
    icl_sgd_figures.figures(data, paths)
    text = icl_sgd_figures.markdown({**data, "threads": 1, "seconds": {**data["seconds"], "total": 1.0}}, paths)
    assert "## 4. Monitoring" in text and all(paths[k].stat().st_size > 10_000 for k in ("steps", "curves", "whole"))
    json.dumps(data)


def test_separation_scores_wrong_answers_and_says_when_it_cannot():
    from tokenpatch.workbench.monitor import separation

    answers = {
        "right": [True, True, False, False],
        "norms": [[1.0, 5.0], [2.0, 6.0], [3.0, 1.0], [4.0, 2.0]],
        "probability": [0.9, 0.8, 0.3, 0.2],
        "margin": [3.0, 2.0, 1.0, 0.5],
    }
    sep = separation(answers)
    assert (sep["answers"], sep["wrong"]) == (4, 2)
    assert [r["mean"] for r in sep["per_layer"]] == [1.0, 0.0]  # layer 0 flags the wrong ones, layer 1 the right
    assert sep["probability"]["mean"] == 1.0 and sep["margin"]["mean"] == 1.0
    none = separation({**answers, "right": [True] * 4})
    assert none["per_layer"] is None and none["wrong"] == 0


def test_the_command_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    from tokenpatch.workbench.cli.main import main

    assert main(["icl-sgd", "--model", "smollm2-135m", "--shots", "12", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--shots 12" in err
    (tmp_path / "icl-sgd-smollm2-135m.json").write_text("{}")
    assert main(["icl-sgd", "--model", "smollm2-135m", "--out", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["icl-sgd", "--model", "gpt-5", "--out", str(tmp_path)])
