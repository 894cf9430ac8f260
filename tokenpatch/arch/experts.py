"""Stacked experts: a mixture of experts whose output matrices are one tensor ``[E, out, in]``.

``transformers`` keeps a sparse MoE block's experts as stacked tensors (``gate_up_proj [E, 2I, d]``,
``down_proj [E, d, I]``) run by one module on each token's chosen experts, ``experts(x, index,
weights)``. The block's output at a token is

    y = sum_k w_k D_{e_k} h_k,    h_k = act(G_{e_k} x) * (U_{e_k} x)    (k over the chosen experts)

which is one matrix applied to one vector: ``y = [D_1 ... D_E] z`` with ``z [E * I]`` holding
``w_k h_k`` in expert ``e_k``'s block and zeros elsewhere (``scattered_hiddens``). So the stacked
output matrices are patched as that one ``[out, E * I]`` matrix (``lowrank.matrix_shape``), and the
minimal patch ``dD = delta z^T / |z|^2`` of a token splits over its chosen experts' ``down_proj``
in proportion to their routing weights: ``dD_{e_k} = w_k delta h_k^T / sum_j w_j^2 |h_j|^2``.

Which experts modules this reads (``stacked_experts``): those ``transformers`` declares through
``use_experts_implementation`` (its attributes ``has_gate``, ``has_bias``, ``is_transposed``,
``has_post_expert_norm``), stored ``[E, out, in]`` or transposed ``[E, in, out]`` (gpt-oss: the patch of
the one matrix is then kept as its transpose ``[E * in, out]``, as a Conv1D's, ``arch.layouts``),
without a norm after each expert (its output would not be linear in ``D``).

Its weights are read through ``offload.value``: the hooks that call ``scattered_hiddens`` run
before or after the module's own forward, where ``accelerate`` has an offloaded module's stacked
tensors on ``meta`` (loaded for the forward only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import Tensor, nn

from tokenpatch.errors import UnsupportedModelError
from tokenpatch.offload import value

__all__ = ["stacked_experts", "scattered_hiddens", "OUTPUT_MATRIX"]

OUTPUT_MATRIX = "down_proj"  # the stacked output matrices of an experts module


def stacked_experts(module: nn.Module, name: str = "") -> bool:
    """Whether ``module`` is a stacked-experts module tokenpatch patches; raises ``UnsupportedModelError``
    for one it cannot (a norm after each expert)."""
    if not hasattr(module, "has_gate") or getattr(module, OUTPUT_MATRIX, None) is None:
        return False
    what = name or type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedModelError(
            f"{what}: a norm after each expert makes the block's output nonlinear in its output matrices; "
            "tokenpatch patches experts whose outputs are summed as they are"
        )
    return True


def scattered_hiddens(module: nn.Module, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """``z [T, E * I]``: each token's chosen experts' hidden states ``w_k h_k`` in their experts' blocks.

    ``x [T, d]`` the tokens the experts read, ``index [T, K]`` their chosen experts, ``weights [T, K]``
    the routing weights, as the block passes them to ``module``. ``[D_1 ... D_E] z`` is the block's
    output without the experts' output biases. One pass per expert chosen by some token, as the
    module's own eager forward."""
    transposed = module.is_transposed  # matrices stored [E, in, out] (gpt-oss), else [E, out, in]
    n_experts, width = module.down_proj.shape[0], module.down_proj.shape[1 if transposed else 2]  # meta keeps shapes
    dt = torch.promote_types(x.dtype, weights.dtype)
    z = x.new_zeros(x.shape[0], n_experts, width, dtype=dt)  # [T, E, I]
    inner = "gate_up_proj" if module.has_gate else "up_proj"  # [E, 2I or I, d] (transposed: [E, d, 2I or I])
    w = value(module, inner)
    b = value(module, f"{inner}_bias") if module.has_bias else None
    for e in index.unique().tolist():
        if not 0 <= e < n_experts:  # an expert-parallel sentinel: no expert here
            continue
        tok, k = torch.where(index == e)  # [n], [n]
        xe = x[tok]  # [n, d]
        we = w[e].to(xe.device)
        a = Fn.linear(xe, we.T if transposed else we, None if b is None else b[e].to(xe.device))
        # the module's own gating (concatenated or interleaved), or its activation
        h = module._apply_gate(a) if module.has_gate else module.act_fn(a)  # [n, I]
        z[tok, e] = h.to(dt) * weights[tok, k].to(dt)[:, None]
    return z.flatten(1)  # [T, E * I]
