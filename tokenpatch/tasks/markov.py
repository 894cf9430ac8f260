"""In-context learning of Markov chains (``docs/markov.md``), as in *Distinct mechanisms
underlying in-context learning in transformers* and *The Evolution of Statistical Induction Heads*.

A task is a **finite training set of K chains** over C states. Each chain is a transition
matrix ``T^(k)`` whose rows are drawn once from a symmetric ``Dirichlet(alpha)`` and then fixed;
its stationary distribution ``pi^(k)`` solves ``pi (T - I) = 0, sum(pi) = 1`` (a linear solve).
A sequence picks a chain ``k`` uniformly, starts at ``x_1 ~ pi^(k)`` and runs ``N - 1`` steps.
Fresh chains from the same Dirichlet give the out-of-distribution test set.

The model reads a sequence as one-hot vectors, ``[onehot(x_n); onehot(n)]`` (width ``C + N``), so
an ``ICLTransformer``'s ``read_in`` holds a token embedding and a learned position embedding in
its two column blocks: ``read_in(e) = E[:, x_n] + P[:, n] + b``. The minimal model (paper A's
eq. XII7, the first layer replaced by the hard previous-state concatenation) reads
``[onehot(x_n); onehot(x_{n-1}); onehot(n)]`` (width ``2C + N``, zeros for ``x_0``) into a
one-layer transformer. Position ``n``'s output predicts ``x_{n+1}``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from tokenpatch.errors import InputError

# One seed, independent streams: np.random.default_rng([seed, STREAMS[name]]).
STREAMS = {"chains": 0, "train": 1, "eval": 2, "probe": 3, "patching": 4}

__all__ = ["STREAMS", "MarkovTask", "MarkovBatch", "random_chains", "stationary", "sample_sequences", "encode"]


class MarkovBatch(NamedTuple):
    states: Tensor  # [B, N] long, x_1..x_N
    chain: Tensor  # [B] long, index into ``matrices`` (-1 never occurs)
    matrices: Tensor  # [K, C, C] float64, the chains the batch was drawn from


def random_chains(n: int, states: int, alpha: float, rng: np.random.Generator) -> Tensor:
    """``[n, C, C]`` float64 transition matrices, every row drawn from ``Dirichlet(alpha)``."""
    rows = rng.dirichlet(np.full(states, float(alpha)), size=(n, states))  # [n, C, C]
    rows = np.maximum(rows, 1e-300)  # alpha << 1 can underflow a row to all zeros
    return torch.from_numpy(rows / rows.sum(-1, keepdims=True))


def stationary(matrices: Tensor) -> Tensor:
    """``[..., C]`` stationary distributions of ``[..., C, C]`` row-stochastic matrices.

    Solves ``pi (T - I) = 0`` with one equation replaced by ``sum(pi) = 1``: the linear system
    ``A^T pi = e_C`` where ``A = T - I`` with its last column set to ones, unique for an
    irreducible chain. A Dirichlet draw is irreducible almost surely, but with a tiny ``alpha``
    rows can be one-hot to machine precision and the system singular; those matrices take the
    minimum-norm least-squares solution of the same system instead (one of their stationary
    distributions), clipped at 0 and renormalised.
    """
    c = matrices.shape[-1]
    a = matrices - torch.eye(c, dtype=matrices.dtype)
    a[..., :, -1] = 1.0
    rhs = torch.zeros(*matrices.shape[:-2], c, 1, dtype=matrices.dtype)
    rhs[..., -1, 0] = 1.0
    pi, info = torch.linalg.solve_ex(a.transpose(-1, -2), rhs)
    pi = pi[..., 0]
    bad = (info != 0) | ~torch.isfinite(pi).all(-1)
    if bad.any():
        pi[bad] = torch.linalg.lstsq(a.transpose(-1, -2)[bad], rhs[bad], driver="gelsd").solution[..., 0]
    pi = pi.clamp_min(0)
    return pi / pi.sum(-1, keepdim=True)


def sample_sequences(
    matrices: Tensor, chain: Tensor, length: int, rng: np.random.Generator, start: str = "stationary"
) -> Tensor:
    """``[B, N]`` state sequences, row ``b`` from ``matrices[chain[b]]``; all rows advance together.

    Each step draws one uniform per row and inverts the row's cumulative distribution.
    """
    c = matrices.shape[-1]
    k = chain.numpy()
    b = k.shape[0]
    cum = matrices.cumsum(-1).numpy()  # [K, C, C]
    u = rng.random((b, length, 1))  # [B, N, 1]
    x = np.empty((b, length), dtype=np.int64)
    if start == "stationary":
        x[:, 0] = (stationary(matrices).cumsum(-1).numpy()[k] < u[:, 0]).sum(-1)
    elif start == "uniform":
        x[:, 0] = np.floor(u[:, 0, 0] * c)
    else:
        raise InputError(f"start={start!r}; choose 'stationary' or 'uniform'")
    x[:, 0] = np.minimum(x[:, 0], c - 1)
    for n in range(1, length):
        x[:, n] = np.minimum((cum[k, x[:, n - 1]] < u[:, n]).sum(-1), c - 1)  # [B]
    return torch.from_numpy(x)


def encode(
    states: Tensor, n_states: int, n_positions: int, previous: bool = False, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Model inputs ``[B, N, C + N_max]`` (``[B, N, 2C + N_max]`` with ``previous``) from states [B, N].

    Blocks: ``onehot(x_n)``, then ``onehot(x_{n-1})`` if ``previous`` (zero at ``n = 1``), then
    ``onehot(n)``. ``n_positions`` is the longest sequence the model accepts.
    """
    if states.ndim != 2:
        raise InputError(f"states must have shape [batch, length], got {tuple(states.shape)}")
    b, n = states.shape
    if n > n_positions:
        raise InputError(f"sequences of length {n} exceed the model's {n_positions} positions")
    if states.numel() and (states.min() < 0 or states.max() >= n_states):
        raise InputError(f"states must lie in 0..{n_states - 1}, got {states.min().item()}..{states.max().item()}")
    eye_c = torch.eye(n_states, dtype=dtype)
    parts = [eye_c[states]]
    if previous:
        prev = torch.zeros(b, n, n_states, dtype=dtype)
        prev[:, 1:] = eye_c[states[:, :-1]]
        parts.append(prev)
    parts.append(torch.eye(n_positions, dtype=dtype)[:n].expand(b, n, n_positions))
    return torch.cat(parts, -1)


@dataclass(frozen=True)
class MarkovTask:
    """K training chains over C states; sequences of length N with ``x_1 ~ pi``.

    ``seed`` fixes the training chains (the same ``seed`` always gives the same chains); sampling
    sequences takes a separate ``numpy.random.Generator``. Every random stream of a run is
    ``default_rng([seed, STREAMS[name]])``: independent streams from one seed (numpy's
    ``SeedSequence`` hashes the pair), so the chains and the training batches never share bits.
    """

    states: int = 10  # C
    alpha: float = 0.25  # Dirichlet concentration of every row
    length: int = 64  # N
    chains: int = 16  # K
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("states", "length", "chains"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (2 if name != "chains" else 1):
                raise InputError(
                    f"MarkovTask.{name} must be an integer >= {2 if name != 'chains' else 1}, got {value!r}"
                )
        if isinstance(self.alpha, bool) or not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise InputError(f"MarkovTask.alpha must be > 0, got {self.alpha!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise InputError(f"MarkovTask.seed must be an integer >= 0, got {self.seed!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def train_chains(self) -> Tensor:
        """``[K, C, C]`` float64, fixed by ``seed``."""
        return random_chains(
            self.chains, self.states, self.alpha, np.random.default_rng([self.seed, STREAMS["chains"]])
        )

    def fresh_chains(self, n: int, rng: np.random.Generator) -> Tensor:
        """``[n, C, C]`` new chains from the same Dirichlet (out of distribution)."""
        return random_chains(n, self.states, self.alpha, rng)

    def sample(
        self,
        batch: int,
        rng: np.random.Generator,
        which: str = "train",
        length: int | None = None,
        matrices: Tensor | None = None,
    ) -> MarkovBatch:
        """A batch of sequences: from the training chains (``"train"``, chain uniform over K) or
        from fresh chains (``"fresh"``, one new chain per sequence)."""
        if which == "train":
            mats = self.train_chains if matrices is None else matrices
            chain = torch.from_numpy(rng.integers(mats.shape[0], size=batch))
        elif which == "fresh":
            mats = self.fresh_chains(batch, rng)
            chain = torch.arange(batch)
        else:
            raise InputError(f"which={which!r}; choose 'train' or 'fresh'")
        states = sample_sequences(mats, chain, self.length if length is None else length, rng)
        return MarkovBatch(states, chain, mats)
