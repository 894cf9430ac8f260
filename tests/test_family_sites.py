"""Families as site tables (issue 42): a block design is one ``Family`` record built by keyword, its
modules named by role and position; a layer's recording is its table of named sites, as typed
``LayerRecord`` fields."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import build, ids

import tokenpatch as tp
from tokenpatch.arch.families import FAMILIES
from tokenpatch.arch.family import Family
from tokenpatch.arch.hf_modules import HFModules
from tokenpatch.arch.record import LayerRecord

LLAMA = next(f for f in FAMILIES if f.name == "llama")


def test_a_family_is_built_by_keyword():
    """By keyword (the positional spelling of 0.2 warns: last test); the roles not given are Llama's names."""
    fam = Family(name="x", model_types=("x",), inputs=(), down="mlp.down_proj", mlp_norm=None)
    assert (fam.attn, fam.o_proj, fam.mlp, fam.layers) == ("self_attn", "self_attn.o_proj", "mlp", "layers")
    with pytest.raises(TypeError):  # a role that does not exist
        Family(name="x", model_types=("x",), inputs=(), down="d", mlp_norm=None, norm_after_mlp="n")


def test_a_llama_variant_with_another_norm_placement_is_one_record(float64_gemma_norms):
    """Llama's record with its norms moved after the sublayers (OLMo 2's placement: no norm before the
    MLP, one after the attention and one after the MLP, patched in its scale) is keyword arguments of
    one record: no new field, no branch; patched exactly on a tiny model of that design."""
    variant = dataclasses.replace(
        LLAMA,
        name="llama_norms_after",
        model_types=("olmo2",),
        mlp_norm=None,
        post_attn_norm="post_attention_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
    )
    model, x = build("olmo2"), ids(2, 10)
    FAMILIES.insert(0, variant)
    try:
        assert HFModules.family(model) is variant
        # the roles derived from the placement: s = m (the MLP's input), the MLP's contribution after its norm
        sites = {s.field: s for s in variant.sites(parallel=False)}
        assert (sites["s"].module, sites["s"].output, sites["m"].module) == ("mlp", False, "mlp")
        # p: the norm's input (the output matrix's output here; more where experts add theirs before the norm)
        assert (sites["p"].module, sites["p"].output) == ("post_feedforward_layernorm", False)
        assert variant.mlp_output == "post_feedforward_layernorm"
        assert variant.attention_output == "post_attention_layernorm"
        patch = tp.token_patch(model, x, query=[-1, 4])
        assert any(k.endswith("post_feedforward_layernorm.weight") for k in patch)  # the norm's scale
        result = tp.verify(model, patch, x)
        assert result.max_abs <= 1e-12, result.table()
    finally:
        FAMILIES.remove(variant)


@pytest.mark.parametrize("name", ["llama", "gpt_neox", "olmo2", "gemma3", "qwen2_moe", "opt_post"])
def test_the_recording_is_the_family_site_table(name):
    """``trace`` records, per layer, exactly the fields of its family's site table (and ``first``), as a
    ``LayerRecord``: one loop over the table, no per-key branches."""
    model, x = build(name), ids(2, 9)
    adapter = tp.adapter_for(model)
    parallel = HFModules.family(model).parallel(model.config)
    inputs = adapter.check_inputs(model, x)
    rec = adapter.trace(model, inputs, [2, 8])
    for i, r in enumerate(rec):
        assert isinstance(r, LayerRecord)
        fam = adapter._layer_family(model, i)
        assert set(r.tensors()) == {s.field for s in fam.sites(parallel)} | {"first"}, i
        assert r.h.shape[:2] == (2, 2)
        with pytest.warns(DeprecationWarning, match="record.m"):  # the read by key of earlier versions
            assert torch.equal(r["m"], r.m)


@pytest.mark.parametrize("name", ["jamba", "falcon_h1", "deepseek_v32"])
def test_each_layer_record_keeps_only_its_own_mixers(name):
    """``Family.at``: a layer with a recurrent mixer in place of attention gets that mixer's record
    (``recurrent`` is it, no lone-token shortcut); an attention layer keeps only the mixers that run
    beside attention (Falcon-H1's Mamba 2, DeepSeek V3.2's indexer), so ``recurrent`` is ``None`` there."""
    model = build(name)
    fam, layers = HFModules.family(model), HFModules().layers(model)
    in_place = [m for m in fam.mixers if not m.beside]
    for layer in layers:
        at = fam.at(layer)
        mine = next((m for m in in_place if m.found(layer)), None)
        if mine is None:
            assert at.recurrent is None and at.mixers == tuple(m for m in fam.mixers if m.beside)
            assert (at.attn, at.lone_zero) == (fam.attn, fam.lone_zero)
        else:
            assert at.recurrent is mine and at.mixers == (mine,)
            assert (at.attn, at.o_proj, at.lone_zero, at.value) == (mine.module, mine.out_proj, (), None)
    kinds = {fam.at(layer).recurrent is None for layer in layers}
    assert kinds == ({True, False} if in_place else {True})  # jamba: both kinds of layer


def test_the_spelling_of_0_2_still_builds_the_record_with_a_warning():
    """Kept one release: ``Family`` by position and with the 0.2 fields, each read into the role fields."""
    with pytest.warns(DeprecationWarning, match="by keyword"):
        opt_post = Family(
            "opt_post",
            ("opt",),
            "decoder.layers",
            None,
            "self_attn",
            ("fc1.weight",),
            "fc2",
            mlp="fc1",
            mlp_out="fc2",
            add_norm="self_attn_layer_norm",
            sum_norm="final_layer_norm",
            o_proj="self_attn.out_proj",
        )
    assert opt_post.matrices_out and opt_post.post_add_norms == ("self_attn_layer_norm", "final_layer_norm")
    assert opt_post.mlp_output == "fc2" and opt_post.sum_norm == "final_layer_norm"
    with pytest.warns(DeprecationWarning, match="by keyword"):
        moe = dataclasses.replace(LLAMA, name="m", experts=True, dense="llama", out_norm="post_feedforward_layernorm")
    assert moe.experts and moe.moe.dense == "llama" and moe.post_mlp_norm == "post_feedforward_layernorm"
    with pytest.warns(DeprecationWarning, match="post_mlp_norm"):
        assert moe.out_norm == "post_feedforward_layernorm"


def test_one_call_looks_each_layer_up_once_and_the_next_call_again(monkeypatch):
    """``Adapter.fixed``: inside ``token_patch``, ``generate`` and ``trajectory`` each layer's sites are
    looked up once (not once per pass and step); the next call looks again, so a model changed between
    calls (a layer's MLP given another object) is read as it is then."""
    model, x = build("llama"), ids(1, 6)
    calls = []
    look_up = HFModules._look_up_sites
    monkeypatch.setattr(HFModules, "_look_up_sites", lambda self, m, i: calls.append(i) or look_up(self, m, i))
    n = HFModules().n_layers(model)
    for run in (
        lambda: tp.token_patch(model, x, query="all"),
        lambda: tp.generate(model, x, max_new_tokens=3, progress=False),
        lambda: tp.trajectory(model, x),
    ):
        calls.clear()
        run()
        assert sorted(calls) == list(range(n))
    before = HFModules().sites(model, 0)
    model.model.layers[0].mlp = copy.deepcopy(model.model.layers[0].mlp)
    assert HFModules().sites(model, 0) == before  # the names are the same; the call looked them up again
    assert len(calls) == n + 2
    patch = tp.token_patch(model, x)
    assert tp.verify(model, patch, x).max_abs <= 1e-12


@pytest.mark.parametrize(("name", "layer"), [("gpt_neox_japanese", 2), ("doge", 1)])
def test_the_heads_give_the_mlp_input_of_a_layer_with_weights_or_a_bias_outside_the_attention(name, layer):
    """``mlp_input_from_heads`` maps a layer's heads (the input of ``o_proj``) to its MLP input: with the
    attention bias GPT-NeoX Japanese's last layer adds outside the module (``Family.attn_bias``; 3.6 off
    without it) and Doge's per-channel weight of the layer input (``Family.residual_weights``)."""
    model, x = build(name), ids(1, 7)
    fam, mod = HFModules()._layer(model, layer)
    seen = {}
    hooks = [
        mod.register_forward_pre_hook(lambda m, a: seen.setdefault("h", a[0].detach())),
        mod.get_submodule(fam.o_proj).register_forward_pre_hook(lambda m, a: seen.setdefault("z", a[0].detach())),
        mod.get_submodule(fam.mlp).register_forward_pre_hook(lambda m, a: seen.setdefault("s", a[0].detach())),
    ]
    with torch.no_grad(), tp.testing.float64_everywhere():  # the model's norms in float64, as the heads' copies
        model(x)
    for hook in hooks:
        hook.remove()
    s = HFModules().mlp_input_from_heads(model, layer, seen["h"][0, -1])(seen["z"][0, -1])
    torch.testing.assert_close(s, seen["s"][0, -1], rtol=0, atol=1e-12)


def test_per_channel_factors_are_the_layers_parameters():
    """ZAYA adds each sublayer as ``(y + b) g + (m + b') g'``, ``g`` and ``g'`` learned per channel: the
    output side's ``scale`` and ``residual`` are that layer's parameters (``Family.per_channel``); the head
    tools refuse the model (its attention convolves queries and keys, and they model constant factors)."""
    model = build("zaya")
    fam, site = HFModules.family(model), HFModules().sites(model, 1).output
    gates = model.model.layers[1].post_mlp_residual_scale
    assert fam.per_channel and site.kind == "experts"
    assert torch.equal(site.scale, gates.hidden_states_scale) and torch.equal(site.residual, gates.residual_scale)
    with pytest.raises(tp.UnsupportedModelError, match="head tools"):
        HFModules().mlp_input_from_heads(model, 0, torch.zeros(1, 64, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore::tokenpatch.thought.lstsq.ThoughtWarning")  # two calibration queries
def test_an_argument_that_is_the_layer_belows_output_is_carried():
    """ZAYA's layers pass their router state to the next layer beside the hidden states: the thought fit,
    which runs one layer at a time, gives each layer the one the layer below computed under the patch
    (``hf_calls.Carried``; with the captured unpatched one the one-query fit was 2e-8 off), and teacher
    mode, which has no with-prompt router state, refuses in one line."""
    from tokenpatch.arch.hf_calls import Carried

    model = build("zaya")
    _, calls = tp.adapter_for(model).layer_calls(model, ids(1, 5))
    assert [c[0][0] for c in calls[1:]] == [Carried(1)] * (len(calls) - 1) and calls[0][0][0] is None
    with pytest.raises(tp.UnsupportedModelError, match="mode='sequential'"):
        tp.thought_patch(model, ids(1, 8)[0], ids(2, 3), mode="teacher")
