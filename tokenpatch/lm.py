"""A small language model trained by the project so that induction heads form (``docs/induction.md``).

The model is an ``ICLTransformer`` reading one-hot ``[token; position]`` vectors (width
``V + T``), as the Markov models do, so its ``read_in`` holds a token embedding and a learned
position embedding, and every tokenpatch tool applies to it. Token 0 is BOS.

Training data (``LMData.sample``): ``[BOS, x_1 .. x_{T-1}]`` with tokens uniform over ``1..V-1``
and repeats: a share ``whole`` of the sequences holds one stretch of ``span_min..span_max`` tokens
followed at once by the same stretch; each of the others copies ``spans`` earlier stretches of
``span_min..span_max`` tokens to later places. Offsets vary, so only matching content (an induction
head), not a fixed position, finds what comes next. Next-token prediction on such data rewards
exactly the induction mechanism (after a token that occurred before, predict what followed it),
which is the only way to beat ``log(V - 1)`` nats. Resumable training with a progress bar, as
``tokenpatch.markov``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ._progress import DELAY_S
from .errors import FileFormatError, InputError
from .models import ICLConfig, ICLTransformer, read_checkpoint, save_model
from .train import _deferred_interrupt, _load_optim, _optim_tensors

__all__ = ["LMData", "LMTrain", "lm_model", "lm_inputs", "train_lm", "load_lm", "BOS"]

log = logging.getLogger(__name__)
BOS = 0


@dataclass(frozen=True)
class LMData:
    vocab: int = 128  # V, BOS included
    length: int = 64  # T, BOS included
    spans: int = 2  # repeated stretches per sequence
    span_min: int = 4
    span_max: int = 12
    whole: float = 0.5  # share of sequences holding one long stretch repeated at once

    def __post_init__(self) -> None:
        if not (self.vocab >= 3 and self.length >= 4 and 1 <= self.span_min <= self.span_max and self.spans >= 0
                and 0 <= self.whole <= 1):
            raise InputError(f"LMData needs vocab >= 3, length >= 4, 1 <= span_min <= span_max, spans >= 0: {self}")
        if 2 * self.span_max + 1 > self.length:
            raise InputError(f"LMData: a span of {self.span_max} and its copy do not fit in {self.length} positions")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def sample(self, batch: int, rng: np.random.Generator) -> torch.Tensor:
        """``[B, T]`` token ids (module docstring)."""
        x = rng.integers(1, self.vocab, size=(batch, self.length))
        x[:, 0] = BOS
        whole = rng.random(batch) < self.whole
        for b in np.flatnonzero(whole):  # a random stretch of random length, repeated at once
            n = int(rng.integers(self.span_min, self.span_max + 1))
            start = int(rng.integers(1, self.length - 2 * n + 1))
            x[b, start + n:start + 2 * n] = x[b, start:start + n]
        for b in np.flatnonzero(~whole):
            for _ in range(self.spans):
                n = int(rng.integers(self.span_min, self.span_max + 1))
                src = int(rng.integers(1, self.length - 2 * n + 1))  # the first copy: src .. src + n - 1
                dst = int(rng.integers(src + n, self.length - n + 1))  # the second, after it
                x[b, dst:dst + n] = x[b, src:src + n]
        return torch.from_numpy(x)


@dataclass(frozen=True)
class LMTrain:
    steps: int = 3000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 500

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lm_model(data: LMData, d_model: int = 64, n_layers: int = 2, n_heads: int = 4) -> ICLTransformer:
    return ICLTransformer(ICLConfig(d_in=data.vocab + data.length, d_out=data.vocab, d_model=d_model,
                                    n_layers=n_layers, n_heads=n_heads, norm="pre"))


def lm_inputs(model: ICLTransformer, ids: torch.Tensor) -> torch.Tensor:
    """One-hot ``[token; position]`` inputs ``[B, T, V + T_max]`` from token ids ``[B, T]``."""
    vocab = model.config.d_out
    n_pos = model.config.d_in - vocab
    if ids.ndim != 2 or ids.shape[1] > n_pos or (ids.numel() and (ids.min() < 0 or ids.max() >= vocab)):
        raise InputError(f"token ids must be [batch, <= {n_pos}] in 0..{vocab - 1}, got {tuple(ids.shape)}")
    dtype = next(model.parameters()).dtype
    eye_v, eye_p = torch.eye(vocab, dtype=dtype), torch.eye(n_pos, dtype=dtype)
    return torch.cat([eye_v[ids], eye_p[: ids.shape[1]].expand(ids.shape[0], -1, -1)], -1)


def train_lm(out: str | Path, data: LMData = LMData(), cfg: LMTrain = LMTrain(), d_model: int = 64, n_layers: int = 2,
             n_heads: int = 4, resume: bool = True, progress: bool | None = None) -> ICLTransformer:
    """Train (or resume) the small LM; the checkpoint (with optimizer and sampler state) is ``out``."""
    out = Path(out)
    recipe = {"data": data.to_dict(), "train": cfg.to_dict(), "model": [d_model, n_layers, n_heads]}
    if resume and out.exists():
        model, doc, extra = read_checkpoint(out)
        meta = doc.get("meta", {})
        if meta.get("recipe") != recipe:
            raise FileFormatError(f"{out} was written by another recipe; choose another path or start afresh")
        rng = np.random.default_rng()
        rng.bit_generator.state = meta["rng"]
        start, history = int(meta["step"]), meta["history"]
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        _load_optim(opt, extra)
    else:
        torch.manual_seed(cfg.seed)
        model = lm_model(data, d_model, n_layers, n_heads).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        rng = np.random.default_rng([cfg.seed, 1])
        start, history = 0, []

    def checkpoint(step: int) -> None:
        meta = {"recipe": recipe, "step": step, "rng": rng.bit_generator.state, "history": history, "bos": BOS}
        save_model(model, out, meta=meta, extra=_optim_tensors(opt))

    bar = tqdm(total=cfg.steps, initial=start, desc="train LM", unit="step",
               **({"disable": None, "delay": DELAY_S} if progress is None else {"disable": not progress}))
    ema = history[-1][1] if history else None
    with _deferred_interrupt() as stop:
        for step in range(start, cfg.steps):
            ids = data.sample(cfg.batch_size, rng)
            logits = model(lm_inputs(model, ids))  # [B, T, V]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, data.vocab), ids[:, 1:].reshape(-1))
            for group in opt.param_groups:
                group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            if (step + 1) % 50 == 0:
                history.append([step + 1, ema])
                bar.set_postfix(loss=f"{ema:.3f}")
            bar.update(1)
            if stop.requested:
                checkpoint(step + 1)
                bar.close()
                raise KeyboardInterrupt
            if (step + 1) % cfg.checkpoint_every == 0:
                checkpoint(step + 1)
    bar.close()
    checkpoint(cfg.steps)
    return model.eval()


def load_lm(path: str | Path) -> ICLTransformer:
    """A small LM written by ``train_lm``."""
    model, doc, _ = read_checkpoint(path)
    if "bos" not in doc.get("meta", {}):
        raise FileFormatError(f"{path} is not a small LM of tokenpatch.lm (no BOS in its record)")
    return model
