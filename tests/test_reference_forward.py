"""An independent float64 forward, written from the norm table in ``models.py`` with raw tensor
ops (layer norm and MLP by hand; the mixer is tested in test_layers.py), against ``Block.forward``,
``Block.mix`` / ``Block.finish`` and ``ICLTransformer.forward`` for every layer kind, norm
placement and residual choice, with norms and biases moved off their init."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_block, random_model

import tokenpatch as tp

LAYERS = sorted(tp.LAYERS)
ROWS = [(norm, residual) for norm in ("none", "pre", "post") for residual in (True, False)]  # the table's rows
ACTS = {
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),  # torch's default, exact erf form
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "tanh": torch.tanh,
}


def layer_norm(x, ln):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim, biased variance."""
    mean = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def linear(x, lin):
    """``x @ W^T + b`` (no bias when the module has none)."""
    y = x @ lin.weight.T
    return y if lin.bias is None else y + lin.bias


def reference_block(block: tp.Block, h):
    """``(m, s, y)`` of the table in models.py, row by row: ``h [B, T, d]`` -> each ``[B, T, d]``."""
    c, A, res = block.config, block.mixer, block.residual

    def mlp(s):  # act(s @ W_in^T + b_in) @ W_out^T + b_out
        return linear(ACTS[c.activation](linear(s, block.mlp.fc_in)), block.mlp.fc_out)

    if c.norm == "none":  # m = h + A(h) | A(h);               s = m
        m = h + A(h) if res else A(h)
        s = m
    elif c.norm == "pre":  # m = h + A(LN1(h)) | A(LN1(h));    s = LN2(m)
        a = A(layer_norm(h, block.ln1))
        m = h + a if res else a
        s = layer_norm(m, block.ln2)
    else:  # post:         m = LN1(h + A(h)) | LN1(A(h));      s = m
        m = layer_norm(h + A(h) if res else A(h), block.ln1)
        s = m
    y = m + mlp(s) if res else mlp(s)
    if c.norm == "post":  # y = LN2(m + MLP(s)) | LN2(MLP(s))
        y = layer_norm(y, block.ln2)
    return m, s, y


def reference_model(model: tp.ICLTransformer, x):
    """``(out [B, T, d_out], [h^1 .. h^L])``: read_in, blocks, ln_f (Pre-LN only), read_out."""
    h = linear(x, model.read_in)
    hidden = []
    for block in model.blocks:
        h = reference_block(block, h)[2]
        hidden.append(h)
    final = layer_norm(h, model.ln_f) if model.config.norm == "pre" else h
    return linear(final, model.read_out), hidden


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("norm,residual", ROWS)
@pytest.mark.parametrize("layer", LAYERS)
def test_block_matches_the_table(layer, norm, residual):
    """Block.forward, Block.mix (m, s) and Block.finish against the hand-written row."""
    config = tp.ICLConfig(d_in=6, d_model=6, n_layers=1, n_heads=2, d_mlp=10, layer=layer, norm=norm, residual=residual)
    block = random_block(config, seed=11)
    h = torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(12), dtype=torch.float64)  # [B, T, d]
    m, s, y = reference_block(block, h)
    assert (y - h).abs().max() > 1e-2  # the block does something
    with torch.no_grad():
        _close(block(h), y)
        got_m, got_s = block.mix(h)
        _close(got_m, m)
        _close(got_s, s)
        _close(block.finish(got_m, got_s)[1], y)


@pytest.mark.parametrize("activation", sorted(ACTS))
@pytest.mark.parametrize("bias", [True, False])
def test_block_activation_and_bias(activation, bias):
    config = tp.ICLConfig(
        d_in=4, d_model=4, n_layers=1, n_heads=2, layer="softmax", norm="post", activation=activation, bias=bias
    )
    block = random_block(config, seed=13)
    h = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    with torch.no_grad():
        _close(block(h), reference_block(block, h)[2])


@pytest.mark.parametrize("norm,residual", ROWS)
@pytest.mark.parametrize("layer", LAYERS)
def test_model_matches_the_reference(layer, norm, residual):
    """ICLTransformer.forward and its return_hidden list against read_in -> blocks -> ln_f -> read_out."""
    config = tp.ICLConfig(
        d_in=3, d_out=2, d_model=6, n_layers=3, n_heads=2, d_mlp=8, layer=layer, norm=norm, residual=residual
    )
    model = random_model(config, seed=15)
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(16), dtype=torch.float64)  # [B, T, d_in]
    out, hidden = reference_model(model, x)  # [B, T, 2], 3 x [B, T, 6]
    with torch.no_grad():
        _close(model(x), out)
        got, got_hidden = model(x, return_hidden=True)
    _close(got, out)
    assert len(got_hidden) == len(hidden) == 3
    for g, r in zip(got_hidden, hidden):
        _close(g, r)
