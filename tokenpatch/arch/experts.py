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
without a norm after each expert (its output would not be linear in ``D``); and DBRX's experts,
called alike, whose output matrices ``mlp.w2`` ``[E * I, d]`` are that one matrix's transpose, and JetMoE's
block, which routes the tokens itself (``OTHER_EXPERTS``, ``experts_call``).

Its weights are read through ``offload.value``: the hooks that call ``scattered_hiddens`` run
before or after the module's own forward, where ``accelerate`` has an offloaded module's stacked
tensors on ``meta`` (loaded for the forward only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as Fn
from torch import Tensor, nn

from tokenpatch.errors import UnsupportedModelError
from tokenpatch.offload import value

__all__ = ["stacked_experts", "scattered_hiddens", "experts_call", "output_matrix", "OUTPUT_MATRIX", "OTHER_EXPERTS"]

OUTPUT_MATRIX = "down_proj"  # the stacked output matrices of an experts module
# Experts modules of other kinds, class name -> their output matrices under them. DBRX's experts, called as
# transformers' are (``experts(x, index, weights)``), hold every expert's matrices stacked along their
# rows, ``[E * I, d]`` each: the gate and up matrices ``w1``, ``v1`` read as ``x W^T``, the output matrices
# ``w2`` as ``h W`` (the one matrix ``[D_1 ... D_E]`` stored as its transpose, ``arch.layouts``). JetMoE's
# block is called with the tokens alone and routes them itself (its ``router``, read again here): its
# ``input_linear`` ``[E, 2I, d]`` (gate, then up) and ``output_linear`` ``[E, d, I]``, plus an output bias.
OTHER_EXPERTS: dict[str, str] = {"DbrxExperts": "mlp.w2", "JetMoeMoE": "output_linear.weight"}


def output_matrix(module: nn.Module) -> str:
    """The name of an experts module's output matrices under it (``down_proj``; ``OTHER_EXPERTS``)."""
    return OTHER_EXPERTS.get(type(module).__name__, OUTPUT_MATRIX)


def stacked_experts(module: nn.Module, name: str = "") -> bool:
    """Whether ``module`` is a stacked-experts module tokenpatch patches; raises ``UnsupportedModelError``
    for one it cannot (a norm after each expert)."""
    if type(module).__name__ in OTHER_EXPERTS:
        return True
    if not hasattr(module, "has_gate") or getattr(module, OUTPUT_MATRIX, None) is None:
        return False
    what = name or type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedModelError(
            f"{what}: a norm after each expert makes the block's output nonlinear in its output matrices; "
            "tokenpatch patches experts whose outputs are summed as they are"
        )
    return True


def experts_call(module: nn.Module, args: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, index, weights)`` of a call of experts module ``module`` with ``args``: as passed, or, for a
    block that routes the tokens itself (JetMoE's), ``x`` and its router's choice ``[..., K]`` each."""
    if len(args) >= 3:
        return args[0], args[1], args[2]
    x, router = args[0], module.router  # JetMoE: top-k of the logits, softmax over the k, as its router
    top, index = router.layer(x).float().topk(router.top_k, dim=-1)
    return x, index, torch.softmax(top, dim=-1).type_as(x)


def _expert_hidden(module: nn.Module) -> tuple[Callable[[int, Tensor], Tensor], int, int]:
    """``(hidden, E, I)``: ``hidden(e, x [n, d]) -> [n, I]`` expert ``e``'s hidden state, as the module's
    own eager forward computes it; its number of experts and hidden width."""
    kind = type(module).__name__
    if kind == "DbrxExperts":  # [E * I, d] matrices, the GLU module's activation
        glu = module.mlp
        n_experts, width = module.num_experts, module.ffn_hidden_size
        w1, v1 = (value(glu, n).view(n_experts, width, -1) for n in ("w1", "v1"))

        def glu_hidden(e: int, x: Tensor) -> Tensor:
            return glu.activation_fn(x @ w1[e].to(x.device).T) * (x @ v1[e].to(x.device).T)

        return glu_hidden, n_experts, width
    if kind == "JetMoeMoE":  # [E, 2I, d]: gate, then up
        w_in = value(module.input_linear, "weight")

        def jet_hidden(e: int, x: Tensor) -> Tensor:
            gate, up = Fn.linear(x, w_in[e].to(x.device)).chunk(2, dim=-1)
            return module.activation(gate) * up

        return jet_hidden, w_in.shape[0], w_in.shape[1] // 2
    transposed = module.is_transposed  # matrices stored [E, in, out] (gpt-oss), else [E, out, in]
    n_experts, width = module.down_proj.shape[0], module.down_proj.shape[1 if transposed else 2]  # meta keeps shapes
    inner = "gate_up_proj" if module.has_gate else "up_proj"  # [E, 2I or I, d] (transposed: [E, d, 2I or I])
    w = value(module, inner)
    b = value(module, f"{inner}_bias") if module.has_bias else None

    def hidden(e: int, x: Tensor) -> Tensor:
        we = w[e].to(x.device)
        a = Fn.linear(x, we.T if transposed else we, None if b is None else b[e].to(x.device))
        # the module's own gating (concatenated or interleaved), or its activation
        return module._apply_gate(a) if module.has_gate else module.act_fn(a)

    return hidden, n_experts, width


def scattered_hiddens(module: nn.Module, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """``z [T, E * I]``: each token's chosen experts' hidden states ``w_k h_k`` in their experts' blocks.

    ``x [T, d]`` the tokens the experts read, ``index [T, K]`` their chosen experts, ``weights [T, K]``
    the routing weights, as the block passes them to ``module``. ``[D_1 ... D_E] z`` is the block's
    output without the experts' output biases. One pass per expert chosen by some token, as the
    module's own eager forward."""
    hidden, n_experts, width = _expert_hidden(module)
    dt = torch.promote_types(x.dtype, weights.dtype)
    z = x.new_zeros(x.shape[0], n_experts, width, dtype=dt)  # [T, E, I]
    for e in index.unique().tolist():
        if not 0 <= e < n_experts:  # an expert-parallel sentinel: no expert here
            continue
        tok, k = torch.where(index == e)  # [n], [n]
        z[tok, e] = hidden(e, x[tok]).to(dt) * weights[tok, k].to(dt)[:, None]
    return z.flatten(1)  # [T, E * I]
