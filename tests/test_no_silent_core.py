"""No silent wrong answer in the core's plumbing (issue 20, items 2, 3, 7 (non-finite patches), 8 and 9).

Each test was seen to fail before its fix; the numbers in the docstrings are what the wrong answer
measured then (float64, tiny random models of ``conftest``)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIGS, T, build, ids, random_model

import tokenpatch as tp
from tokenpatch import files
from tokenpatch.arch import adapter_for
from tokenpatch.dynamics.diagnostics import step_norms
from tokenpatch.generate import _layer_norms
from tokenpatch.interp.ablation import ablate_heads, active_modes
from tokenpatch.lowrank import LowRank
from tokenpatch.per_model import PerModel


def _err(a, b) -> float:
    return float((a - b).detach().abs().max())


# ----------------------------------------------------------------------------- item 2: the config


def _same_weights_other_config(model, **changes):
    """A model of ``model``'s family with ``changes`` to its config and ``model``'s weights."""
    config = CONFIGS["llama"]()
    for key, value in changes.items():
        if key == "rope_theta":
            config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": value}
        else:
            setattr(config, key, value)
    other = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("change", [{"rms_norm_eps": 1e-1}, {"rope_theta": 50.0}])
def test_patch_refused_on_same_weights_other_config(change, tmp_path):
    """Before: accepted by functional_call and load_patch(model=), logits off by 4.6e-3 (eps) and
    6.0e-3 (rope_theta) against the other model's own with-context pass."""
    model = build("llama")
    x = ids(2, 9)
    patch = tp.token_patch(model, x)
    other = _same_weights_other_config(model, **change)
    (field,) = change
    with pytest.raises(tp.InputError, match=f"another model.*{field}"):
        tp.functional_call(other, patch, **tp.strip_context(other, x))
    with pytest.raises(tp.InputError, match="another model"):
        tp.verify(other, patch, x)
    tp.save_patch(patch, tmp_path / "p.safetensors")
    with pytest.raises(tp.FileFormatError, match=f"another model.*{field}"):
        tp.load_patch(tmp_path / "p.safetensors", model=other)
    # its own model still takes it, exactly
    loaded = tp.load_patch(tmp_path / "p.safetensors", model=model)
    got = tp.functional_call(model, loaded, **tp.strip_context(model, x)).logits[:, -1]
    assert _err(got, model(x).logits[:, -1]) < 1e-12


def test_config_fields_that_do_not_compute_are_ignored():
    """use_cache, output flags, the attention implementation, the name: no change to the forward."""
    model = build("llama")
    x = ids(1, 6)
    patch = tp.token_patch(model, x)
    model.config.use_cache = False
    model.config.output_hidden_states = True
    model.config._name_or_path = "renamed"
    model.config.transformers_version = "0.0"
    tp.functional_call(model, patch, **tp.strip_context(model, x))
    model.config.rms_norm_eps = 0.5  # a field the forward reads (even if set after the fact): refused
    with pytest.raises(tp.InputError, match="rms_norm_eps"):
        tp.functional_call(model, patch, **tp.strip_context(model, x))


def test_a_multimodal_models_text_config_counts_field_by_field():
    """Gemma 3's multimodal model keeps its decoder's fields in a nested text config: the fields that do not
    compute (its dtype, set by ``.double()`` or by loading) are left out of the record there too, and an
    edited one that computes is refused. Before: every offloaded multimodal model's patch was refused,
    its text config's dtype None then and float64 now."""
    model = build("gemma3_multimodal")
    x = ids(1, 6)
    patch = tp.token_patch(model, x)
    model.config.text_config.dtype = "float32"
    model.config.vision_config.transformers_version = "0.0"
    tp.functional_call(model, patch, **tp.strip_context(model, x))
    model.config.text_config.rms_norm_eps = 0.5
    with pytest.raises(tp.InputError, match="another model config.*text_config"):
        tp.functional_call(model, patch, **tp.strip_context(model, x))


def test_file_without_config_record_still_loads(tmp_path):
    """A patch file written before the config record (0.2 and 0.3's HF patches) loads on its model."""
    model = build("llama")
    x = ids(1, 6)
    patch = tp.token_patch(model, x)
    record = {k: v for k, v in patch.meta["model"].items() if k != "config"}
    old = patch.replace(meta={**patch.meta, "model": record})
    tp.save_patch(old, tmp_path / "old.safetensors")
    tp.load_patch(tmp_path / "old.safetensors", model=model)


def test_icl_patch_refused_on_same_weights_other_config():
    """Our own models: the activation or the residual changes no parameter. Before: a GELU model's
    patch ran on the ReLU model with the same weights, off by 6.7e-3 (2.0e-1 without the residual)."""
    config = tp.ICLConfig(d_in=5, d_model=8, n_layers=2, n_heads=2, norm="pre")
    model = random_model(config, seed=3)
    x = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    patch = tp.token_patch(model, x)
    for change in ({"activation": "relu"}, {"residual": False}):
        other = tp.ICLTransformer(tp.ICLConfig(**{**config.to_dict(), **change})).double().eval()
        other.load_state_dict(model.state_dict())
        with pytest.raises(tp.InputError, match=f"another model.*{next(iter(change))}"):
            tp.functional_call(other, patch, tp.strip_context(other, x))


# ----------------------------------------------------------------------------- item 8: norms


def test_norm_of_tiny_anchor_patch_is_finite():
    """u ~ 1e-20, v ~ 1e20 in float32: every entry of the delta is ~1, |v|^2 overflows. Before:
    LowRank.norm() and Patch.norms() gave inf."""
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(2, 3, 1, 7, generator=g) * 1e-20, torch.randn(2, 3, 1, 5, generator=g) * 1e20
    bias = torch.randn(2, 3, 4, generator=g) * 1e20  # a dense delta whose squares overflow
    patch = tp.Patch({"w": LowRank(u, v), "b": bias})
    norms = patch.norms()
    want = torch.linalg.matrix_norm(torch.einsum("...kr,...kc->...rc", u.double(), v.double()))
    assert torch.isfinite(norms["w"]).all() and torch.isfinite(norms["b"]).all()
    assert float(((norms["w"].double() - want) / want).abs().max()) < 1e-6  # float32 rounding
    assert float(((norms["b"].double() - bias.double().norm(dim=-1)) / bias.double().norm(dim=-1)).abs().max()) < 1e-6


@pytest.mark.parametrize("rank", [1, 3])
def test_norm_exact_in_float64(rank):
    """From the factors, against the dense Frobenius norm: ~1e-16 relative, tiny anchors included."""
    g = torch.Generator().manual_seed(rank)
    scales = torch.tensor([1e-170, 1.0, 1e170], dtype=torch.float64)[:rank, None]
    u = torch.randn(4, 2, rank, 9, generator=g, dtype=torch.float64) * scales
    v = torch.randn(4, 2, rank, 6, generator=g, dtype=torch.float64) / scales
    d = LowRank(u, v)
    want = torch.linalg.matrix_norm(d.dense())
    assert float(((d.norm() - want) / want).abs().max()) < 1e-12
    assert float(((d.inner(d) - want.square()) / want.square()).abs().max()) < 1e-12


def test_generate_update_norms_do_not_overflow():
    """generate's per-layer update norms from the same path: the same patch with its input change
    rescaled (u * 2^-70, v * 2^70: the same matrix) keeps its norms. Before: inf in float32."""
    model = build("llama").float()
    x = ids(2, 7)
    patch = tp.token_patch(model, x)
    adapter = adapter_for(model)
    scale = 2.0**70
    huge = patch.replace(
        {k: LowRank(d.u / scale, d.v * scale) if k.endswith(":input") else d for k, d in patch.items()}
    )
    want, got = _layer_norms(model, adapter, patch), _layer_norms(model, adapter, huge)
    assert torch.isfinite(got).all()
    assert float(((got - want) / want).abs().max()) < 1e-5


def test_norms_of_cancelling_low_rank_sums_keep_their_digits():
    """``|a - b|_F`` for nearly equal rank-1 ``a``, ``b`` (a small step after a large update) and
    ``p + (-p)``. Before: the Gram form's error was about ``sqrt(eps) |a|``, 11 times the step's
    size in float64 (``step_norms``' ``|a|^2 - 2<a, b> + |b|^2`` the same)."""
    g = torch.Generator().manual_seed(0)
    u, v, w = (torch.randn(3, 1, n, generator=g, dtype=torch.float64) for n in (40, 30, 30))
    eps = 1e-9
    a, b = LowRank(u, v), LowRank(u, v + eps * w)
    want = eps * u.norm(dim=-1)[..., 0] * w.norm(dim=-1)[..., 0]  # |u (eps w)^T|_F
    got = (b + LowRank(-a.u, a.v)).norm()
    assert float(((got - want) / want).abs().max()) < 1e-6
    p = LowRank(
        torch.randn(2, 3, 40, generator=g, dtype=torch.float64), torch.randn(2, 3, 30, generator=g, dtype=torch.float64)
    )
    assert float(((p + LowRank(-p.u, p.v)).norm() / p.norm()).max()) < 1e-14
    traj = SimpleNamespace(
        patches={"w": LowRank(torch.stack([a.u, b.u], 1), torch.stack([a.v, b.v], 1))}
    )  # [B, 2, 1, .]
    assert float(((step_norms(traj, "w")[:, 0] - want) / want).abs().max()) < 1e-6


# ----------------------------------------------------------------------------- item 7: non-finite patches


def test_non_finite_patch_refused_at_save_and_run(small_model, small_inputs, tmp_path):
    """Before: saved, and run to NaN outputs, without a word."""
    patch = tp.token_patch(small_model, small_inputs)
    name = "blocks.1.mlp.fc_in.weight"
    d = patch[name]
    bad = patch.replace({**patch, name: LowRank(d.u, d.v.clone().index_fill_(-1, torch.tensor([0]), float("nan")))})
    with pytest.raises(tp.InputError, match=f"{name}.*(NaN|inf)"):
        tp.save_patch(bad, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(tp.InputError, match=f"{name}.*(NaN|inf)"):
        tp.functional_call(small_model, bad, tp.strip_context(small_model, small_inputs))
    with pytest.raises(tp.InputError, match=f"{name}.*(NaN|inf)"):
        with tp.apply(small_model, bad[0, 0]):
            pass
    bias = "blocks.0.mlp.fc_out.bias"
    inf = patch.replace({**patch, bias: patch[bias].clone().fill_(float("inf"))})
    with pytest.raises(tp.InputError, match=bias):
        tp.functional_call(small_model, inf, tp.strip_context(small_model, small_inputs))


def test_a_patch_file_holding_nan_is_refused_at_load(small_model, small_inputs, tmp_path, monkeypatch):
    """A file with NaN and a valid checksum: written by tokenpatch 0.2, whose ``save_patch`` did
    not check (a damaged file fails its checksum first). Before: loaded without a word."""
    patch = tp.token_patch(small_model, small_inputs)
    name = "blocks.1.mlp.fc_in.weight"
    d = patch[name]
    bad = patch.replace({**patch, name: LowRank(d.u, d.v.clone().index_fill_(-1, torch.tensor([0]), float("nan")))})
    with monkeypatch.context() as m:
        m.setattr(tp.Patch, "check_finite", lambda self: None)  # 0.2's save_patch
        tp.save_patch(bad, tmp_path / "p.safetensors")
    with pytest.raises(tp.FileFormatError, match=rf"p.safetensors: damaged patch file: .*{name}.*NaN"):
        tp.load_patch(tmp_path / "p.safetensors")


# ----------------------------------------------------------------------------- item 3: positions


def test_gpt2_query_without_position_id_refused():
    """Absolute positions: the query alone at position 0 instead of its own. Before: accepted,
    off by 1.3e-2 (alone) and 1.7e-2 (a chunk removed, the kept tokens renumbered from 0)."""
    model = build("gpt2")
    x = ids(2, 12)
    ref = model(x).logits[:, -1]
    patch = tp.token_patch(model, x)
    stripped = tp.strip_context(model, x)
    with pytest.raises(tp.InputError, match="position_ids"):
        tp.functional_call(model, patch, input_ids=stripped["input_ids"])
    assert _err(tp.functional_call(model, patch, **stripped).logits[:, -1], ref) < 1e-12
    chunk = tp.token_patch(model, x, remove=slice(3, 8))
    kept = tp.strip_context(model, x, remove=slice(3, 8))
    with pytest.raises(tp.InputError, match="position_ids"):
        tp.functional_call(model, chunk, input_ids=kept["input_ids"], attention_mask=kept["attention_mask"])
    assert _err(tp.functional_call(model, chunk, **kept).logits[:, -1], ref) < 1e-12
    # what has no positions runs anywhere: summed over its queries, a patch acts everywhere
    tp.functional_call(model, patch[0].sum("query"), input_ids=x[:1, -1:])
    # generate passes every token's position id itself
    tp.generate(model, x[:1], max_new_tokens=2)


def test_rotary_positions_checked_only_where_they_matter():
    """Rotary positions are relative: a token alone is the same at any position (measured 2e-16),
    and a kept sequence shifted as a whole is the same up to the rotary tables' float32 rounding
    (6e-8); a removed chunk in the middle changes the distances (before: accepted, off by 3.6e-3)."""
    model = build("llama")
    x = ids(2, 12)
    ref = model(x).logits[:, -1]
    patch = tp.token_patch(model, x)
    alone = tp.functional_call(model, patch, input_ids=tp.strip_context(model, x)["input_ids"]).logits[:, -1]
    assert _err(alone, ref) < 1e-12
    prefix = tp.token_patch(model, x, remove=slice(0, 4))  # kept 4..11: renumbered 0..7, a uniform shift
    kept = tp.strip_context(model, x, remove=slice(0, 4))
    shifted = tp.functional_call(model, prefix, input_ids=kept["input_ids"], attention_mask=kept["attention_mask"])
    assert _err(shifted.logits[:, -1], ref) < 1e-6
    middle = tp.token_patch(model, x, remove=slice(3, 8))
    kept = tp.strip_context(model, x, remove=slice(3, 8))
    with pytest.raises(tp.InputError, match="position_ids"):
        tp.functional_call(model, middle, input_ids=kept["input_ids"], attention_mask=kept["attention_mask"])
    assert _err(tp.functional_call(model, middle, **kept).logits[:, -1], ref) < 1e-12


def test_positions_from_the_mask_need_no_position_ids():
    """Bloom's ALiBi reads the positions off the attention mask (it takes no position ids): the kept
    tokens of a removed chunk run closer together in the patch's own no-context pass, the same way
    without position ids, so nothing is refused and the queries get their with-context logits."""
    model = build("bloom")
    x = ids(2, 12)
    middle = tp.token_patch(model, x, remove=slice(3, 8))
    kept = tp.strip_context(model, x, remove=slice(3, 8))
    got = tp.functional_call(model, middle, input_ids=kept["input_ids"]).logits[:, -1]
    assert _err(got, model(x).logits[:, -1]) < 1e-12


# ----------------------------------------------------------------------------- item 9: the fingerprint cache


def test_fingerprint_cache_runs_no_weakref_callbacks(small_model):
    """A weakref callback is where Python swallows a Ctrl-C (``Exception ignored in: ...
    WeakKeyDictionary...remove``). Before: the cache held a callback reference to every model."""
    files.fingerprint(small_model)
    assert all(r.__callback__ is None for r in weakref.getweakrefs(small_model))
    digest = files.fingerprint(small_model)
    assert files.fingerprint(small_model) == digest and files.cached_state(small_model) is not None
    with torch.no_grad():
        small_model.get_parameter("blocks.0.mlp.fc_in.weight").mul_(2)
    assert files.cached_state(small_model) is None and files.fingerprint(small_model) != digest


def test_no_per_model_cache_runs_weakref_callbacks():
    """The same for the layer-name map of Hugging Face models and the ablation modes in force
    (both were ``WeakKeyDictionary``s, which drop entries from a callback)."""
    model = build("llama")
    tp.verify(model, tp.token_patch(model, ids(1, 5)), ids(1, 5))  # the layer-name map
    with ablate_heads(model, [(0, 1)]):
        assert active_modes(model) == ("zero",)
        with ablate_heads(model, [(1, 0)], mode="mean", reference=ids(2, 5)):
            assert active_modes(model) == ("zero", "mean")
            assert all(r.__callback__ is None for r in weakref.getweakrefs(model))
        assert active_modes(model) == ("zero",)
    assert active_modes(model) == ()
    assert all(r.__callback__ is None for r in weakref.getweakrefs(model))


def test_per_model_answers_only_for_the_object_it_was_made_for():
    cache, a = PerModel(), torch.nn.Linear(1, 1)
    cache[a] = "a"
    assert cache.get(a) == "a" and len(cache) == 1
    key = id(a)
    del a
    gc.collect()
    b = torch.nn.Linear(1, 1)
    assert cache.get(b) is None and len(cache) == 0  # even if b reuses a's id
    cache[b] = "b"
    assert cache.pop(b) == "b" and cache.get(b) is None and key is not None


def test_fingerprint_cache_forgets_dead_models():
    """A dead model's entry is never taken for a new model that reuses its id, and is dropped."""
    config = tp.ICLConfig(d_in=3, d_model=4, n_layers=1, n_heads=1)
    model = random_model(config, seed=1)
    files.fingerprint(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    fresh = [random_model(config, seed=2) for _ in range(4)]  # some may get the dead model's id
    assert all(files.cached_state(m) is None for m in fresh)
    assert len({files.fingerprint(m) for m in fresh}) == 1
