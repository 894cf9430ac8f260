"""Hybrid models (``arch.recurrent``): a recurrent or convolutional mixer in some layers, attention in the
others. ``tests/test_hf.py`` checks each hybrid of ``conftest.CONFIGS`` like every other design (every
layer and the logits, chunks, padding, generation, trajectories, thought patches, files); this file
checks what is particular to a recurrent layer."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp
from tokenpatch.arch.hf_modules import HFModules
from tokenpatch.interp import ablation

T = pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import ids  # noqa: E402

from tokenpatch.testing import tiny_hf_model  # noqa: E402


def test_a_recurrent_layer_reading_its_pads_gets_unpadded_prefix_rows():
    """LFM2 with biases on its convolution's input projection: transformers' own forward of a left-padded
    row differs from the row alone (a pad's input, zeroed, becomes the bias), so the trajectory's prefix
    rows run without padding and equal the token patch of each prefix to the bit of float64."""
    model, x = tiny_hf_model("lfm2", conv_bias=True), ids(1, 10, seed=3)
    pad = torch.cat([torch.zeros(1, 4, dtype=torch.long), x[:, :6]], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 6)], 1).long()
    with torch.no_grad():  # the premise: left padding changes what the real tokens read
        padded = model(input_ids=pad, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        assert (padded[0, 4:] - model(input_ids=x[:, :6]).logits[0]).abs().max() > 1e-8
    assert not HFModules().pads_exactly(model)
    traj = tp.trajectory(model, x)
    for i in (0, 3, traj.query):
        want = tp.token_patch(model, traj.prefix_inputs(x, i)).dense()
        for key, delta in traj.patch(i).dense().items():
            torch.testing.assert_close(delta, want[key], rtol=0, atol=1e-12)


def test_attention_models_pad_exactly_and_recurrent_ones_are_not_trusted_to():
    assert HFModules().pads_exactly(tiny_hf_model("llama"))
    assert not any(HFModules().pads_exactly(tiny_hf_model(name)) for name in ("lfm2", "jamba", "falcon_h1", "mamba2"))


def test_a_float32_scan_gets_the_token_patch_of_each_prefix():
    """Mamba 2's chunked scan runs in float32 in transformers: padded, a prefix row's patch was 2e-8 off
    the prefix's own token patch (float64); unpadded, the same arithmetic as that token patch."""
    model, x = tiny_hf_model("mamba2"), ids(1, 8, seed=1)
    traj = tp.trajectory(model, x)
    for i in (2, 7):
        want = tp.token_patch(model, traj.prefix_inputs(x, i)).dense()
        for key, delta in traj.patch(i).dense().items():
            torch.testing.assert_close(delta, want[key], rtol=0, atol=1e-12)


def test_head_tools_refuse_a_recurrent_layer_by_name():
    model = tiny_hf_model("lfm2")
    with pytest.raises(
        tp.UnsupportedModelError,
        match=r"layer 0 of this lfm2 model mixes tokens by a gated short convolution \(conv\) in place of",
    ):
        with ablation.ablate_heads(model, [(1, 0)]):
            pass


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_a_block_without_an_mlp_is_patched_in_its_mixers_out_proj(name):
    """``out = h + W y`` (``y`` the scan's gated output): the context reaches the residual stream only
    through ``W`` = ``out_proj``, so the patch is its input change ``y_0 -> y_C`` alone, one per layer,
    and the lone token under it is the with-context one (without it, far from it)."""
    model, x = tiny_hf_model(name), ids(2, 9)
    patch = tp.token_patch(model, x, query=[-1, 4])
    assert sorted(patch) == [f"backbone.layers.{i}.mixer.out_proj:input" for i in range(3)]
    assert tp.verify(model, patch, x, query=[-1, 4]).max_abs <= 1e-12
    last, alone = tp.token_patch(model, x), tp.strip_context(model, x)
    with torch.no_grad():
        want = model(x).logits[:, -1]
        assert (model(**alone).logits[:, -1] - want).abs().max() > 1e-2
        assert (tp.functional_call(model, last, **alone).logits[:, -1] - want).abs().max() <= 1e-12


def test_nemotron_h_blocks_that_mix_no_tokens_change_nothing():
    """Nemotron-H's MLP and experts blocks read the layer input's norm, the same with and without the
    context: their input change is zero. Its experts' router computes in float32 whatever the model
    dtype, so a float64 model is exact to that rounding only (~1e-10 here, where the other designs give
    1e-16)."""
    kinds = ["linear_attention", "moe", "full_attention", "mlp"]
    model, x = tiny_hf_model("nemotron_h", layers_block_type=kinds, num_hidden_layers=4), ids(1, 8, seed=1)
    patch = tp.token_patch(model, x)
    for i in (1, 3):
        assert float(patch.dense()[f"model.layers.{i}.mixer:input"].abs().max()) == 0.0
    assert tp.verify(model, patch, x).max_abs <= 1e-8


def test_recurrent_gemma_refuses_padding_it_would_read():
    """RecurrentGemma's recurrent block runs its convolution and scan over left padding (transformers does
    not mask it): the padded row's own forward is not the prompt's, so a padded batch is refused in one
    line, and each prompt alone is exact."""
    model, x = tiny_hf_model("recurrent_gemma"), ids(1, 8, seed=3)
    pad = torch.cat([torch.full((1, 3), 7), x], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 8)], 1).long()
    with torch.no_grad():  # the premise
        padded = model(input_ids=pad, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        assert (padded[0, 3:] - model(input_ids=x).logits[0]).abs().max() > 1e-6
    with pytest.raises(tp.InputError, match="reads padding: transformers does not mask the input of its real-gated"):
        tp.token_patch(model, {"input_ids": pad, "attention_mask": mask})
    assert tp.verify(model, tp.token_patch(model, x), x).max_abs <= 1e-12


@torch.no_grad()
def test_recurrent_gemma_patched_forward_ignores_the_state_its_modules_keep():
    """RecurrentGemma keeps its decoding state in its modules: after a cached forward of another prompt, a
    one-token forward with ``use_cache`` continues from it. ``tp.functional_call`` runs it without a cache
    (``Adapter.forward_defaults``), so the stripped query under its patch is the with-context pass."""
    model, x = tiny_hf_model("recurrent_gemma"), ids(2, 9, seed=4)
    patch, stripped = tp.token_patch(model, x), tp.strip_context(model, x)
    want = model(x).logits[:, -1]
    model(ids(2, 6, seed=5))  # a cached forward (use_cache is the config's default) of other tokens
    assert model.config.use_cache
    torch.testing.assert_close(tp.functional_call(model, patch, **stripped).logits[:, -1], want, rtol=0, atol=1e-12)
