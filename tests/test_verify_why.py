"""``tp.verify`` says why a float64 model is not exact to float64 rounding when the reason is the model's:
the post-MLP RMSNorms that transformers computes in float32 whatever the dtype (OLMo 2/3, EXAONE 4,
Gemma 2/3, GLM-4). The report names those sites and points to ``tokenpatch.testing.float64_norms``."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp
from tokenpatch.testing import float64_norms, tiny_hf_model

pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import ids  # noqa: E402


@torch.no_grad()
@pytest.mark.parametrize("name", ["olmo2", "exaone4"])
def test_float32_norms_are_named_in_the_report(name):
    model = tiny_hf_model(name)
    x = ids(2, 9)
    result = tp.verify(model, tp.token_patch(model, x), x)
    assert not result.ok() and result.max_abs > 1e-9  # float32 rounding, as transformers computes them
    assert result.float32_sites == tuple(
        f"model.layers.{i}.post_feedforward_layernorm ({type(model.model.layers[i].post_feedforward_layernorm).__name__})"
        for i in range(3)
    )
    for text in (result.table(), str(result)):
        assert "model.layers.0.post_feedforward_layernorm" in text and "tokenpatch.testing.float64_norms" in text
    assert result.to_dict()["float32_sites"] == list(result.float32_sites)
    with float64_norms():  # the remedy the note names
        exact = tp.verify(model, tp.token_patch(model, x), x)
    assert exact.ok() and exact.max_abs <= 1e-12 and exact.float32_sites == () and "note" not in exact.table()


@torch.no_grad()
def test_no_note_where_the_model_computes_in_float64():
    model = tiny_hf_model("llama")
    x = ids(2, 9)
    result = tp.verify(model, tp.token_patch(model, x), x)
    assert result.ok() and result.float32_sites == () and result.why == ""
    f32 = tiny_hf_model("olmo2").float()  # in float32 the rule is relative and nothing is flagged
    assert tp.verify(f32, tp.token_patch(f32, x), x).float32_sites == ()
