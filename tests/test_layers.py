"""Contextual layers: causal, A(x) from a lone token, one interface for all five."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp


def _layer(kind, d=6, seed=0):
    torch.manual_seed(seed)
    return tp.make_layer(kind, d, n_heads=2).double()


@pytest.mark.parametrize("kind", sorted(tp.LAYERS))
def test_causal(kind):
    layer = _layer(kind)
    h = torch.randn(2, 9, 6, dtype=torch.float64)
    changed = h.clone()
    changed[:, 5:] = torch.randn(2, 4, 6, dtype=torch.float64)
    out, out2 = layer(h), layer(changed)
    assert out.shape == h.shape
    torch.testing.assert_close(out[:, :5], out2[:, :5], rtol=0, atol=1e-14)
    assert (out[:, 5:] - out2[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", sorted(tp.LAYERS))
def test_alone_is_the_layer_on_a_single_token(kind):
    layer = _layer(kind)
    x = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(layer.alone(x), layer(x[:, None])[:, 0], rtol=0, atol=1e-14)
    if kind in ("softmax", "linear"):  # the length-1 shortcut equals attention over one key
        seq = x[:, None]
        q, k, v = (layer._split(f(seq)) for f in (layer.q, layer.k, layer.v))
        torch.testing.assert_close(layer._merge(layer._attend(q, k, v))[:, 0], layer.alone(x), rtol=0, atol=1e-14)
    # and it is not the output with context
    h = torch.cat([torch.randn(5, 3, 6, dtype=torch.float64), x[:, None]], 1)
    assert (layer(h)[:, -1] - layer.alone(x)).abs().max() > 1e-3


def test_closed_forms_of_a_lone_token():
    """Softmax over one key is 1: A(x) = W_o (W_v x + b_v) + b_o. Elman: tanh(W_ih x + b_ih + b_hh)."""
    att = _layer("softmax")
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(att(x[:, None])[:, 0], att.out(x @ att.v.weight.T + att.v.bias), rtol=0, atol=1e-14)
    rnn = _layer("rnn").rnn
    ref = torch.tanh(x @ rnn.weight_ih_l0.T + rnn.bias_ih_l0 + rnn.bias_hh_l0)
    torch.testing.assert_close(_layer("rnn").alone(x), ref, rtol=0, atol=1e-14)


def test_linear_attention_formula():
    att = _layer("linear")
    h = torch.randn(1, 4, 6, dtype=torch.float64)
    q, k, v = att.q(h)[0], att.k(h)[0], att.v(h)[0]
    heads = lambda t: t.view(4, 2, 3).transpose(0, 1)  # noqa: E731  [H, T, dh]
    q, k, v = (heads(t) for t in (q, k, v))
    phi = lambda t: torch.nn.functional.elu(t) + 1  # noqa: E731
    out = []
    for t in range(4):
        w = phi(q[:, t : t + 1]) @ phi(k[:, : t + 1]).transpose(1, 2)  # [H, 1, t+1]
        out.append((w @ v[:, : t + 1]) / w.sum(-1, keepdim=True))
    ref = att.out(torch.cat(out, 1).transpose(0, 1).reshape(4, 6))
    torch.testing.assert_close(att(h)[0], ref, rtol=0, atol=1e-13)


def test_unknown_layer_and_bad_heads():
    with pytest.raises(ValueError, match="unknown contextual layer"):
        tp.make_layer("mamba", 4)
    with pytest.raises(ValueError, match="divisible"):
        tp.make_layer("softmax", 5, n_heads=2)
    with pytest.raises(ValueError, match="norm"):
        tp.ICLConfig(d_in=2, norm="middle")
