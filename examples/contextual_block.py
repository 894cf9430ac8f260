"""The paper's contextual block T_W(C, x) = f(W A(C, x) + b), for attention and for an RNN, with
a chunk Y removed from the middle of the context instead of all of it.

    python examples/contextual_block.py
"""

import torch

import tokenpatch as tp

torch.manual_seed(0)
h = torch.randn(1, 12, 16, dtype=torch.float64)  # a context of 11 tokens and a query, width 16
chunk = slice(3, 7)  # Y: remove tokens 3..6

for layer in ["softmax", "rnn"]:
    config = tp.ICLConfig(d_in=16, d_model=16, n_layers=1, n_heads=4, layer=layer, norm="none", residual=False)
    block = tp.Block(config).double()  # residual-free, norm-free: exactly T_W
    patch = tp.token_patch(block, h, query=-1, remove=chunk)
    dw = patch["mlp.fc_in.weight"]
    result = tp.verify(block, patch, h)
    print(f"{layer:>8}: dW rank {dw.rank}, |dW|_F = {dw.norm().item():.4f}, max abs error {result.max_abs:.1e}")

    # the same patch, by hand: W (A(C, x) - A(C \\ Y, x)) A(C \\ Y, x)^T / |A(C \\ Y, x)|^2
    kept = torch.cat([h[:, :3], h[:, 7:]], 1)
    a_c, a_0 = block.mixer(h)[0, -1], block.mixer(kept)[0, -1]
    w = block.mlp.fc_in.weight
    by_hand = torch.outer(w @ (a_c - a_0), a_0) / (a_0 @ a_0)
    print(f"{'':>8}  matches the formula: {torch.allclose(dw.dense()[0, 0], by_hand, atol=1e-13)}")
