"""transformers' own mixers as contextual layers of our linear-regression model (``models.hf_layers``):
causal, a lone token is a length-one sequence, token patches and trajectories exact in float64 for every
kind and for the 3:1 hybrid, the hybrid config, the shipped models and the report section."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

import tokenpatch as tp
from tokenpatch.dynamics import diagnostics as dg
from tokenpatch.models.hf_layers import HF_LAYERS, make_hf_layer
from tokenpatch.models.icl import SHIPPED_TRANSFORMERS, ICLConfig, ICLTransformer
from tokenpatch.tasks.linreg import DEFAULT_TASK, task_of

pytest.importorskip("transformers")

from tokenpatch.workbench.report import recurrence  # noqa: E402  (its models need transformers)
from tokenpatch.workbench.train.kinds import KINDS, KINDS_TRAIN  # noqa: E402

HYBRID = dict(layer="gated_deltanet", interleave="llama", interval=2)


def _dense(d):
    return d.dense() if isinstance(d, tp.LowRank) else d


def _model(seed=0, **kinds) -> ICLTransformer:
    """A random float64 model, every parameter moved off its init (norms, gates, decays, biases)."""
    torch.manual_seed(seed)
    model = ICLTransformer(ICLConfig(d_in=3, d_model=8, n_layers=2, n_heads=2, d_mlp=12, **kinds)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind", sorted(HF_LAYERS))
def test_initialised_as_in_its_model(kind):
    """Every parameter comes from the model's ``_init_weights`` (seeded, finite, small), none left as
    ``torch.empty`` leaves it (RG-LRU's gates and decay are, until a whole model's ``post_init``)."""
    built = []
    for _ in range(2):
        torch.manual_seed(7)
        built.append(dict(make_hf_layer(kind, 8, 2).named_parameters()))
    for name, p in built[0].items():
        assert torch.isfinite(p).all() and p.abs().max() < 20, name
        assert torch.equal(p, built[1][name]), name


@pytest.mark.parametrize("kind", sorted(HF_LAYERS))
def test_causal_and_a_lone_token_is_one_step(kind):
    torch.manual_seed(1)
    layer = make_hf_layer(kind, 8, 2).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    h = torch.randn(2, 7, 8, dtype=torch.float64)
    changed = h.clone()
    changed[:, 4:] += 1.0
    out, out2 = layer(h), layer(changed)
    torch.testing.assert_close(out[:, :4], out2[:, :4], rtol=0, atol=1e-14)
    assert (out[:, 4:] - out2[:, 4:]).abs().max() > 1e-4
    x = h[:, 3]  # alone: the layer on a sequence of one token, not its output after the others
    torch.testing.assert_close(layer.alone(x), layer(x[:, None])[:, 0], rtol=0, atol=0)
    assert (layer.alone(x) - out[:, 3]).abs().max() > 1e-4


@pytest.mark.parametrize("kinds", [{"layer": k} for k in sorted(HF_LAYERS)] + [HYBRID], ids=str)
def test_patches_and_every_prefix_exact(kinds):
    """The patched query alone reproduces the with-context pass at every block (checked here by hand too),
    and the trajectory's prefix patches are ``tp.token_patch`` of the truncated inputs."""
    model = _model(**kinds)
    x = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    patch = tp.token_patch(model, x)
    assert tp.verify(model, patch, x).max_abs <= 1e-12
    with_context = model(x)[:, -1]
    alone = tp.functional_call(model, patch, x[:, -1:])[:, -1]
    assert (alone - with_context).abs().max() <= 1e-12
    assert (model(x[:, -1:])[:, -1] - with_context).abs().max() > 1e-6  # the context matters, far above 1e-12
    traj = tp.trajectory(model, x)
    for i in (0, 2, 5):
        ref = tp.token_patch(model, traj.prefix_inputs(x, i))
        for name in ref:
            assert (_dense(traj.patch(i)[name]) - _dense(ref[name])).abs().max() <= 1e-12


def test_hybrid_config():
    config = ICLConfig(d_in=3, d_model=8, n_layers=4, n_heads=2, **HYBRID)
    assert [config.kind(i) for i in range(4)] == ["gated_deltanet", "llama", "gated_deltanet", "llama"]
    assert config.describe() == "4-layer Pre-LN Gated-DeltaNet network, Llama-attention in one block of every 2"
    assert ICLConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    plain = ICLConfig(d_in=3).to_dict()
    assert "interleave" not in plain and "interval" not in plain  # files written before hybrids read unchanged
    with pytest.raises(tp.InputError, match="ICLConfig.interleave='mamba'"):
        ICLConfig(d_in=3, layer="gru", interleave="mamba", interval=2)
    with pytest.raises(tp.InputError, match="needs both interleave"):
        ICLConfig(d_in=3, layer="gru", interval=2)
    with pytest.raises(tp.InputError, match="not divisible"):
        ICLConfig(d_in=3, d_model=6, n_heads=4, layer="mamba2")
    with pytest.raises(tp.InputError, match="not divisible"):  # a headed layer in the hybrid's other blocks
        ICLConfig(d_in=3, d_model=6, n_heads=4, layer="gru", interleave="llama", interval=2)


def test_limit_distance_from_the_factors():
    model = _model(layer="rg_lru")
    x = torch.randn(3, 6, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    traj = tp.trajectory(model, x)
    name = "blocks.1.mlp.fc_in.weight"
    dense = traj.patches[name].dense()  # [B, N + 1, rows, cols]
    ref = (dense - dense[:, -1:]).flatten(2).norm(dim=-1) / dense[:, -1:].flatten(2).norm(dim=-1)
    got = dg.limit_distance(traj, name)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    assert (got[:, 0] - 1).abs().max() <= 1e-12 and got[:, -1].abs().max() <= 1e-12  # dW_0 = 0, then dW_N itself


@pytest.mark.parametrize("name", sorted(SHIPPED_TRANSFORMERS))
def test_shipped_models_one_recipe_and_learned(name):
    model = tp.load_model(layer=name)
    assert model.config == KINDS[name]
    assert model.meta["recipe"] == {
        "model": KINDS[name].to_dict(),
        "task": DEFAULT_TASK.to_dict(),
        "train": KINDS_TRAIN.to_dict(),
    }
    ev = model.meta["eval"]
    assert ev["mse_model"] < 0.5 * ev["mse_zero"]  # it learned to read the context (short convolutions: 38%)
    model = model.double()
    x = task_of(model).sample(4, torch.Generator().manual_seed(4), dtype=torch.float64).tokens
    assert tp.verify(model, tp.token_patch(model, x), x).max_abs <= 1e-10


def test_the_section(tmp_path, monkeypatch):
    small = {k: dataclasses.replace(c, d_model=8, n_heads=2, n_layers=4) for k, c in KINDS.items()}
    monkeypatch.setattr(recurrence, "KINDS", small)
    monkeypatch.setattr(recurrence, "_trained", lambda name, out, full, progress: ICLTransformer(small[name]).eval())
    section = recurrence.recurrence_section(tmp_path, n_tasks=3, progress=False)
    assert (tmp_path / "recurrence_step_norms.png").stat().st_size > 10_000
    assert section.body.count("| hybrid |") == 2 and "| hybrid | untrained |" in section.body  # and its control
    layers = section.data["models"]["hybrid"]["layers"]
    assert [x["kind"] for x in layers] == ["gated_deltanet"] * 3 + ["llama"]
    assert all(len(x["median_limit_distance"]) == DEFAULT_TASK.n_context + 1 for x in layers)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    note = recurrence.recurrence_section(tmp_path, n_tasks=3, progress=False)
    assert "pip install 'tokenpatch[hf]'" in note.body and note.figures == []


def test_train_a_hybrid_from_the_command_line(tmp_path, capsys):
    from tokenpatch.workbench.cli.main import main

    out = tmp_path / "hybrid.safetensors"
    args = ["train", "--layer", "rg_lru", "--interleave", "llama", "--interval", "2", "--layers", "2"]
    small = ["--d-model", "8", "--heads", "2", "--steps", "2", "--out", str(out), "--quiet"]
    assert main(args + small) == 0
    model = tp.load_model(out)
    assert [model.config.kind(i) for i in range(2)] == ["rg_lru", "llama"]
    assert main(["verify", "--checkpoint", str(out), "--tasks", "4", "--dtype", "float64", "--quiet"]) == 0
    assert main(["train", "--layer", "rg_lru", "--interval", "2"] + small) == 2  # --interval without --interleave
    assert "--interleave and --interval go together" in capsys.readouterr().err
