"""The small language model of tokenpatch.models.lm: its data, inputs, exactness under token patches,
and training that resumes bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tokenpatch as tp
from tokenpatch.models.lm import lm_inputs, lm_model, load_lm
from tokenpatch.tasks.repeats import BOS, LMData
from tokenpatch.workbench.train.lm import LMTrain, train_lm


def test_data_copies_the_last_successor_with_probability_follow():
    data = LMData(vocab=12, length=64, follow=0.7)
    x = data.sample(400, np.random.default_rng(0))
    assert x.shape == (400, 64) and (x[:, 0] == BOS).all() and (x[:, 1:] >= 1).all() and (x < 12).all()
    same, seen = 0, 0
    for row in x[:, 1:].tolist():  # how often a recurring token's successor repeats its last one
        last = {}
        for a, b in zip(row, row[1:]):
            if a in last:
                seen += 1
                same += last[a] == b
            last[a] = b
    assert abs(same / seen - (0.7 + 0.3 / 11)) < 0.01  # copied, or drawn uniformly and equal by chance
    never = LMData(vocab=12, length=64, follow=0.0).sample(50, np.random.default_rng(0))
    assert torch.equal(never[:, 1:], torch.from_numpy(np.random.default_rng(0).integers(1, 12, (50, 64)))[:, 1:])
    with pytest.raises(tp.InputError, match="0 <= follow <= 1"):
        LMData(follow=1.5)


def test_inputs_and_token_patches_are_exact():
    data = LMData(vocab=20, length=16)
    model = lm_model(data, d_model=16, n_heads=2).double()
    ids = data.sample(3, np.random.default_rng(1))
    x = lm_inputs(model, ids)
    assert x.shape == (3, 16, 36) and torch.equal(x[0, 5, :20].argmax(), ids[0, 5]) and x[0, 5, 20 + 5] == 1
    assert tp.verify(model, tp.token_patch(model, x), x).max_abs < 1e-10
    with pytest.raises(tp.InputError, match="token ids must be"):
        lm_inputs(model, torch.full((1, 4), 20))


def test_training_resumes_bit_for_bit(tmp_path):
    data = LMData(vocab=20, length=16)
    cfg = LMTrain(steps=8, batch_size=4, checkpoint_every=4, warmup=2)
    full = train_lm(tmp_path / "a.safetensors", data, cfg, d_model=8, n_heads=2, progress=False)
    import tokenpatch.tasks.repeats as lm

    real = lm.LMData.sample
    calls = {"n": 0}

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 6:  # in step 6, after the checkpoint of step 4
            raise RuntimeError("cut")
        return real(self, *a, **k)

    lm.LMData.sample = failing
    try:
        with pytest.raises(RuntimeError, match="cut"):
            train_lm(tmp_path / "c.safetensors", data, cfg, d_model=8, n_heads=2, progress=False)
    finally:
        lm.LMData.sample = real
    from tokenpatch.models.icl import read_checkpoint

    assert read_checkpoint(tmp_path / "c.safetensors")[1]["meta"]["step"] == 4  # resumes, not restarts
    resumed = train_lm(tmp_path / "c.safetensors", data, cfg, d_model=8, n_heads=2, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(full.state_dict().values(), resumed.state_dict().values()))
    assert torch.equal(load_lm(tmp_path / "a.safetensors").read_in.weight, full.read_in.weight)
    meta_a, meta_c = (read_checkpoint(tmp_path / f"{n}.safetensors")[1]["meta"] for n in "ac")
    assert meta_a["loss_ema"] is not None and meta_a["loss_ema"] == meta_c["loss_ema"]  # the loss average resumes too
    with pytest.raises(tp.FileFormatError, match="another training recipe"):
        train_lm(tmp_path / "a.safetensors", data, cfg, d_model=4, n_heads=2, progress=False)
    tp.save_model(tp.ICLTransformer(tp.ICLConfig(d_in=3)), tmp_path / "other.safetensors")
    with pytest.raises(tp.FileFormatError, match="is not a small LM of tokenpatch.models.lm"):
        load_lm(tmp_path / "other.safetensors")


def test_bad_training_settings_are_refused():
    with pytest.raises(tp.InputError, match="LMTrain.batch_size must be an integer >= 1, got 0"):
        LMTrain(batch_size=0)
    with pytest.raises(tp.InputError, match="LMTrain.lr must be a number > 0"):
        LMTrain(lr=float("nan"))
    with pytest.raises(tp.InputError, match="LMTrain.seed must be an integer >= 0"):
        LMTrain(seed=1.5)


def test_attention_only_model_runs_saves_and_refuses_token_patches(tmp_path):
    from tokenpatch.interp.head_patches import head_patches
    from tokenpatch.models.icl import ICLConfig, load_model, save_model

    data = LMData(vocab=20, length=16)
    model = lm_model(data, d_model=16, n_layers=2, n_heads=2, mlp=False).double()
    assert not any("mlp" in name for name, _ in model.named_parameters())
    assert model.config.describe() == "2-layer Pre-LN softmax-attention transformer (attention-only)"
    assert (
        model.config.to_dict()["mlp"] is False and "mlp" not in lm_model(data).config.to_dict()
    )  # old files read as before
    x = lm_inputs(model, data.sample(2, np.random.default_rng(1)))
    h = model.read_in(x)
    for block in model.blocks:  # each block is h + A(LN1(h)), nothing after
        h = h + block.mixer(block.ln1(h))
    torch.testing.assert_close(model(x), model.read_out(model.ln_f(h)), rtol=0, atol=1e-12)
    save_model(model, tmp_path / "a.safetensors")
    assert torch.equal(load_model(tmp_path / "a.safetensors").double()(x), model(x))
    with pytest.raises(tp.UnsupportedModelError, match="layer 0 has no MLP"):
        tp.token_patch(model, x)
    with pytest.raises(tp.UnsupportedModelError, match="no MLP"):
        head_patches(model, x)
    with pytest.raises(tp.InputError, match="attention-only"):
        ICLConfig(d_in=4, norm="post", mlp=False)


@pytest.mark.slow
def test_the_default_recipe_forms_an_induction_head(tmp_path):
    """The promise of docs/induction.md §5, on the default recipe (about four minutes): a classic
    induction head under both definitions, the lag curve's peak at +1, and ablating the top head
    costs lag +1 far more than the random control's exact average."""
    from tokenpatch.workbench.report.induction import run_lm

    torch.set_num_threads(2)
    train_lm(tmp_path / "lm.safetensors", progress=False)
    r = run_lm(tmp_path / "lm.safetensors", prompts=64, progress=False)
    top = r["top_heads"][0]
    assert top["diagonal"] > 0.9 and top["detector"] > 0.5
    assert any(h["previous_token"] > 0.9 for h in r["top_heads"])  # the first half of the circuit
    lag = r["lag"]
    assert lag["lags"][int(np.argmax(lag["mean"]))] == 1
    dose = r["dose_lag_plus_one"]
    clean, top1 = dose["top"][0]["mean"], dose["top"][1]["mean"]
    random1 = np.mean([c["mean"] for c in dose["random"][1]])
    assert top1 < 0.1 * clean and clean - random1 < 0.5 * (clean - top1)
