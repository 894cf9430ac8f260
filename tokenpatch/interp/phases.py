"""The four ideal in-context predictors of a Markov-chain mixture, and phase labels (``docs/markov.md``).

Context ``x_1..x_t`` (0-based here: ``x_0..x_t``), current state ``i = x_t``; counts
``n_j = #{s <= t : x_s = j}``, ``n_ij = #{s < t : x_s = i, x_{s+1} = j}``, ``n_i. = sum_j n_ij``.
Each predictor gives ``p(x_{t+1} = j | x_0..x_t)`` at every position, as log-probabilities ``[B, N, C]``:

* ``1-gen``  ``(n_j + alpha) / (t + 1 + C alpha)``: posterior predictive of one Dirichlet
  unigram (``unigram="bigram-stationary"``: the stationary vector of the 2-gen matrix instead);
* ``2-gen``  ``(n_ij + alpha) / (n_i. + C alpha)``: posterior predictive of row ``i`` under
  ``Dirichlet(alpha)`` rows (the statistical induction head's target);
* ``2-mem``  ``sum_k w_k T^(k)(i, j)``, ``w_k ∝ rho_k pi^(k)(x_0) prod_{s<t} T^(k)(x_s, x_{s+1})``:
  the Bayes posterior over the K training chains;
* ``1-mem``  ``w_k ∝ rho_k prod_{s<=t} pi^(k)(x_s)`` (a unigram likelihood), then ``rule="row"``:
  ``sum_k w_k T^(k)(i, j)``, or ``rule="stationary"``: ``sum_k w_k pi^(k)(j)``;
* ``uniform`` ``1/C`` and ``true`` ``T^(chain)(i, j)``.

The chain posteriors are kept as log-weights (a cumulative sum of log-likelihoods, normalised
by a softmax at each position), so thousands of positions never underflow. Long batches are
computed in chunks of sequences, so the ``[b, N, C, C]`` running bigram counts stay within ``CHUNK``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tokenpatch.errors import InputError
from tokenpatch.tasks.markov import stationary

__all__ = ["PREDICTORS", "PHASES", "LABELS", "predictors", "cross_entropy", "kl_to", "phase_label", "mixture_fit"]

CHUNK = 2**24  # float64 entries of the [b, N, C, C] bigram counts per chunk of sequences (128 MiB)
PREDICTORS = ("uniform", "1-gen", "2-gen", "1-mem", "2-mem", "true")
PHASES = {"1-gen": "G1", "2-gen": "G2", "1-mem": "M1", "2-mem": "M2"}
LABELS = {"uniform": "U", **PHASES}


def _log(p: Tensor) -> Tensor:
    return torch.log(p.clamp_min(1e-300))


def _mixture(logw: Tensor, rows: Tensor) -> Tensor:
    """``log sum_k softmax(logw)_k rows_k``: ``logw [B, N, K]``, ``rows [B, N, K, C]`` or ``[K, C]``."""
    w = torch.softmax(logw, -1)  # [B, N, K]
    p = torch.einsum("bnk,kc->bnc", w, rows) if rows.ndim == 2 else torch.einsum("bnk,bnkc->bnc", w, rows)
    return _log(p)


def _mem_rows(states: Tensor, chains: Tensor, logw: Tensor) -> Tensor:
    """``log sum_k w_k T^(k)(x_t, .)`` without a ``[B, N, K, C]`` gather: ``w @ T.reshape(K, C*C)``."""
    b, n = states.shape
    c = chains.shape[-1]
    full = torch.softmax(logw, -1) @ chains.reshape(chains.shape[0], c * c)  # [B, N, C*C]
    rows = full.view(b, n, c, c).gather(2, states[:, :, None, None].expand(b, n, 1, c))[:, :, 0]  # [B, N, C]
    return _log(rows)


def predictors(
    states: Tensor,
    chains: Tensor,
    alpha: float,
    *,
    prior: Tensor | None = None,
    rule: str = "row",
    unigram: str = "counts",
    true_chains: Tensor | None = None,
    chain: Tensor | None = None,
) -> dict[str, Tensor]:
    """Log-probabilities ``[B, N, C]`` of every predictor in ``PREDICTORS`` at every position.

    ``states [B, N]`` long; ``chains [K, C, C]``: the training chains the ``mem`` predictors know;
    ``prior [K]``: ``rho`` (default uniform); ``true_chains [M, C, C]`` and ``chain [B]``: each
    sequence's own chain for ``true`` (default ``chains`` and no ``true`` entry without ``chain``).
    """
    if states.ndim != 2 or states.dtype != torch.long:
        raise InputError(f"states must be a LongTensor [batch, length], got {states.dtype} {tuple(states.shape)}")
    k, c = chains.shape[0], chains.shape[-1]
    if chains.shape != (k, c, c):
        raise InputError(f"chains must have shape [K, C, C], got {tuple(chains.shape)}")
    if states.numel() and (states.min() < 0 or states.max() >= c):
        raise InputError(f"states must lie in 0..{c - 1}")
    if rule not in ("row", "stationary"):
        raise InputError(f"rule={rule!r}; choose 'row' or 'stationary'")
    if unigram not in ("counts", "bigram-stationary"):
        raise InputError(f"unigram={unigram!r}; choose 'counts' or 'bigram-stationary'")
    if alpha <= 0:
        raise InputError(f"alpha must be > 0, got {alpha}")
    step = max(1, CHUNK // max(1, states.shape[1] * c * c))  # sequences per chunk: [b, N, C, C] stays small
    if states.shape[0] > step:
        parts = [
            predictors(
                states[i : i + step],
                chains,
                alpha,
                prior=prior,
                rule=rule,
                unigram=unigram,
                true_chains=true_chains,
                chain=None if chain is None else chain[i : i + step],
            )
            for i in range(0, states.shape[0], step)
        ]
        return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    chains = chains.to(torch.float64)
    b, n = states.shape
    onehot = torch.nn.functional.one_hot(states, c).to(torch.float64)  # [B, N, C]
    counts = onehot.cumsum(1)  # [B, N, C]  n_j, s <= t
    pairs = onehot[:, :-1, :, None] * onehot[:, 1:, None, :]  # [B, N-1, C, C]  transition s -> s+1
    bigram = torch.zeros(b, n, c, c, dtype=torch.float64)
    bigram[:, 1:] = pairs.cumsum(1)  # [B, N, C, C]  n_ij, s < t
    out = {"uniform": torch.full((b, n, c), -math.log(c), dtype=torch.float64)}

    rows = bigram.gather(2, states[:, :, None, None].expand(b, n, 1, c))[:, :, 0]  # [B, N, C]  n_{x_t, j}
    out["2-gen"] = _log(rows + alpha) - _log(rows.sum(-1, keepdim=True) + c * alpha)
    if unigram == "counts":
        t1 = torch.arange(1, n + 1, dtype=torch.float64)[None, :, None]  # t + 1 states seen
        out["1-gen"] = _log(counts + alpha) - _log(t1 + c * alpha)
    else:
        est = (bigram + alpha) / (bigram.sum(-1, keepdim=True) + c * alpha)  # [B, N, C, C]
        out["1-gen"] = _log(stationary(est))

    prior = torch.full((k,), 1.0 / k, dtype=torch.float64) if prior is None else prior.to(torch.float64)
    if (
        prior.shape != (k,)
        or (prior < 0).any()
        or not torch.isclose(prior.sum(), torch.tensor(1.0, dtype=torch.float64))
    ):
        raise InputError(f"prior must be a probability vector of length K={k}")
    log_pi = _log(stationary(chains))  # [K, C]
    log_t = _log(chains)  # [K, C, C]
    trans = log_t[:, states[:, :-1], states[:, 1:]].permute(1, 2, 0)  # [B, N-1, K]  log T^k(x_s, x_{s+1})
    logw2 = _log(prior) + log_pi[:, states[:, 0]].T[:, None, :].expand(b, n, k).clone()  # [B, N, K]
    logw2[:, 1:] += trans.cumsum(1)
    out["2-mem"] = _mem_rows(states, chains, logw2)
    logw1 = _log(prior) + log_pi[:, states].permute(1, 2, 0).cumsum(1)  # [B, N, K]  sum_{s<=t} log pi^k(x_s)
    out["1-mem"] = _mem_rows(states, chains, logw1) if rule == "row" else _mixture(logw1, stationary(chains))
    if chain is not None:
        truth = (chains if true_chains is None else true_chains.to(torch.float64))[chain]  # [B, C, C]
        out["true"] = _log(truth.gather(1, states[:, :, None].expand(b, n, c)))  # [B, N, C]
    return {name: out[name] for name in PREDICTORS if name in out}


def cross_entropy(logp: Tensor, states: Tensor) -> Tensor:
    """Per-sequence mean of ``-log p(x_{t+1})`` over positions ``t = 0..N-2`` -> ``[B]`` (nats)."""
    target = states[:, 1:, None]  # [B, N-1, 1]
    return -logp[:, :-1].gather(-1, target)[..., 0].mean(1)


def kl_to(logp_ref: Tensor, logp_model: Tensor) -> Tensor:
    """``KL(p_ref || p_model)`` at every position but the last -> ``[B, N-1]``."""
    p = logp_ref[:, :-1].exp()
    return (p * (logp_ref[:, :-1] - logp_model[:, :-1])).sum(-1)


def phase_label(kl: dict[str, float], margin: float = 0.01) -> str:
    """The phase whose predictor has the least KL: ``U`` (uniform, an untrained model), ``G1``,
    ``G2``, ``M1`` or ``M2``; ``"G2/M2"``-style when the runner-up is within ``margin`` nats."""
    ranked = sorted(LABELS, key=lambda name: kl[name])
    best, second = ranked[0], ranked[1]
    if kl[second] - kl[best] <= margin:
        return "/".join(sorted((LABELS[best], LABELS[second])))
    return LABELS[best]


def mixture_fit(
    logp_model: Tensor, refs: dict[str, Tensor], iters: int = 500, tol: float = 1e-10
) -> tuple[dict[str, float], float]:
    """The convex mixture of ``refs`` closest to the model: ``min_w E_ctx KL(p_model || sum_P w_P p_P)``.

    The objective is convex in ``w`` on the simplex; the EM update
    ``w_P <- w_P E_ctx[sum_j p_model(j) p_P(j) / q(j)]`` (``q`` the current mixture) decreases it
    monotonically. Returns ``(weights, KL at the optimum)``; positions as in ``kl_to``.
    """
    names = list(refs)
    p = logp_model[:, :-1].exp().reshape(-1, logp_model.shape[-1]).to(torch.float64)  # [M, C]
    comp = torch.stack([refs[n][:, :-1].exp().reshape(p.shape) for n in names])  # [P, M, C]
    w = torch.full((len(names),), 1.0 / len(names), dtype=torch.float64)

    def objective(w: Tensor) -> tuple[Tensor, float]:
        q = torch.einsum("p,pmc->mc", w, comp).clamp_min(1e-300)  # [M, C]
        return q, (p * (_log(p) - _log(q))).sum(-1).mean().item()

    q, kl = objective(w)
    for _ in range(iters):
        new = w * torch.einsum("mc,pmc->p", p / q, comp) / p.shape[0]
        new = new / new.sum()
        q_new, kl_new = objective(new)
        done = kl - kl_new < tol
        w, q, kl = new, q_new, kl_new
        if done:
            break
    return dict(zip(names, w.tolist())), kl
