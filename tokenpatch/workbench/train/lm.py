"""Train the small induction LM (``tokenpatch.models.lm``, ``docs/induction.md``): resumable, with a progress bar."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenpatch.models.icl import ICLTransformer, read_checkpoint, save_model
from tokenpatch.models.lm import lm_inputs, lm_model, load_lm
from tokenpatch.tasks.repeats import BOS, LMData
from tokenpatch.workbench.train.loop import TrainingConfig, check_recipe, load_optim, optim_tensors, run_steps

__all__ = ["LMData", "LMTrain", "lm_model", "lm_inputs", "train_lm", "load_lm", "BOS"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LMTrain(TrainingConfig):
    steps: int = 3000
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    checkpoint_every: int = 500

    RECIPE_KEYS = ("steps", "batch_size", "lr", "warmup", "grad_clip", "seed", "checkpoint_every")


def train_lm(
    out: str | Path,
    data: LMData = LMData(),
    cfg: LMTrain = LMTrain(),
    d_model: int = 64,
    n_layers: int = 4,
    n_heads: int = 1,
    mlp: bool = True,
    resume: bool = True,
    progress: bool | None = None,
) -> ICLTransformer:
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
        meta = {
            "recipe": recipe,
            "step": step,
            "rng": rng.bit_generator.state,
            "history": history,
            "loss_ema": ema,
            "bos": BOS,
        }
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

    run_steps(
        model,
        opt,
        start=start,
        steps=cfg.steps,
        loss_at=loss_at,
        lr_at=cfg.lr_at,
        grad_clip=cfg.grad_clip,
        checkpoint=checkpoint,
        checkpoint_every=cfg.checkpoint_every,
        after=after,
        desc="train LM",
        progress=progress,
        where=str(out),
    )
    checkpoint(cfg.steps)
    return model.eval()
