"""Hugging Face adapters on tiny random models built from configs (no downloads), float64.

One model per block design (``tokenpatch/arch/families.py``), with every norm weight and bias moved off
its initial value (identity norms and zero biases hide bugs). The claims: the patched no-context
pass reproduces every layer's hidden state and the logits (``tp.verify``), greedy generation
without the prompt is ordinary greedy generation, a left-padded batch gives each prompt's own
patches, and the patch runs through ``functional_call``, ``apply`` and a save/load round trip.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import tokenpatch as tp
from tokenpatch.arch import adapter_for, hf_calls
from tokenpatch.arch.hf_modules import HFModules
from tokenpatch.testing import EAGER_ONLY
from tokenpatch.thought import lm_output as thought_lm_output

T = pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import CONFIGS, GEMMAS, VOCAB, build, ids  # noqa: E402

# transformers reads their left padding (RecurrentGemma's recurrent block; the indexers of DeepSeek V3.2,
# dots.llm3 Note and A.X-K2 rank pad keys; MiniMax's lightning attention): a padded batch is refused
# (test_padding_read_by_the_model_is_refused)
READS_PADS = ("recurrent_gemma", "deepseek_v32", "glm_moe_dsa", "dots3_note_text", "dots3_note", "axk2", "minimax")

# The padded tests leave out the models transformers runs with eager attention only: it gives NaN on
# left padding (Gemma 2, Bloom, VaultGemma, MPT; refused in one line) or, GPT-Neo's, computes the scores in
# float32, so a padded row and the same row alone differ by ~1e-10 (benchmarks/hf_families.py: 2e-10).


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_layer_and_the_logits(name, float64_gemma_norms):
    model, x = build(name), ids(2, 12)
    patch = tp.token_patch(model, x, query=[-1, -4, 3])
    result = tp.verify(model, patch, x)
    assert result.max_abs <= 1e-12, result.table()
    assert result.per_layer[-1].name == "output" and result.per_layer[-1].max_abs <= 1e-12
    assert len(result.per_layer) == adapter_for(model).n_layers(model) + 1


@pytest.mark.parametrize("name", GEMMAS)
def test_gemma_float32_norm_is_the_only_error(name):
    """With Gemma's own norm (float32 inside a float64 model) the error is that rounding, ~1e-7;
    the same patch construction with the norm in float64 is exact (previous test)."""
    model, x = build(name), ids(2, 12)
    result = tp.verify(model, tp.token_patch(model, x), x)
    assert 1e-12 < result.max_abs <= 1e-5, result.table()


def test_gemma_scale_patch_is_zero_where_nothing_changes(float64_gemma_norms):
    """A query with no context before it needs no change: the down_proj and norm-scale deltas are 0
    (the new down output is the multiple of t / scale closest to the old one, which is the old one)."""
    model, x = build("gemma3"), ids(1, 1)
    patch = tp.token_patch(model, x)
    for name, delta in patch.dense().items():
        assert float(delta.abs().max()) == 0, name
    # the first real token of a left-padded row has no context either; the other row's query has some
    batch = {"input_ids": torch.tensor([[5, 6, 7], [0, 0, 7]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 1]])}
    padded = tp.token_patch(model, batch).dense()
    assert all(float(d[1].abs().max()) == 0 for d in padded.values())
    assert all(float(d[0].abs().max()) > 0 for k, d in padded.items() if "post_feedforward" in k)


def test_gemma_zero_scale_channels(float64_gemma_norms):
    """Channels where the post-feedforward norm's scale 1 + w is exactly 0 (Gemma 3 270M has nine):
    the textbook construction divides by it; they get their own scale instead."""
    model, x = build("gemma3"), ids(2, 12)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_feedforward_layernorm.weight[[3, 17, 40]] = -1.0
    patch = tp.token_patch(model, x)
    scale = patch["model.layers.1.post_feedforward_layernorm.weight"]  # [B, Q, d]
    assert torch.isfinite(scale).all() and bool((scale[..., [3, 17, 40]] != 0).all())
    assert tp.verify(model, patch, x).max_abs <= 1e-12


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunk_removed_and_keep_bos(name, float64_gemma_norms):
    """A chunk removed from the middle: the other context tokens stay, unpatched; the patches act at
    the queries' positions in the shorter sequence, and act together (two queries here)."""
    model, x = build(name), ids(2, 12)
    patch = tp.token_patch(model, x, query=[-1, 7], remove=slice(2, 6))
    assert patch.acts == "at_positions" and patch.positions == (7, 3)
    assert tp.verify(model, patch, x).max_abs <= 1e-12
    bos = tp.token_patch(model, x, keep_bos=True)  # the first token and the query
    stripped = tp.strip_context(model, x, keep_bos=True)
    assert stripped["input_ids"].shape == (2, 2) and stripped["position_ids"][0].tolist() == [0, 11]
    assert tp.verify(model, bos, x).max_abs <= 1e-12
    with torch.no_grad():
        got = tp.functional_call(model, bos, **stripped).logits[:, -1]
        torch.testing.assert_close(got, model(x).logits[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in EAGER_ONLY + READS_PADS])  # refused
def test_padded_batch_gives_each_prompts_patches(name, float64_gemma_norms):
    model = build(name)
    a, b = ids(1, 12, seed=2), ids(1, 7, seed=3)
    batch = {
        "input_ids": torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)]),
        "attention_mask": torch.cat([torch.ones(1, 12), torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], 1)]).long(),
    }
    both = tp.token_patch(model, batch, query=[-1, -2])
    for row, alone in ((0, tp.token_patch(model, a, query=[-1, -2])), (1, tp.token_patch(model, b, query=[-1, -2]))):
        for name_, delta in both.dense().items():
            torch.testing.assert_close(delta[row], alone.dense()[name_][0], rtol=0, atol=1e-12)
    assert tp.verify(model, both, batch).max_abs <= 1e-12
    stripped = tp.strip_context(model, batch, query=[-1, -2])
    assert stripped["position_ids"].flatten().tolist() == [11, 10, 6, 5]  # each token keeps its own position


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa", "minimax"])
def test_padding_read_by_the_model_is_refused(name):
    """DeepSeek V3.2's indexer ranks every key, pads included, and MiniMax's lightning attention reads
    them too: transformers' own forward of a left-padded row is not the row's (the premise, in float64),
    so a padded batch is refused in one line naming the layer kind, and each prompt alone is exact (the
    indexer keeping 4 of its keys)."""
    model, x = build(name), ids(1, 9, seed=3)
    pad = torch.cat([torch.full((1, 3), 7), x], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 9)], 1).long()
    with torch.no_grad(), tp.testing.float64_everywhere():
        padded = model(input_ids=pad, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        assert (padded[0, 3:] - model(input_ids=x).logits[0]).abs().max() > 1e-9
        with pytest.raises(
            tp.InputError, match="reads padding: transformers does not mask the input of its (indexed|lig)"
        ):
            tp.token_patch(model, {"input_ids": pad, "attention_mask": mask})
        assert tp.verify(model, tp.token_patch(model, x, query="all"), x).max_abs <= 1e-12


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generation_without_the_prompt(name, float64_gemma_norms):
    model, x = build(name), ids(2, 9)
    gen = tp.generate(model, x, max_new_tokens=20)
    ordinary = model.generate(x, max_new_tokens=20, do_sample=False)[:, 9:]
    assert torch.equal(gen.tokens, ordinary)
    assert bool(gen.agree.all()) and float(gen.logit_error.max()) <= 1e-12
    adapter = adapter_for(model)
    sites = [adapter.sites(model, i) for i in range(adapter.n_layers(model))]
    mixing = torch.tensor([bool(s.inputs) or s.output is not None for s in sites])  # Nemotron-H's MLP blocks: not
    assert gen.update_norms.shape == (2, 20, len(sites)) and torch.equal(gen.update_norms[0, 0] > 0, mixing)


@torch.no_grad()
def test_update_norms_are_the_weight_updates(float64_gemma_norms):
    """generate's per-layer norm: the input change D counts as W D on each matrix reading it."""
    model, x = build("llama"), ids(1, 9)
    gen = tp.generate(model, x, max_new_tokens=1)
    patch = tp.token_patch(model, x)
    w = {n: p for n, p in model.named_parameters()}
    for i in range(3):
        d = patch[f"model.layers.{i}.mlp:input"].dense()[0, 0]
        parts = [w[f"model.layers.{i}.mlp.{m}.weight"] @ d for m in ("gate_proj", "up_proj")]
        parts.append(patch[f"model.layers.{i}.mlp.down_proj.weight"].dense()[0, 0])
        want = torch.stack([p.norm() for p in parts]).norm()
        torch.testing.assert_close(gen.update_norms[0, 0, i], want, rtol=1e-12, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("name", list(CONFIGS))
def test_functional_call_apply_and_save_round_trip(name, tmp_path, float64_gemma_norms):
    """Gemma 2/3 and OLMo 2: a dense norm-scale delta per layer; MoE: the input change reaches the
    router and the stacked experts (apply writes W + W D into each); GPT-2: Conv1D weights stored
    [in, out]; Phi-3: one fused gate_up_proj; parallel blocks: output deltas only."""
    model, x = build(name), ids(1, 10)
    patch = tp.token_patch(model, x)
    adapter = adapter_for(model)
    sites = [adapter.sites(model, i) for i in range(adapter.n_layers(model))]  # a parallel block's MLP input: none
    assert [k for k in patch if k.endswith(":input")] == [f"{s.input_site}:input" for s in sites if s.input_site]
    assert all(len(patch.readers[f"{s.input_site}:input"]) == len(s.inputs) for s in sites if s.input_site)
    want = model(x).logits[:, -1]
    stripped = tp.strip_context(model, x)
    hooked = tp.functional_call(model, patch, **stripped).logits[:, -1]
    with tp.apply(model, patch):
        written = model(**stripped).logits[:, -1]
    tp.save_patch(patch, tmp_path / "p.safetensors")
    back = tp.load_patch(tmp_path / "p.safetensors", model)
    reloaded = tp.functional_call(model, back, **stripped).logits[:, -1]
    for got in (hooked, written, reloaded):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(model(**stripped).logits[:, -1], build(name)(**stripped).logits[:, -1], rtol=0, atol=0)


@torch.no_grad()
def test_gpt2_needs_the_original_position():
    """Absolute position embeddings: the stripped query keeps its position id; at position 0 the
    patched pass would be wrong (this is what strip_context's position_ids are for), so leaving them
    out is refused (``tests/test_no_silent_core.py``)."""
    model, x = build("gpt2"), ids(1, 10)
    patch = tp.token_patch(model, x)
    stripped = tp.strip_context(model, x)
    want = model(x).logits[:, -1]
    right = tp.functional_call(model, patch, **stripped).logits[:, -1]
    with pytest.raises(tp.InputError, match="position_ids"):
        tp.functional_call(model, patch, input_ids=stripped["input_ids"])
    zero = torch.zeros_like(stripped["position_ids"])  # given ids are the caller's: not compared
    wrong = tp.functional_call(model, patch, input_ids=stripped["input_ids"], position_ids=zero).logits[:, -1]
    assert float((right - want).abs().max()) <= 1e-12 < float((wrong - want).abs().max())


def test_bad_inputs_get_one_clear_line():
    model = build("llama")
    with pytest.raises(tp.InputError, match="vocabulary"):
        tp.token_patch(model, torch.tensor([[1, 2, VOCAB]]))
    with pytest.raises(tp.InputError, match="integer tensor"):
        tp.token_patch(model, torch.ones(1, 4))
    with pytest.raises(tp.InputError, match="pad on the left"):
        tp.token_patch(model, {"input_ids": ids(1, 6), "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])})
    with pytest.raises(tp.InputError, match="keep_bos"):
        tp.token_patch(model, ids(1, 6), remove=slice(1, 3), keep_bos=True)
    model.train()
    with pytest.raises(tp.InputError, match="model.eval"):
        tp.token_patch(model, ids(1, 6))


def test_unknown_architecture_lists_the_supported_ones():
    config = T.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=50
    )
    model = T.AutoModelForMaskedLM.from_config(config).eval()
    with pytest.raises(tp.UnsupportedModelError, match=r"model_type 'bert'.*gemma3_text.*gpt2.*gpt_neox.*llama"):
        tp.token_patch(model, torch.tensor([[1, 2, 3]]))


def test_eager_attention_with_padding_names_the_cause():
    model = build("llama", attn="eager")
    batch = {"input_ids": ids(2, 6), "attention_mask": torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])}
    with pytest.raises(tp.InputError, match="sdpa"):
        tp.token_patch(model, batch)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in EAGER_ONLY])
def test_trajectory_is_the_token_patch_of_every_prefix(name, float64_gemma_norms):
    model, x = build(name), ids(2, 8)
    traj = tp.trajectory(model, x, query=-2)
    for i in range(traj.query + 1):
        want = tp.token_patch(model, traj.prefix_inputs(x, i)).dense()
        for key, delta in traj.patch(i).dense().items():
            torch.testing.assert_close(delta, want[key], rtol=0, atol=1e-12)
    assert tp.verify(model, traj.patch(4), traj.prefix_inputs(x, 4)).max_abs <= 1e-12
    steps = tp.trajectory(model, x, query=-2, steps=True)
    for i in range(1, steps.query + 1):  # the increment: prefix i with c_i removed, acting at the query
        want = tp.token_patch(model, steps.prefix_inputs(x, i), remove=slice(i - 1, i)).dense()
        for key, delta in steps.step(i).dense().items():
            torch.testing.assert_close(delta, want[key], rtol=0, atol=1e-12)
    assert tp.verify(model, steps.step(5), steps.prefix_inputs(x, 5)).max_abs <= 1e-12


@torch.no_grad()
# Gemma 2 and MPT run eager attention, whose softmax is float32 whatever the model dtype: the prompt's
# cache and the full forward differ by ~2e-8 there (Gemma 3 under eager too); Gemma 3 under sdpa covers
# the form, and MPT's other tests cover its block
@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in ("gemma2", "mpt")])
def test_thought_patch_of_one_query_is_exact_there(name, float64_gemma_norms):
    """One calibration query: the least-squares fit interpolates it (the token patch), so the
    prompt-free model under the static patch gives the with-prompt logits at that query."""
    model = build(name)
    prompt, query = ids(1, 12, seed=4)[0], ids(1, 1, seed=5)
    with pytest.warns(tp.ThoughtWarning, match="rank-deficient"):  # one position: the minimum-norm interpolant
        fit = tp.thought_patch(model, prompt, query)
    parallel = HFModules.family(model).parallel(model.config)  # no input side: the MLP input does not change
    assert fit.patch.static and any(k.endswith(":input") for k in fit.patch) != parallel
    want = model(torch.cat([prompt[None], query], 1)).logits[:, -1]
    got = tp.functional_call(model, fit.patch, query).logits[:, -1]
    assert float((got - want).abs().max()) <= 1e-10 < float((model(query).logits[:, -1] - want).abs().max())


@torch.no_grad()
@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")  # deep layers' systems are ill-conditioned here
def test_thought_patch_generalises_and_round_trips(tmp_path):
    model = build("gpt2")
    prompt, cal, test = ids(1, 12, seed=6)[0], ids(300, 2, seed=7), ids(100, 2, seed=8)
    patch = tp.thought_patch(model, prompt, cal).patch
    want = model(torch.cat([prompt[None].expand(100, -1), test], 1)).logits[:, 12:]
    err = lambda p: float(((tp.functional_call(model, p, test).logits - want) ** 2).mean())  # noqa: E731
    base = float(((model(test).logits - want) ** 2).mean())
    assert err(patch) < 0.1 * base  # held-out queries: most of the prompt's effect is kept
    tp.save_patch(patch, tmp_path / "t.safetensors")
    assert err(tp.load_patch(tmp_path / "t.safetensors", model)) == pytest.approx(err(patch), rel=1e-9)
    hooked = err(patch)
    with tp.apply(model, patch):  # W + W D written into every matrix reading the MLP input
        assert float(((model(test).logits - want) ** 2).mean()) == pytest.approx(hooked, rel=1e-9)


def test_thought_patch_gemma_output_side(float64_gemma_norms):
    """Gemma's output side: ``down_proj`` aimed at the directions the post-MLP norm must output,
    then the norm's scale per channel; the input side alone stays available."""
    model = build("gemma3")
    with torch.no_grad():  # channels whose scale is exactly 0, as real Gemma 3 270M has
        model.model.layers[1].post_feedforward_layernorm.weight[:3] = -1.0
    prompt, cal = ids(1, 10, seed=9)[0], ids(20, 2, seed=10)
    with pytest.warns(tp.ThoughtWarning, match="rank-deficient"):  # 20 queries of 2 tokens: fewer positions than d
        both = tp.thought_patch(model, prompt, cal)
        inputs_only = tp.thought_patch(model, prompt, cal, output=None)
    assert all(
        bool(torch.isfinite(t).all())
        for d in both.patch.values()
        for t in ((d.u, d.v) if isinstance(d, tp.LowRank) else (d,))
    )
    ends = (":input", "down_proj.weight", "post_feedforward_layernorm.weight")
    assert {k.rpartition(".layers.")[2].partition(".")[2] for k in both.patch} == {
        "mlp:input",
        "mlp.down_proj.weight",
        "post_feedforward_layernorm.weight",
    }
    assert all(k.endswith(ends) for k in both.patch)
    assert all(k.endswith(":input") for k in inputs_only.patch)
    with pytest.raises(tp.InputError, match="without a bias"), pytest.warns(tp.ThoughtWarning):
        tp.thought_patch(model, prompt, cal, output="vector")


@torch.no_grad()
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_thought_patch_of_ragged_queries_after_a_kept_bos(name):
    """Queries of different lengths (padded on the right inside the fit, the padding never fitted)
    after a BOS kept in both passes: with fewer positions than dimensions the fit interpolates,
    so every calibration query alone, after the BOS, gets the with-prompt logits."""
    model = build(name)
    prompt = ids(1, 10, seed=11)[0]
    queries = [ids(2, 3, seed=12), ids(1, 2, seed=13)]
    with pytest.warns(tp.ThoughtWarning, match="rank-deficient"):
        fit = tp.thought_patch(model, prompt, queries, keep_bos=True)
    assert [f.n for f in fit.fits] == [8] * 3 and fit.patch.meta["thought"]["keep_bos"]  # 2 x 3 + 2 real positions
    for q in queries:
        want = model(torch.cat([prompt[None].expand(len(q), -1), q], 1)).logits[:, 10:]
        alone = torch.cat([prompt[None, :1].expand(len(q), -1), q], 1)  # [BOS, q]
        got = tp.functional_call(model, fit.patch, alone).logits[:, 1:]
        assert float((got - want).abs().max()) <= 1e-9 < float((model(alone).logits[:, 1:] - want).abs().max())
    with pytest.warns(tp.ThoughtWarning):
        band = tp.thought_patch(model, prompt, queries, keep_bos=True, layers=[1])
    assert {re.search(r"\.(?:layers|h)\.(\d+)\.", k).group(1) for k in band.patch} == {"1"}
    with pytest.raises(tp.InputError, match="layers"):
        tp.thought_patch(model, prompt, queries, layers=[5])


@torch.no_grad()
def test_gemma_output_side_closes_most_of_what_the_input_side_leaves(float64_gemma_norms):
    """With several positions the post-MLP norm's per-position magnitudes cannot all be met by one
    scale (docs/prompt-compression.md): not exact, but far closer than the input side alone."""
    model = build("gemma3")
    prompt, q = ids(1, 10, seed=11)[0], ids(3, 3, seed=12)
    want = model(torch.cat([prompt[None].expand(3, -1), q], 1)).logits[:, 10:]
    err = {}
    for output in ("affine", None):
        with pytest.warns(tp.ThoughtWarning, match="rank-deficient"):
            fit = tp.thought_patch(model, prompt, q, output=output)
        err[output] = float((tp.functional_call(model, fit.patch, q).logits - want).abs().max())
    assert err["affine"] < 0.2 * err[None]


@torch.no_grad()
@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_the_prompt_cache_copied_a_row_at_a_time_gives_the_same_fit(name, monkeypatch, float64_gemma_norms):
    """The targets read the prompt's keys and values from copies of one cache, as many rows per copy
    as ``TARGET_CACHE_BYTES`` allows: one row per copy is the same fit."""
    model = build(name)
    prompt, queries = ids(1, 9, seed=21)[0], ids(5, 3, seed=22)
    whole = tp.thought_patch(model, prompt, queries, ridge=1e-2).patch
    monkeypatch.setattr(hf_calls, "TARGET_CACHE_BYTES", 1)
    rows = tp.thought_patch(model, prompt, queries, ridge=1e-2).patch
    assert set(whole) == set(rows)
    for key in whole:
        a, b = (d.dense() if hasattr(d, "dense") else d for d in (whole[key], rows[key]))
        assert float((a - b).abs().max()) <= 1e-12 * max(1.0, float(a.abs().max()))


@torch.no_grad()
@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")
def test_thought_patch_of_many_ragged_queries_in_several_chunks():
    """More rows than one padded chunk holds (256), the later chunk wider: every real position is
    fitted once, none of the padding."""
    model = build("llama")
    fit = tp.thought_patch(
        model, ids(1, 8, seed=14)[0], [ids(260, 2, seed=15), ids(40, 4, seed=16)], keep_bos=True, ridge=1e-3
    )
    assert [f.n for f in fit.fits] == [260 * 2 + 40 * 4] * 3  # chunks of width 2 and 4


@torch.no_grad()
@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")
@pytest.mark.parametrize(
    ("name", "layer"), [("llama", 1), ("gpt2", 1), ("gpt_neox", 1), ("qwen2_moe", 0), ("gemma3", 1)]
)
def test_the_next_layers_stream_is_written_from_the_output_sides_pass(name, layer, float64_gemma_norms):
    """The fit writes the next layer's input from its output-side pass (run under the input change
    only) instead of running the layer again: for each output kind (matrix, bias, a parallel block,
    a gated shared expert, a post-MLP norm) it equals the layer's output under all its deltas."""
    from tokenpatch.arch import adapter_for
    from tokenpatch.run import hooked

    model, adapter = build(name), adapter_for(build(name))
    patch = tp.thought_patch(model, ids(1, 10, seed=20)[0], ids(12, 3, seed=21)).patch
    mine = patch.replace({k: d for k, d in patch.items() if f".{layer}." in k})  # this layer's deltas
    inputs = {k: d for k, d in mine.items() if k.endswith(":input")}  # none on a parallel block
    inputs_only = mine.replace(inputs) if inputs else None
    x = ids(5, 4, seed=22)
    everywhere = torch.arange(x.shape[1])

    def layer_states(p):
        with (
            hooked(model, p, True, True) if p is not None else contextlib.nullcontext(),
            adapter.recording(model, everywhere, every=True) as rec,
        ):
            model(x)
        return rec[layer]

    before, want = layer_states(inputs_only), layer_states(mine).out
    site = adapter.sites(model, layer).output
    kept = [(before.only(thought_lm_output.STREAM_KEYS), before.out)]
    (got,) = thought_lm_output.next_streams(model, site, dict(mine.items()), kept)
    assert site.kind == {"llama": "matrix", "qwen2_moe": "gated", "gemma3": "matrix+scale"}.get(name, "bias")
    assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
    assert float((before.out - want).abs().max()) > 1e-3  # the output deltas do move the stream
