"""Weights stored [in, out] (GPT-2's ``Conv1D``, ``y = x @ W + b``): the same model with its MLP
matrices held transposed gets the same, exact patches, with the factors swapped into the
parameter's own layout (``WEIGHT_LAYOUTS["Conv1D"] == "in_out"``)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_model
from torch import nn

import tokenpatch as tp


class Conv1D(nn.Module):
    """GPT-2's layout: ``weight [in, out]``, ``bias [out]`` (or none), ``forward = x @ weight + bias``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [in, out]
        self.bias = None if bias is None else nn.Parameter(bias)  # [out]

    def forward(self, x):
        y = x @ self.weight  # [..., out]
        return y if self.bias is None else y + self.bias


def _to_conv1d(model: tp.ICLTransformer) -> tp.ICLTransformer:
    """A copy of ``model`` whose ``mlp.fc_in`` / ``mlp.fc_out`` are Conv1D holding ``W.T``."""
    conv = copy.deepcopy(model)
    for block in conv.blocks:
        for name in ("fc_in", "fc_out"):
            lin = getattr(block.mlp, name)
            bias = None if lin.bias is None else lin.bias.detach().clone()
            setattr(block.mlp, name, Conv1D(lin.weight.detach().T.contiguous(), bias))
    return conv


CONFIGS = {
    "bias": tp.ICLConfig(d_in=5, d_model=6, n_layers=3, n_heads=2, norm="pre"),  # output site: fc_out.bias
    "bias-free": tp.ICLConfig(d_in=5, d_model=6, n_layers=3, n_heads=2, norm="pre", bias=False),  # fc_out.weight
}


@pytest.fixture(params=sorted(CONFIGS))
def pair(request):
    """(Linear model, the same model with Conv1D MLPs, inputs [2, 7, 5])."""
    linear = random_model(CONFIGS[request.param], seed=4)
    x = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return linear, _to_conv1d(linear), x


def test_conversion_keeps_the_function(pair):
    linear, conv, x = pair
    assert type(conv.blocks[0].mlp.fc_in).__name__ == "Conv1D"
    assert conv.blocks[0].mlp.fc_in.weight.shape == (6, 24)  # [in, out]
    assert tp.arch.weight_layout(conv.blocks[0].mlp.fc_in) == "in_out"
    torch.testing.assert_close(conv(x), linear(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("query,remove", [("all", None), (-1, slice(2, 4)), ([4, 6], slice(1, 3))])
def test_conv1d_patch_is_exact(pair, query, remove):
    _, conv, x = pair
    patch = tp.token_patch(conv, x, query=query, remove=remove)
    result = tp.verify(conv, patch, x)
    assert result.max_abs <= 1e-10, result.table()
    for name, delta in patch.items():  # factors in the stored layout: delta [in, out] for Conv1D
        if isinstance(delta, tp.LowRank):
            assert delta.shape == tuple(conv.get_parameter(name).shape), name


def test_conv1d_factors_are_the_linear_ones_swapped(pair):
    """Same math, transposed storage: the Conv1D patch's u is the Linear patch's v and vice versa."""
    linear, conv, x = pair
    p_lin = tp.token_patch(linear, x, query="all")
    p_conv = tp.token_patch(conv, x, query="all")
    assert sorted(p_lin) == sorted(p_conv)
    low_rank = [n for n in p_lin if isinstance(p_lin[n], tp.LowRank)]
    assert "blocks.0.mlp.fc_in.weight" in low_rank
    for name in p_lin:
        a, b = p_lin[name], p_conv[name]
        if name in low_rank:  # u [B, Q, 1, rows], v [B, Q, 1, cols] in each model's stored layout
            torch.testing.assert_close(b.u, a.v, rtol=0, atol=1e-14)
            torch.testing.assert_close(b.v, a.u, rtol=0, atol=1e-14)
        else:  # dense bias deltas have no layout
            torch.testing.assert_close(b, a, rtol=0, atol=1e-14)


def test_apply_and_functional_call_on_conv1d(pair):
    """apply() writes W + delta in the [in, out] layout: the query alone reproduces its with-context
    output; the weights come back bitwise; functional_call's hooks agree with it."""
    _, conv, x = pair
    patch = tp.token_patch(conv, x, query="all")
    stripped = tp.strip_context(conv, x, "all")  # [2 * 7, 1, 5]
    hooked = tp.functional_call(conv, patch, stripped)  # [14, 1, 1]
    before = {n: p.detach().clone() for n, p in conv.named_parameters()}
    ref = conv(x)  # [2, 7, 1]
    for b, q in [(0, 6), (1, 3)]:
        with tp.apply(conv, patch[b, q]):
            out = conv(x[b : b + 1, q : q + 1])  # [1, 1, 1]
        torch.testing.assert_close(out[0, 0], ref[b, q], rtol=0, atol=1e-12)
        torch.testing.assert_close(hooked[b * 7 + q], out[0], rtol=0, atol=1e-12)
    assert all(torch.equal(p, before[n]) for n, p in conv.named_parameters())
