"""Bad input gets a clear exception naming the problem."""

from __future__ import annotations

import pytest
import torch
from conftest import random_block

import tokenpatch as tp


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x: x[0], "shape \\[batch, pos, d\\]"),
        (lambda x: x[..., :4], "width 4, the model reads width 5"),
        (lambda x: x.float(), "float32 but the model computes in torch.float64"),
        (
            lambda x: x.masked_fill(
                torch.zeros_like(x, dtype=torch.bool).index_fill(1, torch.tensor([3]), True), float("nan")
            ),
            "NaN or inf",
        ),
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
        (-1, [0, 0, 2], "remove indices repeat"),
        (-1, [0, 9], "remove index 9 is outside the sequence of length 7"),
    ],
)
def test_bad_query_or_remove(small_model, small_inputs, query, remove, match):
    with pytest.raises(tp.InputError, match=match):
        tp.token_patch(small_model, small_inputs, query=query, remove=remove)


def test_zero_anchor_names_layer_parameter_and_position():
    """A residual-free, norm-free, bias-free block maps a zero query token to a zero MLP input:
    no patch of fc_in can then add the context's effect."""
    block = random_block(
        tp.ICLConfig(d_in=4, d_model=4, n_layers=1, n_heads=2, norm="none", residual=False, bias=False)
    )
    h = torch.randn(2, 5, 4, dtype=torch.float64)
    h[1, 3] = 0.0
    with pytest.raises(
        tp.ZeroAnchorError,
        match=r"layer 0: no minimal patch of mlp.fc_in.weight exists at \(batch, query position\) \[\(1, 3\)\]: the vector it acts on \(the MLP input without context\) is zero",
    ) as info:
        tp.token_patch(block, h, query="all")
    assert info.value.index == [(1, 3)]
    tp.token_patch(block, h, query=-1)  # other queries are fine


def test_unsupported_model():
    with pytest.raises(tp.UnsupportedModelError, match="no adapter for torch.nn.modules.linear.Linear"):
        tp.token_patch(torch.nn.Linear(3, 3), torch.randn(1, 2, 3))


def test_patch_does_not_fit_the_inputs(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs, query="all")
    with pytest.raises(tp.InputError, match="length 7, inputs have 6"):
        tp.verify(small_model, patch, small_inputs[:, :6])
    with pytest.raises(tp.InputError, match="made for"):
        tp.verify(small_model, patch, small_inputs, query=-1)
    with pytest.raises(tp.InputError, match="\\[batch, query\\]"):
        tp.verify(small_model, tp.Patch(dict(patch), meta={}), small_inputs, query=-1)
    chunk = tp.token_patch(small_model, small_inputs, remove=slice(1, 3))
    with pytest.raises(tp.InputError, match="made for .*'removed': \\[1, 2\\]"):
        tp.verify(small_model, chunk, small_inputs, query=-1, remove=slice(2, 4))
    with pytest.raises(tp.InputError, match="acts at positions"):
        tp.verify(small_model, tp.Patch(dict(chunk), chunk.positions, meta={}), small_inputs, query=-1)


def test_nonfinite_model_weights_are_caught(small_model, small_inputs):
    with torch.no_grad():
        small_model.blocks[1].mlp.fc_in.weight[0, 0] = float("inf")
    with pytest.raises(tp.InputError, match="NaN or inf"):
        tp.token_patch(small_model, small_inputs)


def test_zero_hidden_state_for_the_output_matrix():
    """Bias-free residual block whose fc_in is zero: the ReLU hidden state is 0 with context, so
    no rank-1 patch of fc_out can absorb the residual shift."""
    block = random_block(
        tp.ICLConfig(d_in=4, d_model=4, n_layers=1, n_heads=2, norm="none", bias=False, activation="relu")
    )
    with torch.no_grad():
        block.mlp.fc_in.weight.zero_()
    h = torch.randn(1, 5, 4, dtype=torch.float64)
    with pytest.raises(tp.ZeroAnchorError, match=r"mlp.fc_out.weight .* \(the MLP hidden state with context\) is zero"):
        tp.token_patch(block, h)


def test_weights_changed_through_data_are_caught_by_the_full_check(small_model, small_inputs, tmp_path):
    """``p.data`` writes bypass torch's version counter, so only the full re-hash sees them:
    ``check_model(cached=False)`` and ``load_patch(path, model)``."""
    patch = tp.token_patch(small_model, small_inputs)
    tp.save_patch(patch, tmp_path / "p.safetensors")
    small_model.blocks[0].mlp.fc_in.weight.data.mul_(2.0)  # invisible to torch's version counter
    with pytest.raises(tp.FileFormatError, match="another model"):
        tp.load_patch(tmp_path / "p.safetensors", model=small_model)
    with pytest.raises(tp.InputError, match="another model"):
        patch.check_model(small_model, cached=False)


def test_in_place_weight_changes_are_caught(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs)[0, 0]
    with torch.no_grad():
        small_model.blocks[2].mlp.fc_out.bias.add_(1e-3)
    with pytest.raises(tp.InputError, match="another model"):
        with tp.apply(small_model, patch):
            pass


def test_functional_call_input_too_short_for_a_chunk_patch(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs, remove=slice(1, 3))  # query at position 4 of C \ Y
    with pytest.raises(tp.InputError, match="acts at positions \\[4\\]"):
        tp.functional_call(small_model, patch, small_inputs[:, :3])


def test_chunk_patches_of_several_queries_act_together(small_model, small_inputs):
    """With a chunk removed, query 6's patch assumes query 4 is patched too: a subset must keep
    every query up to its last position (a prefix is exact alone), and such patches do not stack
    along query."""
    joint = tp.token_patch(small_model, small_inputs, query=[6, 4], remove=slice(1, 3))
    with pytest.raises(tp.InputError, match="act together"):
        joint[:, 0]  # query 6 without query 4
    first = joint[:, 1]  # query 4: nothing before it
    assert first.plan.query == (4,) and tp.verify(small_model, first, small_inputs).max_abs <= 1e-10
    alone = tp.token_patch(small_model, small_inputs, query=6, remove=slice(1, 3))
    assert tp.verify(small_model, alone, small_inputs).max_abs <= 1e-10
    with pytest.raises(tp.InputError, match="cannot be stacked along query"):
        tp.Patch.stack([first, alone], dim="query")
    rows = tp.Patch.stack([joint[0], joint[1]], dim="batch")  # rows are independent
    assert tp.verify(small_model, rows, small_inputs[:2]).max_abs <= 1e-10


def test_patch_arithmetic_errors(small_model, small_inputs):
    from conftest import random_model

    patch = tp.token_patch(small_model, small_inputs, query="all")
    other = random_model(small_model.config, seed=42)
    other_patch = tp.token_patch(other, small_inputs, query="all")
    with pytest.raises(tp.InputError, match="different models"):
        patch + other_patch
    with pytest.raises(tp.InputError, match="convert one"):
        patch + patch.to(torch.float32)
    summed = patch[0, 1] + patch[0, 2]
    assert summed.meta["model"] == patch.meta["model"]
    with pytest.raises(tp.InputError, match="another model"):
        with tp.apply(other, summed):
            pass
    with pytest.raises(tp.InputError, match="'batch' or 'query'"):
        tp.Patch.stack([patch, patch], dim="bogus")
    chunk = tp.token_patch(small_model, small_inputs, remove=slice(1, 3))
    with pytest.raises(tp.InputError, match="cannot be stacked along query"):
        tp.Patch.stack([patch[:, :1], chunk], dim="query")
    with pytest.raises(tp.InputError, match="different models"):
        tp.Patch.stack([patch[:1], other_patch[1:]], dim="batch")
    with pytest.raises(tp.InputError, match="same query size"):
        tp.Patch.stack([patch[:1, :2], patch[1:]], dim="batch")
    with pytest.raises(IndexError, match="out of range"):
        patch[5]
    with pytest.raises(tp.InputError, match="selects no patch"):
        patch[:, 2:2]
    with pytest.raises(tp.InputError, match="ints or slices"):
        patch[True]


def test_resume_from_a_weights_only_file(tmp_path):
    from tokenpatch.workbench.train.linreg import train

    tp.save_model(tp.load_model(), tmp_path / "w.safetensors")
    with pytest.raises(tp.FileFormatError, match="weights only"):
        train(tmp_path / "w.safetensors", progress=False)


def test_verify_wants_one_patch_row_per_sequence(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs)
    with pytest.raises(tp.InputError, match="rows \\[1\\] of the batch"):
        tp.verify(small_model, patch[1], small_inputs)
    assert tp.verify(small_model, patch[1], small_inputs[1:2]).max_abs <= 1e-10


def test_models_made_under_inference_mode(small_inputs):
    with torch.inference_mode():
        model = tp.ICLTransformer(tp.ICLConfig(d_in=5, d_model=8, n_layers=2, n_heads=2)).double()
        x = small_inputs.clone()
    patch = tp.token_patch(model, x)
    assert tp.verify(model, patch, x).max_abs <= 1e-10
