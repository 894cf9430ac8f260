"""What token patches say about a Markov-chain phase (``docs/markov.md`` §6).

For sequences ``x_1..x_t`` from the training chains, the context ``C = x_1..x_{t-1}`` is dropped
and the final state ``x_t`` is the query:

* **phi against the thought vector.** ``phi`` is the last layer's attention output at ``x_t``.
  The thought vector of ``C`` (``thought_patch(..., inputs=False, output="vector")``) is, per
  layer, the constant ``v_l = mean_q (y_l(C, q) - y_l^0(q))`` over the C possible query states
  ``q`` at position ``t`` (sequential: layers below already patched). Both are taken at the last
  layer and compared by cosine: raw; centred (each minus its mean over sequences, which
  removes the offset every context shares); and ``phi``'s context part ``dA = A(C, x) - A(x)``
  (the token patch's context vector at that layer, ``A(x)`` the query's value alone) against ``v``.
* **The implicit update.** ``tp.trajectory`` gives the exact token patch of ``fc_in`` in every
  layer for every prefix ``x_1..x_i`` of the context; we report ``|dW|_F`` at the full context
  and the exponent ``a`` of the per-token step norms ``|dW_i - dW_{i-1}|_F ~ i^a``.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.dynamics import diagnostics
from tokenpatch.dynamics.trajectories import trajectory
from tokenpatch.interp.circuits import phi
from tokenpatch.models.icl import ICLTransformer
from tokenpatch.models.markov import model_inputs
from tokenpatch.tasks.markov import STREAMS, encode
from tokenpatch.thought.front import thought_patch

__all__ = ["phase_bridge"]


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)


def phase_bridge(model: ICLTransformer, task, sequences: int = 32, seed: int = 0) -> dict:
    """``{"phi_cosine": {"raw", "centred"}, "update_norm": [per layer], "step_exponent": [per layer]}``
    (means over ``sequences`` training-chain sequences; module docstring)."""
    model = copy.deepcopy(model).double()  # the caller's model is left in its dtype
    rng = np.random.default_rng([seed, STREAMS["probe"]])
    states = task.sample(sequences, rng, "train").states  # [S, N]
    x = model_inputs(model, task, states)  # [S, N, d_in]
    last = len(model.blocks) - 1
    seen = []
    mixer = model.blocks[last].mixer
    with registered_hooks([(mixer.register_forward_pre_hook, lambda m, args: seen.append(args[0][:, -1]))]):
        f = phi(model, x)  # [S, d]
    with torch.no_grad():
        context = f - mixer.alone(seen[0])  # [S, d]  dA = A(C, x) - A(x): the token patch's context vector
    n = states.shape[1]
    candidates = torch.arange(task.states)[:, None].expand(task.states, n).clone()  # every state as x_t
    minimal = model.config.d_in == 2 * task.states + task.length
    vectors = []
    for s in range(sequences):
        if minimal:  # x_{t-1} is part of the query token itself
            candidates[:, -2] = states[s, -2]
        q = encode(candidates, task.states, task.length, previous=minimal, dtype=x.dtype)[:, -1:]  # [C, 1, d_in]
        fit = thought_patch(model, x[s, :-1], q, inputs=False, output="vector", progress=False)
        vectors.append(fit.patch[f"blocks.{last}.mlp.fc_out.bias"].reshape(-1))  # [d]
    v = torch.stack(vectors)  # [S, d]
    traj = trajectory(model, x, query=-1)
    names = [f"blocks.{i}.mlp.fc_in.weight" for i in range(len(model.blocks))]
    norms = [diagnostics.total_norms(traj, name)[:, -1].mean().item() for name in names]
    expo = [diagnostics.decay_exponent(diagnostics.step_norms(traj, name)).mean().item() for name in names]
    return {
        "sequences": sequences,
        "phi_cosine": {
            "raw": _cos(f, v).mean().item(),
            "centred": _cos(f - f.mean(0), v - v.mean(0)).mean().item(),
            "context_vector": _cos(context, v).mean().item(),
        },
        "update_norm": norms,
        "step_exponent": expo,
    }
