"""The small language model of tokenpatch.lm: its data, inputs, exactness under token patches,
and training that resumes bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tokenpatch as tp
from tokenpatch.lm import BOS, LMData, LMTrain, lm_inputs, lm_model, load_lm, train_lm


def test_data_holds_repeats_at_varying_offsets():
    data = LMData(vocab=50, length=40, whole=1.0)
    x = data.sample(64, np.random.default_rng(0))
    assert x.shape == (64, 40) and (x[:, 0] == BOS).all() and (x[:, 1:] >= 1).all() and (x < 50).all()
    offsets = set()
    for row in x.tolist():  # the longest run of x[t] == x[t - n] over n: the repeat's length
        best = max(range(4, 20), key=lambda n: sum(row[t] == row[t - n] for t in range(n + 1, 40)))
        offsets.add(best)
    assert len(offsets) > 5
    assert max(np.bincount(row).max() for row in x.numpy()) < 10  # a random stretch repeated, not a constant
    with pytest.raises(tp.InputError, match="do not fit"):
        LMData(length=10, span_max=8)


def test_inputs_and_token_patches_are_exact():
    data = LMData(vocab=20, length=16, span_max=6)
    model = lm_model(data, d_model=16, n_heads=2).double()
    ids = data.sample(3, np.random.default_rng(1))
    x = lm_inputs(model, ids)
    assert x.shape == (3, 16, 36) and torch.equal(x[0, 5, :20].argmax(), ids[0, 5]) and x[0, 5, 20 + 5] == 1
    assert tp.verify(model, x, tp.token_patch(model, x)).max_abs < 1e-10
    with pytest.raises(tp.InputError, match="token ids must be"):
        lm_inputs(model, torch.full((1, 4), 20))


def test_training_resumes_bit_for_bit(tmp_path):
    data = LMData(vocab=20, length=16, span_max=6)
    cfg = LMTrain(steps=8, batch_size=4, checkpoint_every=4, warmup=2)
    full = train_lm(tmp_path / "a.safetensors", data, cfg, d_model=8, n_heads=2, progress=False)
    import tokenpatch.lm as lm

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
    resumed = train_lm(tmp_path / "c.safetensors", data, cfg, d_model=8, n_heads=2, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(full.state_dict().values(), resumed.state_dict().values()))
    assert torch.equal(load_lm(tmp_path / "a.safetensors").read_in.weight, full.read_in.weight)
    with pytest.raises(tp.FileFormatError, match="another recipe"):
        train_lm(tmp_path / "a.safetensors", data, cfg, d_model=4, n_heads=2, progress=False)
    tp.save_model(tp.ICLTransformer(tp.ICLConfig(d_in=3)), tmp_path / "other.safetensors")
    with pytest.raises(tp.FileFormatError, match="is not a small LM of tokenpatch.lm"):
        load_lm(tmp_path / "other.safetensors")
