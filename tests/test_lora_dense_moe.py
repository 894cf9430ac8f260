"""``tp.save_lora`` on a Qwen3-MoE whose layers are all dense (issue 41, item 4): peft read the dense MLP's
``gate_proj`` / ``up_proj`` / ``down_proj`` targets as the experts of transformers 4 and dropped them
(``NoMatchingPeftModuleError``); they are written whole (``modules_to_save``), and peft's model equals
``tp.apply`` to float64 rounding."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

import tokenpatch as tp
from tokenpatch.lora import CONFIG_FILE
from tokenpatch.testing import tiny_hf_model

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("dense", [dict(mlp_only_layers=[0, 1, 2]), dict(decoder_sparse_step=100)])
def test_a_lora_of_an_all_dense_qwen3_moe_loads_in_peft(tmp_path, dense):
    model = tiny_hf_model("qwen3_moe", **dense)
    assert not any("experts" in name for name, _ in model.named_parameters())
    g = torch.Generator().manual_seed(1)
    ids = lambda b, t: torch.randint(0, model.config.vocab_size, (b, t), generator=g)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.ThoughtWarning)
        thought = tp.thought_patch(model, ids(1, 6)[0], ids(16, 4), progress=False)
    export = tp.save_lora(model, thought, tmp_path / "adapter")
    x = ids(3, 9)
    with torch.no_grad():
        base = model(x).logits
        with tp.apply(model, thought.patch):
            want = model(x).logits
        got = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter").eval()(x).logits
    assert float((want - base).abs().max()) > 1e-2
    assert float((got - want).abs().max()) <= tp.TOLERANCES["float64"][1]
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    assert sorted(config["modules_to_save"]) == sorted(export.whole)
    assert all(m.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj") for m in export.whole) and export.whole
