"""``tp.save_lora``: a thought patch as a ``peft`` LoRA adapter folder, loaded by
``peft.PeftModel.from_pretrained`` onto the unmodified model, gives the logits of ``tp.apply`` of the
same patch: to float64 rounding on tiny random models of every dense family, to float32 rounding in
float32 (SmolLM2-135M: ``test_real_models.test_cli_compress_a_prompt_and_answer_without_it``, through
``tokenpatch compress --lora``). Gemma's norm scale is written whole (``modules_to_save``), biases as ``lora_bias``."""

from __future__ import annotations

import contextlib
import copy
import json
import warnings

import pytest
import torch
from conftest import CONFIGS, build, ids
from safetensors import safe_open

import tokenpatch as tp
from tokenpatch.lora import CONFIG_FILE, WEIGHTS_FILE
from tokenpatch.testing import MOE, float64_everywhere

peft = pytest.importorskip("peft")

DENSE = [name for name in CONFIGS if name not in MOE]  # stacked experts: no LoRA format (tested below)
FULL_FLOAT64 = ("xglm",)  # transformers cannot run it in float64 outside float64_everywhere
# a norm scale patched after the MLP is written whole; an output bias as peft's lora_bias
EXTRAS = {
    **dict.fromkeys(
        [
            "gemma2",
            "gemma3",
            "gemma3_multimodal",
            "olmo2",
            "olmo3",
            "exaone4",
            "glm4",
            "olmo_hybrid",
            "hyperclovax",
            "lfm3",
        ],
        ["modules_to_save"],
    ),
    # peft refuses a LoRA of a Mamba mixer's out_proj, and takes a jamba config (it counts experts) to have
    # fused experts named like its dense MLP's matrices: those are written whole
    **dict.fromkeys(["mamba", "falcon_mamba", "mamba2", "nemotron_h", "jamba_dense"], ["modules_to_save"]),
    # a dense Doge's config still counts experts (num_experts): its MLP matrices are written whole, as a
    # mixture of experts' are (lora._peft_retargets)
    "doge": ["modules_to_save"],
    **dict.fromkeys(
        [
            "gpt2",
            "openai-gpt",
            "gpt_neox",
            "gpt_neox_sequential",
            "starcoder2",
            "phi",
            "gptj",
            "falcon",
            "gpt_bigcode",
            "opt",
            "opt_post",
            "bloom",
            "jais2",
            "persimmon",
            "fuyu",
            "gpt_neo",
            "codegen",
            "biogpt",
            "recurrent_gemma",
            "gpt-sw3",
            "ctrl",
            "xglm",
            "modernbert-decoder",
        ],
        ["lora_bias"],
    ),
}


def _thought(model, rank=None, seed=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.ThoughtWarning)  # 16 calibration queries: rank-deficient, fine here
        return tp.thought_patch(model, ids(1, 6, seed)[0], ids(16, 4, seed + 1), rank=rank, progress=False)


def _logits(model, patch, folder, x):
    """``(tp.apply logits, peft logits, unpatched logits)`` on ``x``; peft on a copy of ``model``."""
    with torch.no_grad():
        base = model(x).logits
        with tp.apply(model, patch):
            want = model(x).logits
        lora = peft.PeftModel.from_pretrained(copy.deepcopy(model), folder).eval()
        got = lora(x).logits
    return want, got, base


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("rank", [None, 4])
def test_lora_equals_apply_in_float64(family, rank, tmp_path):
    model = build(family)
    # XGLM's own float64 forward needs it (its scores clamped at a float32 torch.full of finfo(float64).min)
    with float64_everywhere() if family in FULL_FLOAT64 else contextlib.nullcontext():
        thought = _thought(model, rank)
        export = tp.save_lora(model, thought, tmp_path / "adapter")
        want, got, base = _logits(model, thought.patch, tmp_path / "adapter", ids(3, 9, seed=7))
    assert export.extras == EXTRAS.get(family, [])
    assert float((want - base).abs().max()) > 1e-2  # the patch changes the model: the comparison means something
    assert float((got - want).abs().max()) <= tp.TOLERANCES["float64"][1]
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == config["lora_alpha"] == export.rank
    if rank is not None and export.targets:  # the rank-r patch: rank r per matrix, r per input change
        assert export.rank == rank  # (where every matrix is written whole, Mamba's out_proj, no LoRA rank)


def test_lora_in_float32_is_apply_to_rounding(tmp_path):
    model = build("llama").float()
    thought = _thought(model, 8)
    tp.save_lora(model, thought, tmp_path / "a")
    want, got, base = _logits(model, thought.patch, tmp_path / "a", ids(3, 9, seed=7))
    rel = float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())
    assert rel <= tp.TOLERANCES["float32"][1] and float((want - base).abs().max()) > 0.1
    with safe_open(tmp_path / "a" / WEIGHTS_FILE, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
        assert (
            json.loads(f.metadata()["tokenpatch"])["model"]["fingerprint"] == thought.patch.meta["model"]["fingerprint"]
        )


def test_the_norm_scale_is_written_whole_and_biases_as_lora_bias(tmp_path):
    gemma = build("gemma3")
    export = tp.save_lora(gemma, _thought(gemma), tmp_path / "g")
    assert export.whole == tuple(f"model.layers.{i}.post_feedforward_layernorm" for i in range(3))
    with safe_open(tmp_path / "g" / WEIGHTS_FILE, "pt") as f:
        norm = f.get_tensor("base_model.model.model.layers.0.post_feedforward_layernorm.weight")
    delta = _thought(gemma).patch["model.layers.0.post_feedforward_layernorm.weight"][0, 0]
    assert torch.equal(norm, gemma.model.layers[0].post_feedforward_layernorm.weight.detach() + delta)
    gpt2 = build("gpt2")
    export = tp.save_lora(gpt2, _thought(gpt2), tmp_path / "b")
    config = json.loads((tmp_path / "b" / CONFIG_FILE).read_text())
    assert export.lora_bias and config["lora_bias"] and config["fan_in_fan_out"]  # Conv1D weights [in, out]


def test_what_is_not_one_static_update_is_refused(tmp_path):
    model = build("llama")
    with pytest.raises(tp.InputError, match="not static .* export a thought patch"):
        tp.save_lora(model, tp.token_patch(model, ids(1, 6)), tmp_path / "a")
    two = tp.Patch.stack([_thought(model).patch, _thought(model, seed=3).patch])
    with pytest.raises(tp.InputError, match=r"holds \(2, 1\) patches .*pick one"):
        tp.save_lora(model, two, tmp_path / "a")
    with pytest.raises(tp.InputError, match="must be a tp.Patch or a thought patch, got str"):
        tp.save_lora(model, "patch.safetensors", tmp_path / "a")
    for name in (n for n in MOE if n != "longcat_flash"):  # LongCat-Flash's patch: a plain MLP (a LoRA)
        moe = build(name)
        with pytest.raises(
            tp.UnsupportedModelError,
            match=r"(experts\.(gate_up_proj|down_proj|mlp\.w1)|mlp\.input_linear\.weight) .* a LoRA cannot target",
        ):
            tp.save_lora(moe, _thought(moe), tmp_path / name)
        assert not (tmp_path / name).exists()


def test_another_models_patch_and_used_folders_are_refused(tmp_path):
    model, other = build("llama"), build("llama", seed=1)
    thought = _thought(model)
    with pytest.raises(tp.InputError, match="fingerprint|another model|different weights"):
        tp.save_lora(other, thought, tmp_path / "a")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(tp.InputError, match="is a folder that is not empty; choose a new folder"):
        tp.save_lora(model, thought, tmp_path / "used")
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]
    with pytest.raises(tp.InputError, match="does not exist; create it first"):
        tp.save_lora(model, thought, tmp_path / "missing" / "a")
    (tmp_path / "empty").mkdir()  # an empty folder is taken
    tp.save_lora(model, thought, tmp_path / "empty")
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
