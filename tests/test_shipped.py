"""Acceptance on the shipped checkpoint: a trained 10-layer Pre-LN softmax-attention model."""

from __future__ import annotations

import copy

import torch

import tokenpatch as tp
from tokenpatch.tasks.linreg import evaluate, task_of


def test_shipped_checkpoint_is_the_promised_model():
    model = tp.load_model()
    c = model.config
    assert (c.n_layers, c.norm, c.layer, c.residual) == (10, "pre", "softmax", True)
    task = task_of(model)
    assert 4 <= task.dim <= 8 and 2 * task.dim <= task.n_context <= 4 * task.dim
    assert model.meta["recipe"]["model"] == c.to_dict()


def test_float32_equivalence_on_256_fresh_tasks():
    model = tp.load_model()
    tokens = task_of(model).sample(256, torch.Generator().manual_seed(11)).tokens  # float32
    patch = tp.token_patch(model, tokens)
    result = tp.verify(model, patch, tokens)
    print("\n" + result.table())
    assert len(result.per_layer) == 11  # 10 layers and the prediction
    for site in result.per_layer:
        assert site.max_rel <= 1e-4 and site.max_rel_unfloored <= 1e-4, result.table()
    # the bound has teeth: without the patch the prediction is far off
    unpatched = tp.verify(model, patch.map(torch.zeros_like), tokens)
    assert unpatched.per_layer[-1].max_rel > 0.1


def test_float64_equivalence_on_the_trained_model_every_position():
    model = copy.deepcopy(tp.load_model()).double()
    tokens = task_of(model).sample(32, torch.Generator().manual_seed(12), dtype=torch.float64).tokens
    result = tp.verify(model, tp.token_patch(model, tokens, query="all"), tokens)
    assert result.max_abs <= 1e-10, result.table()


def test_in_context_regression_beats_zero_predictor_fivefold():
    model = tp.load_model()
    res = evaluate(model, task_of(model), n_tasks=4096, seed=99)  # fresh tasks, not the training stream
    print(
        f"\nMSE model {res['mse_model']:.4f} zero {res['mse_zero']:.4f} "
        f"least squares {res['mse_least_squares']:.4f} ridge {res['mse_ridge']:.4f}"
    )
    assert res["mse_model"] <= 0.2 * res["mse_zero"]
    assert res["mse_least_squares"] <= res["mse_model"] + 0.05  # the baselines are sane: LS is near-optimal here
