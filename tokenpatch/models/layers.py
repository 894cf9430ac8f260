"""Contextual layers: the ``A`` of a contextual block ``T_W(C, x) = M_W(A(C, x))``.

A contextual layer maps a sequence ``h`` of shape ``[batch, pos, d]`` to an output of the same
shape, causally: output ``t`` depends on ``h[:, :t + 1]`` only (``docs/patch-theorem.md``).
That single interface gives every quantity the patch theorem needs:

* ``A(C, x)``      -- run the layer on the whole sequence and read the query's position;
* ``A(x)``         -- run it on the query alone (a length-1 sequence; ``alone`` does this fast);
* ``A(C \\ Y, x)`` -- run it on the sequence with the chunk ``Y`` removed.

Five layers share the interface: causal softmax multi-head attention, causal (normalised) linear
attention, an Elman tanh RNN, a GRU and an LSTM. The recurrent ones wrap torch's fused modules
and start from a zero state, so ``A(x)`` is one recurrence step from zero.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tokenpatch.errors import InputError

__all__ = [
    "ContextualLayer",
    "SoftmaxAttention",
    "LinearAttention",
    "ElmanRNN",
    "GRULayer",
    "LSTMLayer",
    "LAYERS",
    "make_layer",
]


class ContextualLayer(nn.Module):
    """Base class: ``forward(h [B, T, d]) -> [B, T, d]``, causal; ``alone(x [N, d]) -> [N, d]``."""

    kind: ClassVar[str]

    def alone(self, x: Tensor) -> Tensor:
        """``A(x)``: the output for each row of ``x`` [N, d] run as a sequence of its own."""
        return self(x[:, None, :])[:, 0, :]

    def prefix_queries(self, h: Tensor, hq: Tensor, lengths: Tensor, with_alone: bool = False):
        """Virtual query rows: row ``p`` of ``hq [B, P, d]`` read right after the first ``lengths[p]``
        positions of ``h [B, T, d]``, i.e. ``A([h_1..h_n, hq_p])`` at its last position -> ``[B, P, d]``.

        By causality the rows of ``h`` are the same in every prefix, so one call gives the layer's
        output at the query for every context prefix (``tp.trajectory``). This default runs the
        layer once per row; attention and the recurrent layers override it to share the context.
        """
        rows = [self(torch.cat([h[:, :n], hq[:, p : p + 1]], 1))[:, -1] for p, n in enumerate(lengths.tolist())]
        a = torch.stack(rows, 1)  # [B, P, d]
        return (a, self.alone(hq.reshape(-1, hq.shape[-1])).reshape(hq.shape)) if with_alone else a


class _Attention(ContextualLayer):
    """Shared projections of the two attention layers: ``q``, ``k``, ``v``, then ``out``.

    On a lone token both attention layers return ``out(v(x))`` (one key, weight exactly 1), so
    ``forward`` on a length-1 sequence skips the queries and keys.
    """

    def __init__(self, d_model: int, n_heads: int, bias: bool = True):
        super().__init__()
        if d_model % n_heads:
            raise InputError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model, bias=bias)
        self.k = nn.Linear(d_model, d_model, bias=bias)
        self.v = nn.Linear(d_model, d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def _split(self, t: Tensor) -> Tensor:
        batch, pos, d = t.shape
        return t.view(batch, pos, self.n_heads, d // self.n_heads).transpose(1, 2)  # [B, H, T, dh]

    def _merge(self, y: Tensor) -> Tensor:
        batch, _, pos, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(batch, pos, -1))  # [B, T, d]

    def forward(self, h: Tensor) -> Tensor:
        if h.shape[1] == 1:
            return self.out(self.v(h))  # [N, 1, d]
        q, k, v = self._split(self.q(h)), self._split(self.k(h)), self._split(self.v(h))
        return self._merge(self._attend(q, k, v))

    def alone(self, x: Tensor) -> Tensor:
        return self.out(self.v(x))  # [N, d]

    def with_alone(self, h: Tensor, positions: list[int]) -> tuple[Tensor, Tensor]:
        """``(A(C, x) [B, T, d], A(x_p) [B, P, d])``: the layer on the whole sequence and on each of
        ``positions`` alone, sharing work: ``A(x_p) = out(v_p)`` reuses the full pass's values."""
        if h.shape[1] == 1:
            out = self(h)
            return out, out[:, positions]
        v = self.v(h)  # [B, T, d]
        q, k = self._split(self.q(h)), self._split(self.k(h))
        v_p = v if positions == list(range(h.shape[1])) else v[:, positions]  # [B, P, d]
        return self._merge(self._attend(q, k, self._split(v))), self.out(v_p)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        raise NotImplementedError

    def prefix_queries(self, h: Tensor, hq: Tensor, lengths: Tensor, with_alone: bool = False):
        """Keys and values of the context come from ``h`` once; row ``p`` attends to the first
        ``lengths[p]`` of them and to its own key and value. ``with_alone``: also each row alone,
        ``A(hq_p) = out(v_p)`` from the value already computed -> ``(a, a_alone)``."""
        k, v = self._split(self.k(h)), self._split(self.v(h))  # [B, H, T, dh]
        v_rows = self.v(hq)  # [B, P, d]
        q, k_self, v_self = self._split(self.q(hq)), self._split(self.k(hq)), self._split(v_rows)  # [B, H, P, dh]
        a = self._merge(self._attend_prefix(q, k, v, k_self, v_self, lengths))  # [B, P, d]
        return (a, self.out(v_rows)) if with_alone else a

    def _attend_prefix(self, q, k, v, k_self, v_self, lengths) -> Tensor:
        raise NotImplementedError


def _visible(lengths: Tensor, n_keys: int, device) -> Tensor:
    """``[P, T]``: row ``p`` sees context key ``j`` iff ``j < lengths[p]``."""
    return torch.arange(n_keys, device=device)[None, :] < lengths.to(device)[:, None]


# torch's fused CPU attention also returns the log-sum-exp of each row's scores, which lets the
# prefix rows use it (below); private, so it is looked up and used only where it exists.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class SoftmaxAttention(_Attention):
    """Causal multi-head softmax attention, no positional encoding.

    ``A(C, x)_t = W_o concat_h sum_{j<=t} softmax_j(q_t . k_j / sqrt(dh)) v_j``;
    on a lone token ``A(x) = W_o (W_v x + b_v) + b_o``.
    """

    kind = "softmax"

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, dh]

    def pattern(self, h: Tensor) -> Tensor:
        """The attention probabilities ``[B, H, T, T]`` (row ``t``: query ``t`` over keys ``j <= t``)."""
        q, k = self._split(self.q(h)), self._split(self.k(h))  # [B, H, T, dh]
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # [B, H, T, T]
        causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool, device=h.device).tril()
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)

    def _attend_prefix(self, q, k, v, k_self, v_self, lengths) -> Tensor:
        scale = q.shape[-1] ** -0.5
        rows = q.shape[2]
        if (
            _FLASH_CPU is not None
            and q.device.type == "cpu"
            and 1 < rows <= k.shape[2] + 1
            and torch.equal(lengths.cpu(), torch.arange(rows))
        ):
            # row p >= 1 sees keys 0..p-1: causal attention of rows 1.. over the first rows-1 keys, fused;
            # then its own key joins with weight sigmoid(q.k_self - logsumexp(context scores))
            out, lse = _FLASH_CPU(q[:, :, 1:], k[:, :, : rows - 1], v[:, :, : rows - 1], 0.0, True, scale=scale)[:2]
            w = torch.sigmoid((q[:, :, 1:] * k_self[:, :, 1:]).sum(-1) * scale - lse)[..., None]  # [B, H, P-1, 1]
            return torch.cat([v_self[:, :, :1], out + w * (v_self[:, :, 1:] - out)], 2)  # row 0: itself only
        q = q * scale
        scores = torch.cat([q @ k.transpose(-1, -2), (q * k_self).sum(-1, keepdim=True)], -1)  # [B, H, P, T+1]
        visible = F.pad(_visible(lengths, k.shape[2], q.device), (0, 1), value=True)  # context j < lengths[p], and self
        w = torch.softmax(scores.masked_fill_(~visible, float("-inf")), -1)
        return w[..., :-1] @ v + w[..., -1:] * v_self  # [B, H, P, dh]


class LinearAttention(_Attention):
    """Causal normalised linear attention (Katharopoulos et al. 2020), feature map ``elu + 1``.

    ``A(C, x)_t = W_o sum_{j<=t} phi(q_t).phi(k_j) v_j / sum_{j<=t} phi(q_t).phi(k_j)``;
    the denominator is positive because ``phi > 0``.
    """

    kind = "linear"

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k = F.elu(q) + 1, F.elu(k) + 1
        pos = q.shape[2]
        causal = torch.ones(pos, pos, dtype=torch.bool, device=q.device).tril()  # [T, T]
        scores = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)  # [B, H, T, T]
        return (scores @ v) / scores.sum(-1, keepdim=True)  # [B, H, T, dh]

    def _attend_prefix(self, q, k, v, k_self, v_self, lengths) -> Tensor:
        q, k, k_self = F.elu(q) + 1, F.elu(k) + 1, F.elu(k_self) + 1
        s_ctx = (q @ k.transpose(-1, -2)).masked_fill(~_visible(lengths, k.shape[2], q.device), 0.0)  # [B, H, P, T]
        s_self = (q * k_self).sum(-1, keepdim=True)  # [B, H, P, 1]
        return (s_ctx @ v + s_self * v_self) / (s_ctx.sum(-1, keepdim=True) + s_self)  # [B, H, P, dh]


class _Recurrent(ContextualLayer):
    """A torch recurrent module over the sequence from a zero state; output = hidden state h_t."""

    rnn: nn.RNNBase

    def forward(self, h: Tensor) -> Tensor:
        return self.rnn(h)[0]  # [B, T, d]

    def states(self, h: Tensor):
        """The recurrent state after every position, ``[B, T, d]`` (LSTM: ``(h_t, c_t)``)."""
        return self.rnn(h)[0]

    def prefix_queries(self, h: Tensor, hq: Tensor, lengths: Tensor, with_alone: bool = False):
        """The state after each prefix is in the full pass; each row is one step from it."""
        batch, rows, d = hq.shape
        start = self._gather(self.states(h), lengths)  # state after lengths[p] positions, [B, P, d] (each)
        flat = lambda t: t.reshape(1, batch * rows, d)  # noqa: E731
        init = tuple(flat(t) for t in start) if isinstance(start, tuple) else flat(start)
        a = self.rnn(hq.reshape(batch * rows, 1, d), init)[0].reshape(batch, rows, d)
        return (a, self.alone(hq.reshape(-1, d)).reshape(hq.shape)) if with_alone else a

    @staticmethod
    def _gather(states, lengths: Tensor):
        if isinstance(states, tuple):
            return tuple(_Recurrent._gather(s, lengths) for s in states)
        zero = torch.zeros_like(states[:, :1])  # the state before any position
        return torch.cat([zero, states], 1)[:, lengths.to(states.device)]  # [B, P, d]


class ElmanRNN(_Recurrent):
    """``h_t = tanh(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, ``h_0 = 0``; ``A(C, x) = h_{n+1}``."""

    kind = "rnn"

    def __init__(self, d_model: int, bias: bool = True):
        super().__init__()
        self.rnn = nn.RNN(d_model, d_model, nonlinearity="tanh", bias=bias, batch_first=True)


class GRULayer(_Recurrent):
    """Gated recurrent unit (torch ``nn.GRU``) from a zero state; output = hidden state."""

    kind = "gru"

    def __init__(self, d_model: int, bias: bool = True):
        super().__init__()
        self.rnn = nn.GRU(d_model, d_model, bias=bias, batch_first=True)


class LSTMLayer(_Recurrent):
    """Long short-term memory (torch ``nn.LSTM``) from zero states; output = hidden state h_t."""

    kind = "lstm"

    def __init__(self, d_model: int, bias: bool = True):
        super().__init__()
        self.rnn = nn.LSTM(d_model, d_model, bias=bias, batch_first=True)

    def states(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """``(h_t, c_t)`` after every position: torch returns only the last cell state, so the
        recurrence is stepped here with the module's own weights (gates in torch's order i, f, g, o)."""
        r = self.rnn
        pre = h @ r.weight_ih_l0.T  # [B, T, 4d]  the input part of every step at once
        if r.bias:
            pre = pre + r.bias_ih_l0 + r.bias_hh_l0
        state = torch.zeros_like(h[:, 0])  # [B, d]
        cell = torch.zeros_like(state)
        hs, cs = [], []
        for t in range(h.shape[1]):
            i, f, g, o = (pre[:, t] + state @ r.weight_hh_l0.T).chunk(4, -1)
            cell = torch.sigmoid(f) * cell + torch.sigmoid(i) * torch.tanh(g)
            state = torch.sigmoid(o) * torch.tanh(cell)
            hs.append(state)
            cs.append(cell)
        return torch.stack(hs, 1), torch.stack(cs, 1)  # [B, T, d] each


LAYERS: dict[str, type[ContextualLayer]] = {
    cls.kind: cls for cls in (SoftmaxAttention, LinearAttention, ElmanRNN, GRULayer, LSTMLayer)
}


def make_layer(kind: str, d_model: int, n_heads: int = 1, bias: bool = True) -> ContextualLayer:
    """Build the contextual layer named ``kind`` (one of ``LAYERS``)."""
    if kind not in LAYERS:
        raise InputError(f"unknown contextual layer {kind!r}; choose one of {sorted(LAYERS)}")
    cls = LAYERS[kind]
    if issubclass(cls, _Attention):
        return cls(d_model, n_heads, bias=bias)
    return cls(d_model, bias=bias)
