"""Circuit probes for our own transformers on Markov chains (``docs/markov.md`` §5).

* ``previous_token_score``: ``mean_{t>=1} A[t, t-1]`` per head, the layer-1 half of a
  statistical induction head (it copies ``x_{t-1}`` into position ``t``).
* ``statistical_induction_score``: the attention mass the query ``x_t`` puts on keys ``s`` whose
  previous state equals it, ``mean_t sum_{s<=t: x_{s-1} = x_t} A[t, s]``, beside the mass uniform
  causal attention would put there (``baseline``): the layer-2 half, whose values then average
  the successors of ``x_t`` into the 2-gen estimate ``n_{x_t j} / n_{x_t .}``.
* ``ablated``: ablate heads (``interp.ablation``: their slice of the attention's output-projection
  input) and MLPs, by hooks, removed on exit; no weight is written.
* ``phi``: the memorising phase's task vector, the last layer's attention output at the final
  position (the pooled pair features whose average identifies the chain); ``chain_probe``
  decodes the chain from it; ``phi_patching`` moves it between sequences of different chains.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from tokenpatch.arch import adapter_for
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.interp.ablation import ablate_heads
from tokenpatch.models.icl import ICLTransformer
from tokenpatch.models.markov import log_probs, model_inputs
from tokenpatch.stats import mean_interval
from tokenpatch.tasks.markov import STREAMS, sample_sequences

__all__ = [
    "attention_patterns",
    "mixer_outputs",
    "previous_token_score",
    "statistical_induction_score",
    "ablated",
    "replaced_mixer",
    "phi",
    "chain_probe",
    "phi_patching",
]


def _layer(model: ICLTransformer, layer: int) -> int:
    n = len(model.blocks)
    if not -n <= layer < n:
        raise InputError(f"layer {layer} is outside the model's {n} layers")
    return layer % n


def _check(model: ICLTransformer, layer: int) -> int:
    layer = _layer(model, layer)
    if not hasattr(model.blocks[layer].mixer, "pattern"):
        raise InputError(f"layer {layer} is {model.blocks[layer].mixer.kind} attention; probes need softmax attention")
    return layer


def attention_patterns(model: ICLTransformer, inputs: Tensor) -> list[Tensor]:
    """Every layer's attention probabilities ``[B, H, T, T]`` on ``inputs [B, T, d_in]``
    (``Adapter.attention_patterns``: softmax attention layers only)."""
    return adapter_for(model).attention_patterns(model, inputs)


def mixer_outputs(model: ICLTransformer, inputs: Tensor) -> list[Tensor]:
    """Every layer's attention output ``A(LN(h))`` ``[B, T, d]`` (before the residual add)."""
    seen: list[Tensor] = []
    with (
        registered_hooks((b.mixer.register_forward_hook, lambda m, args, out: seen.append(out)) for b in model.blocks),
        torch.no_grad(),
    ):
        model(inputs)
    return seen


def previous_token_score(pattern: Tensor) -> Tensor:
    """``mean_{b, t>=1} A[b, h, t, t-1]`` -> ``[H]``; 1 for a perfect previous-token head."""
    return pattern.diagonal(-1, -2, -1).mean((0, -1))


def statistical_induction_score(pattern: Tensor, states: Tensor) -> tuple[Tensor, float]:
    """``(score [H], baseline)``: mean over queries ``t >= 1`` of the attention mass on keys
    ``1 <= s <= t`` with ``x_{s-1} = x_t``; ``baseline``: that mass under uniform causal attention,
    ``mean_t #{s: x_{s-1} = x_t} / (t + 1)``."""
    b, t = states.shape
    match = states[:, None, :-1] == states[:, 1:, None]  # [B, T-1, T-1]  (query t>=1, key s>=1) x_{s-1} == x_t
    keys = torch.zeros(b, t, t, dtype=torch.bool)
    keys[:, 1:, 1:] = match
    keys &= torch.ones(t, t, dtype=torch.bool).tril()  # s <= t
    mass = (pattern[:, :, 1:] * keys[:, None, 1:]).sum(-1)  # [B, H, T-1]
    uniform = keys[:, 1:].sum(-1).double() / torch.arange(2, t + 1, dtype=torch.float64)  # [B, T-1]
    return mass.mean((0, -1)), uniform.mean().item()


@contextmanager
def ablated(model: ICLTransformer, heads=(), mlps=(), mode: str = "zero", reference: Tensor | None = None):
    """Ablate ``heads`` (``(layer, head)`` pairs; ``interp.ablation.ablate_heads``, any of its modes)
    and ``mlps`` (layer indices) inside the block.

    An MLP's output (``fc_out``'s: the block calls ``fc_out`` itself) is set to 0 (``mode="zero"``)
    or to its mean over every position of ``reference [B, T, d_in]`` (``"mean"``). Hooks only;
    removed on exit, errors included, so the model is left as it was.
    """
    if mlps and mode not in ("zero", "mean"):
        raise InputError(f"mode={mode!r} for MLPs; choose 'zero' or 'mean'")
    if mode != "zero" and reference is None:
        raise InputError(f"mode={mode!r} needs reference inputs to average over")
    mlps = [_layer(model, l) for l in mlps]
    if any(model.blocks[l].mlp is None for l in mlps):
        raise UnsupportedModelError(f"cannot ablate the MLPs of layers {mlps}: the model is attention-only (no MLPs)")
    means: dict[int, Tensor] = {}
    if mode == "mean" and mlps:
        rec = [
            (
                model.blocks[l].mlp.fc_out.register_forward_hook,
                lambda m, a, o, l=l: means.__setitem__(l, o.mean((0, 1))),
            )
            for l in mlps
        ]
        with registered_hooks(rec), torch.no_grad():
            model(reference)

    def mlp_hook(l):
        return lambda m, a, out: torch.zeros_like(out) if mode == "zero" else means[l].expand_as(out)

    with (
        ablate_heads(model, heads, mode, reference),
        registered_hooks((model.blocks[l].mlp.fc_out.register_forward_hook, mlp_hook(l)) for l in mlps),
    ):
        yield model


@contextmanager
def replaced_mixer(model: ICLTransformer, layer: int, value: Tensor, position: int = -1):
    """Within the block, layer ``layer``'s attention output at ``position`` is ``value [B, d]``."""
    layer = _check(model, layer)

    def hook(module, args, out):
        out = out.clone()
        out[:, position] = value.to(out.dtype)
        return out

    with registered_hooks([(model.blocks[layer].mixer.register_forward_hook, hook)]):
        yield model


def phi(model: ICLTransformer, inputs: Tensor, layer: int = -1, position: int = -1) -> Tensor:
    """The task vector: layer ``layer``'s attention output at ``position`` -> ``[B, d]``."""
    return mixer_outputs(model, inputs)[_check(model, layer)][:, position]


def chain_probe(
    features: Tensor, labels: Tensor, train_fraction: float = 0.5, ridge: float = 1e-3, seed: int = 0
) -> dict:
    """A linear probe for chain identity: ridge least squares from ``[features; 1]`` onto one-hot
    labels on a random ``train_fraction``, argmax accuracy on the rest (beside chance, the
    most frequent held-out label's share)."""
    n = features.shape[0]
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(n))
    cut = max(1, int(train_fraction * n))
    tr, te = perm[:cut], perm[cut:]
    if len(te) == 0:
        raise InputError(f"{n} samples leave none held out at train_fraction={train_fraction}")
    x = torch.cat([features.double(), torch.ones(n, 1, dtype=torch.float64)], 1)  # [n, d+1]
    classes = int(labels.max()) + 1
    y = torch.nn.functional.one_hot(labels, classes).double()  # [n, K]
    gram = x[tr].T @ x[tr] + ridge * torch.eye(x.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(gram, x[tr].T @ y[tr])  # [d+1, K]
    acc = ((x[te] @ w).argmax(1) == labels[te]).double().mean().item()
    chance = labels[te].bincount(minlength=classes).max().item() / len(te)
    return {"accuracy": acc, "chance": chance, "train": len(tr), "test": len(te), "classes": classes}


def _kl_rows(p_ref: Tensor, logp: Tensor) -> Tensor:
    return (p_ref * (torch.log(p_ref.clamp_min(1e-300)) - logp)).sum(-1)  # [S]


def phi_patching(model: ICLTransformer, task, pairs: int = 256, seed: int = 0, layer: int = -1) -> dict:
    """Move ``phi`` from a donor sequence (chain ``a``) into a recipient (chain ``b != a``) and read
    ``KL(T^(a)(x_t, .) || p)`` (to the donor) and ``KL(T^(b)(x_t, .) || p)`` (to the recipient) at the
    recipient's final state ``x_t``. Controls: ``phi`` from another sequence of the recipient's own
    chain, the mean ``phi``, and a random direction of the recipient's ``phi`` norm. Each entry:
    mean and 95% interval over ``pairs`` (``{"mean", "lo", "hi"}``, Student t)."""
    chains = task.train_chains
    k = chains.shape[0]
    if k < 2:
        raise InputError("phi patching needs at least two training chains (K >= 2)")
    if pairs < 2:
        raise InputError(f"phi patching needs pairs >= 2 for its intervals, got {pairs}")
    rng = np.random.default_rng([seed, STREAMS["patching"]])
    b = torch.from_numpy(rng.integers(k, size=pairs))
    a = (b + torch.from_numpy(rng.integers(1, k, size=pairs))) % k  # a != b
    rec = sample_sequences(chains, b, task.length, rng)
    don = sample_sequences(chains, a, task.length, rng)
    same = sample_sequences(chains, b, task.length, rng)
    phis = {
        name: phi(model, model_inputs(model, task, s), layer)
        for name, s in (("recipient", rec), ("donor", don), ("same_chain", same))
    }
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(phis["recipient"].shape, generator=gen, dtype=phis["recipient"].dtype)
    values = {
        "clean": None,
        "donor": phis["donor"],
        "same_chain": phis["same_chain"],
        "mean": torch.cat(list(phis.values())).mean(0).expand_as(phis["recipient"]),
        "random": noise / noise.norm(dim=1, keepdim=True) * phis["recipient"].norm(dim=1, keepdim=True),
    }
    last = rec[:, -1]
    t_don, t_rec = chains[a, last], chains[b, last]  # [S, C]
    out = {}
    for name, value in values.items():
        if value is None:
            lp = log_probs(model, task, rec)[:, -1]
        else:
            with replaced_mixer(model, layer, value):
                lp = log_probs(model, task, rec)[:, -1]
        row = {}
        for key, ref in (("kl_donor", t_don), ("kl_recipient", t_rec)):
            v = _kl_rows(ref, lp)
            row[key] = mean_interval(v)  # {"mean", "lo", "hi"}, Student t over the pairs
        out[name] = row
    return out
