"""Bad input gets a clear exception naming the problem."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp
from conftest import random_block


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x: x[0], "shape \\[batch, pos, d\\]"),
        (lambda x: x[..., :4], "width 4, the model reads width 5"),
        (lambda x: x.float(), "float32 but the model computes in torch.float64"),
        (lambda x: x.masked_fill(torch.zeros_like(x, dtype=torch.bool).index_fill(1, torch.tensor([3]), True), float("nan")), "NaN or inf"),
        (lambda x: x[:, :0], "empty"),
        (lambda x: x.numpy(), "torch.Tensor"),
    ],
)
def test_bad_inputs(small_model, small_inputs, make, match):
    with pytest.raises(tp.InputError, match=match):
        tp.token_patch(small_model, make(small_inputs))


@pytest.mark.parametrize(
    "query,remove,match",
    [
        (7, None, "query position 7 is outside the sequence of length 7"),
        (-8, None, "outside the sequence"),
        ([1, 1], None, "repeat"),
        (1.5, None, "integers"),
        (True, None, "integers"),
        ("first", None, "'all'"),
        (slice(3, 3), None, "selects no position"),
        (-1, slice(2, 2), "removed chunk .* is empty"),
        (-1, torch.zeros(7, dtype=torch.bool), "empty"),
        (-1, slice(0, 7), "every position"),
        (3, slice(2, 5), "inside the removed chunk"),
        (-1, torch.ones(6, dtype=torch.bool), "shape \\(6,\\)"),
        (-1, [0, 1, 2], "boolean mask"),
    ],
)
def test_bad_query_or_remove(small_model, small_inputs, query, remove, match):
    with pytest.raises(tp.InputError, match=match):
        tp.token_patch(small_model, small_inputs, query=query, remove=remove)


def test_zero_anchor_names_layer_parameter_and_position():
    """A residual-free, norm-free, bias-free block maps a zero query token to a zero MLP input:
    no patch of fc_in can then add the context's effect."""
    block = random_block(tp.ICLConfig(d_in=4, d_model=4, n_layers=1, n_heads=2, norm="none", residual=False, bias=False))
    h = torch.randn(2, 5, 4, dtype=torch.float64)
    h[1, 3] = 0.0
    with pytest.raises(tp.ZeroAnchorError, match=r"layer 0: no patch exists for mlp.fc_in.weight at \(batch, query position\) \[\(1, 3\)\]") as info:
        tp.token_patch(block, h, query="all")
    assert info.value.index == [(1, 3)]
    tp.token_patch(block, h, query=-1)  # other queries are fine


def test_unsupported_model():
    with pytest.raises(tp.UnsupportedModelError, match="no adapter for torch.nn.modules.linear.Linear"):
        tp.token_patch(torch.nn.Linear(3, 3), torch.randn(1, 2, 3))


def test_patch_does_not_fit_the_inputs(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs, query="all")
    with pytest.raises(tp.InputError, match="length 7, inputs have 6"):
        tp.verify(small_model, small_inputs[:, :6], patch)
    with pytest.raises(tp.InputError, match="made for"):
        tp.verify(small_model, small_inputs, patch, query=-1)
    with pytest.raises(tp.InputError, match="\\[batch, query\\]"):
        tp.verify(small_model, small_inputs, tp.Patch(dict(patch), meta={}), query=-1)
    chunk = tp.token_patch(small_model, small_inputs, remove=slice(1, 3))
    with pytest.raises(tp.InputError, match="made for .*'removed': \\[1, 2\\]"):
        tp.verify(small_model, small_inputs, chunk, query=-1, remove=slice(2, 4))
    with pytest.raises(tp.InputError, match="acts at positions"):
        tp.verify(small_model, small_inputs, tp.Patch(dict(chunk), chunk.positions, meta={}), query=-1)


def test_nonfinite_model_weights_are_caught(small_model, small_inputs):
    with torch.no_grad():
        small_model.blocks[1].mlp.fc_in.weight[0, 0] = float("inf")
    with pytest.raises(tp.InputError, match="NaN or inf"):
        tp.token_patch(small_model, small_inputs)
