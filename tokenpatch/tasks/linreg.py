"""In-context linear regression (``docs/linear-regression.md``), as in *Learning without training*.

A task is a weight vector ``w ~ N(0, I_D)``. Its context holds ``n`` tokens ``e_i = [x_i; y_i]``
with ``x_i ~ N(0, I_D)`` and ``y_i = w . x_i + noise * eps_i``; the query token is ``[x_q; 0]``
and the target ``y_q = w . x_q + noise * eps_q``. The model's prediction is its output at the
query position (``d_out = 1``).

Baselines, per task, from the context alone:

* zero predictor:  ``0``, MSE ``D + noise^2``;
* least squares:   ``x_q . pinv(X) y`` (minimum-norm solution when ``n < D``);
* ridge:           ``x_q . (X^T X + lam I)^{-1} X^T y``; ``lam = noise^2`` is the Bayes posterior
  mean under the ``N(0, I)`` prior, the best any predictor can do in expectation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from tokenpatch.errors import InputError

__all__ = [
    "LinRegTask",
    "LinRegBatch",
    "least_squares",
    "ridge",
    "evaluate",
    "task_of",
    "DEFAULT_TASK",
    "training_points",
    "fresh_queries",
    "query_tokens",
]


class LinRegBatch(NamedTuple):
    tokens: Tensor  # [B, n + 1, D + 1]; the last token is the query [x_q; 0]
    target: Tensor  # [B]  y_q
    w: Tensor  # [B, D]
    x: Tensor  # [B, n + 1, D]  context inputs, then x_q
    y: Tensor  # [B, n + 1]    context outputs, then y_q


@dataclass(frozen=True)
class LinRegTask:
    dim: int = 4  # D
    n_context: int = 16  # context pairs n
    noise: float = 0.0

    def __post_init__(self) -> None:
        if self.dim < 1 or self.n_context < 0 or not self.noise >= 0:
            raise InputError(f"invalid LinRegTask {self}: need dim >= 1, n_context >= 0, noise >= 0")

    @property
    def d_in(self) -> int:
        return self.dim + 1

    def to_dict(self) -> dict:
        return asdict(self)

    def sample(self, batch: int, generator: torch.Generator | None = None, dtype=torch.float32) -> LinRegBatch:
        """``batch`` fresh tasks, drawn in float64 from ``generator`` then cast to ``dtype``."""
        g = dict(generator=generator, dtype=torch.float64)
        n, d = self.n_context, self.dim
        w = torch.randn(batch, d, **g)  # [B, D]
        x = torch.randn(batch, n + 1, d, **g)  # [B, n+1, D]
        y = torch.einsum("btd,bd->bt", x, w) + self.noise * torch.randn(batch, n + 1, **g)  # [B, n+1]
        tokens = torch.cat([x, y[..., None]], dim=-1)  # [B, n+1, D+1]
        tokens[:, -1, -1] = 0.0  # the query token carries no y
        cast = lambda t: t.to(dtype)  # noqa: E731
        return LinRegBatch(cast(tokens), cast(y[:, -1]), cast(w), cast(x), cast(y))


def training_points(batch: LinRegBatch, n: int | None = None) -> tuple[Tensor, Tensor]:
    """The first ``n`` (default: all) context examples as no-context training points, for
    ``tp.finetune``: sequences ``[x_i; 0]`` of one token ``[B, n, 1, D + 1]`` and targets ``y_i`` ``[B, n, 1]``."""
    n_ctx = batch.tokens.shape[1] - 1
    n = n_ctx if n is None else n
    if not 1 <= n <= n_ctx:
        raise InputError(f"n must be in 1..{n_ctx} (the context examples), got {n}")
    tokens = batch.tokens[:, :n].clone()  # [B, n, D+1]
    tokens[..., -1] = 0.0  # y moves from the token to the target
    return tokens[:, :, None], batch.y[:, :n, None]


def query_tokens(lead: tuple[int, ...], dim: int, generator: torch.Generator | None = None) -> Tensor:
    """Fresh query tokens ``[x; 0]`` with ``x ~ N(0, I_dim)``: ``[*lead, dim + 1]``, float64, from one
    ``torch.randn(*lead, dim)`` draw of ``generator``. Every fresh query of the package (``fresh_queries``,
    the report's held-out and calibration queries) is drawn here; a task's own query is drawn with its
    context by ``LinRegTask.sample``."""
    x = torch.randn(*lead, dim, generator=generator, dtype=torch.float64)
    return torch.cat([x, torch.zeros(*lead, 1, dtype=torch.float64)], -1)


def fresh_queries(
    batch: LinRegBatch, m: int, noise: float = 0.0, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """``m`` new queries of each task of ``batch`` (same ``w``): tokens ``[x; 0]`` ``[B, m, D + 1]``
    (``query_tokens``) and targets ``w . x + noise * eps`` ``[B, m]``, drawn in float64 then cast to the
    batch's dtype."""
    b, d = batch.w.shape
    tokens = query_tokens((b, m), d, generator)  # [B, m, D+1]
    x = tokens[..., :-1].contiguous()  # [B, m, D]
    y = torch.einsum("bmd,bd->bm", x, batch.w.double()) + noise * torch.randn(
        b, m, generator=generator, dtype=torch.float64
    )
    return tokens.to(batch.tokens.dtype), y.to(batch.tokens.dtype)


def least_squares(x: Tensor, y: Tensor, x_query: Tensor) -> Tensor:
    """Minimum-norm least squares from ``x`` [B, n, D], ``y`` [B, n]: predictions at ``x_query`` [B, D]."""
    w_hat = torch.linalg.pinv(x.double()) @ y.double()[..., None]  # [B, D, 1]
    return (x_query.double()[:, None, :] @ w_hat)[:, 0, 0].to(x.dtype)  # [B]


def ridge(x: Tensor, y: Tensor, x_query: Tensor, lam: float) -> Tensor:
    """Ridge regression ``(X^T X + lam I)^{-1} X^T y`` evaluated at ``x_query`` [B, D] -> [B]."""
    if lam <= 0:
        return least_squares(x, y, x_query)
    xd, yd = x.double(), y.double()
    gram = xd.transpose(1, 2) @ xd + lam * torch.eye(x.shape[-1], dtype=torch.float64, device=x.device)  # [B, D, D]
    w_hat = torch.linalg.solve(gram, xd.transpose(1, 2) @ yd[..., None])  # [B, D, 1]
    return (x_query.double()[:, None, :] @ w_hat)[:, 0, 0].to(x.dtype)


@torch.no_grad()
def evaluate(model, task: LinRegTask, n_tasks: int = 1024, seed: int = 1234, ridge_lam: float | None = None) -> dict:
    """MSE of ``model`` on ``n_tasks`` fresh tasks beside the zero, least-squares and ridge
    predictors (same tasks). Returns a JSON-able dict; ``ratio_zero`` = model MSE / zero MSE."""
    lam = task.noise**2 if ridge_lam is None else ridge_lam
    dtype = next(model.parameters()).dtype
    batch = task.sample(n_tasks, torch.Generator().manual_seed(seed), dtype=dtype)
    pred = model(batch.tokens)[:, -1, 0]  # [B]
    ctx_x, ctx_y, xq = batch.x[:, :-1], batch.y[:, :-1], batch.x[:, -1]
    mse = lambda p: float(((p.double() - batch.target.double()) ** 2).mean())  # noqa: E731
    out = {
        "n_tasks": n_tasks,
        "seed": seed,
        "mse_model": mse(pred),
        "mse_zero": mse(torch.zeros_like(pred)),
        "mse_least_squares": mse(least_squares(ctx_x, ctx_y, xq)),
        "ridge_lambda": lam,
        "mse_ridge": mse(ridge(ctx_x, ctx_y, xq, lam)),
    }
    out["ratio_zero"] = out["mse_model"] / out["mse_zero"]
    return out


# The task of the shipped checkpoint (tokenpatch/models/data/linreg-pre10.safetensors).
DEFAULT_TASK = LinRegTask(dim=4, n_context=16, noise=0.1)


def task_of(model) -> LinRegTask:
    """The linear-regression task a checkpoint was trained on (its recipe), else ``DEFAULT_TASK``."""
    task = getattr(model, "meta", {}).get("recipe", {}).get("task")
    return LinRegTask(**task) if task else DEFAULT_TASK
