"""The shipped models, one per contextual layer: one recipe, only the layer differs; each is a
trained model on which token patches and trajectories are exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tokenpatch as tp
from tokenpatch.models.icl import SHIPPED
from tokenpatch.tasks.linreg import DEFAULT_TASK, task_of
from tokenpatch.workbench.train.linreg import DEFAULT_MODEL, DEFAULT_TRAIN


@pytest.mark.parametrize("layer", sorted(SHIPPED))
def test_one_recipe_only_the_layer_differs(layer):
    model = tp.load_model(layer=layer)
    assert model.config == dataclasses.replace(DEFAULT_MODEL, layer=layer)
    recipe = model.meta["recipe"]
    assert recipe == {"model": model.config.to_dict(), "task": DEFAULT_TASK.to_dict(), "train": DEFAULT_TRAIN.to_dict()}
    ev = model.meta["eval"]
    assert ev["mse_least_squares"] < ev["mse_zero"] and ev["mse_model"] > 0  # a recorded evaluation


@pytest.mark.parametrize("layer", sorted(SHIPPED))
def test_patches_and_trajectories_are_exact_on_the_trained_models(layer):
    model = tp.load_model(layer=layer, dtype="float64")
    x = task_of(model).sample(8, torch.Generator().manual_seed(4), dtype=torch.float64).tokens
    assert tp.verify(model, tp.token_patch(model, x), x).max_abs <= 1e-10
    traj = tp.trajectory(model, x)
    assert tp.verify(model, traj.patch(9), traj.prefix_inputs(x, 9)).max_abs <= 1e-10


def test_unknown_shipped_layer_and_path_with_layer(tmp_path):
    with pytest.raises(tp.InputError, match="no shipped model with layer 'mamba'"):
        tp.load_model(layer="mamba")
    with pytest.raises(tp.InputError, match="not both"):
        tp.load_model(tmp_path / "m.safetensors", layer="softmax")
