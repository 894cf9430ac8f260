"""The sizes every tiny random configuration starts from (``tiny_configs``, ``tiny_hybrids``,
``tiny_shared_experts``): three layers of width 64, four heads, a 101-token vocabulary."""

from __future__ import annotations

__all__ = ["SMALL", "KV"]

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=101)
KV = dict(SMALL, num_key_value_heads=2)  # grouped-query attention: two key-value heads
