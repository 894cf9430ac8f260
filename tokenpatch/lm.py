"""A small language model trained by the project so that induction heads form (``docs/induction.md``).

The model is an ``ICLTransformer`` reading one-hot ``[token; position]`` vectors (width
``V + T``), as the Markov models do, so its ``read_in`` holds a token embedding and a learned
position embedding, and every tokenpatch tool applies to it. Token 0 is BOS.

Training data (``LMData.sample``): ``[BOS, x_1 .. x_{T-1}]`` with ``x_1`` uniform over ``1..V-1``
and, for ``t >= 1``,

    x_{t+1} = (what followed x_t the last time it occurred)   with probability ``follow``, if x_t occurred before,
    x_{t+1} ~ uniform(1..V-1)                                   otherwise.

Each sequence thus has its own successor map, written only in its context: the only way to beat
``log(V - 1)`` nats is to find the previous occurrence of the current token and copy what came
after it, which is what an induction head does (a previous-token head in layer 0, a head in layer 1
matching the current token against it). With one head per layer this is the circuit that forms
(``docs/induction.md`` §5 has the trials: with more heads in layer 0 the model also builds a
*shifted* circuit, two layer-0 heads at offsets k and k + 1, which the standard scores miss).
Resumable training with a progress bar, as ``tokenpatch.markov``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import FileFormatError, InputError
from .models import ICLConfig, ICLTransformer, read_checkpoint, save_model
from ._training import check_config, check_recipe, load_optim, optim_tensors, run_steps

__all__ = ["LMData", "LMTrain", "lm_model", "lm_inputs", "train_lm", "load_lm", "BOS"]

log = logging.getLogger(__name__)
BOS = 0


@dataclass(frozen=True)
class LMData:
    vocab: int = 32  # V, BOS included
    length: int = 64  # T, BOS included
    follow: float = 0.7  # probability that a recurring token is followed by what followed it last time

    def __post_init__(self) -> None:
        if not (isinstance(self.vocab, int) and self.vocab >= 3 and isinstance(self.length, int) and self.length >= 4
                and 0 <= self.follow <= 1):
            raise InputError(f"LMData needs vocab >= 3, length >= 4 and 0 <= follow <= 1: {self}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def sample(self, batch: int, rng: np.random.Generator) -> torch.Tensor:
        """``[B, T]`` token ids (module docstring)."""
        x = rng.integers(1, self.vocab, size=(batch, self.length))  # the uniform draws
        x[:, 0] = BOS
        copy = rng.random((batch, self.length)) < self.follow  # [B, T]  whether x_t copies, where it can
        last = np.zeros((batch, self.vocab), dtype=x.dtype)  # what followed each token last time (0: nothing yet)
        rows = np.arange(batch)
        for t in range(1, self.length - 1):
            prev = last[rows, x[:, t]]  # [B]
            use = copy[:, t + 1] & (prev > 0)
            x[use, t + 1] = prev[use]
            last[rows, x[:, t]] = x[:, t + 1]
        return torch.from_numpy(x)


@dataclass(frozen=True)
class LMTrain:
    steps: int = 3000
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 500

    def __post_init__(self) -> None:
        check_config(self, counts=("steps", "batch_size", "warmup", "checkpoint_every"), positive=("lr", "grad_clip"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lm_model(data: LMData, d_model: int = 64, n_layers: int = 4, n_heads: int = 1, mlp: bool = True) -> ICLTransformer:
    """A Pre-LN ``ICLTransformer`` for ``data`` (``mlp=False``: attention-only)."""
    return ICLTransformer(ICLConfig(d_in=data.vocab + data.length, d_out=data.vocab, d_model=d_model,
                                    n_layers=n_layers, n_heads=n_heads, norm="pre", mlp=mlp))


def lm_inputs(model: ICLTransformer, ids: torch.Tensor) -> torch.Tensor:
    """One-hot ``[token; position]`` inputs ``[B, T, V + T_max]`` from token ids ``[B, T]``."""
    vocab = model.config.d_out
    n_pos = model.config.d_in - vocab
    if ids.ndim != 2 or ids.shape[1] > n_pos or (ids.numel() and (ids.min() < 0 or ids.max() >= vocab)):
        raise InputError(f"token ids must be [batch, <= {n_pos}] in 0..{vocab - 1}, got {tuple(ids.shape)}")
    dtype = next(model.parameters()).dtype
    eye_v, eye_p = torch.eye(vocab, dtype=dtype), torch.eye(n_pos, dtype=dtype)
    return torch.cat([eye_v[ids], eye_p[: ids.shape[1]].expand(ids.shape[0], -1, -1)], -1)


def train_lm(out: str | Path, data: LMData = LMData(), cfg: LMTrain = LMTrain(), d_model: int = 64, n_layers: int = 4,
             n_heads: int = 1, mlp: bool = True, resume: bool = True, progress: bool | None = None) -> ICLTransformer:
    """Train (or resume) the small LM; the checkpoint (with optimizer and sampler state) is ``out``."""
    out = Path(out)
    recipe = {"data": data.to_dict(), "train": cfg.to_dict(), "model": [d_model, n_layers, n_heads, mlp]}
    if resume and out.exists():
        model, doc, extra = read_checkpoint(out)
        meta = doc.get("meta", {})
        check_recipe(out, meta.get("recipe"), recipe)
        rng = np.random.default_rng()
        rng.bit_generator.state = meta["rng"]
        start, history, ema = int(meta["step"]), meta["history"], meta.get("loss_ema")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        load_optim(opt, extra)
    else:
        torch.manual_seed(cfg.seed)
        model = lm_model(data, d_model, n_layers, n_heads, mlp).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        rng = np.random.default_rng([cfg.seed, 1])
        start, history, ema = 0, [], None

    def checkpoint(step: int) -> None:
        meta = {"recipe": recipe, "step": step, "rng": rng.bit_generator.state, "history": history, "loss_ema": ema,
                "bos": BOS}
        save_model(model, out, meta=meta, extra=optim_tensors(opt))

    def loss_at(step: int) -> torch.Tensor:
        ids = data.sample(cfg.batch_size, rng)
        logits = model(lm_inputs(model, ids))  # [B, T, V]
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, data.vocab), ids[:, 1:].reshape(-1))

    def after(step: int, loss: float) -> dict | None:
        nonlocal ema
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        if step % 50 == 0:
            history.append([step, ema])
            return {"loss": f"{ema:.3f}"}
        return None

    run_steps(model, opt, start=start, steps=cfg.steps, loss_at=loss_at,
              lr_at=lambda step: cfg.lr * min(1.0, (step + 1) / cfg.warmup), grad_clip=cfg.grad_clip,
              checkpoint=checkpoint, checkpoint_every=cfg.checkpoint_every, after=after, desc="train LM",
              progress=progress, where=str(out))
    checkpoint(cfg.steps)
    return model.eval()


def load_lm(path: str | Path) -> ICLTransformer:
    """A small LM written by ``train_lm``."""
    model, doc, _ = read_checkpoint(path)
    if "bos" not in doc.get("meta", {}):
        raise FileFormatError(f"{path} is not a small LM of tokenpatch.lm (no BOS in its record)")
    return model
