"""Train an ``ICLTransformer`` on in-context linear regression (``tokenpatch train``).

Adam on the squared error of the query prediction, fresh tasks every step, learning rate with
linear warm-up then cosine decay. Checkpoints are the model file of ``models.save_model`` with the
optimizer moments and the data generator's state stored beside the weights, written atomically
every ``checkpoint_every`` steps and on Ctrl-C; running again with the same path resumes, and
a resumed run is bit-for-bit the run that was not interrupted.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenpatch.errors import FileFormatError
from tokenpatch.models.icl import ICLConfig, ICLTransformer, read_checkpoint, save_model
from tokenpatch.tasks.linreg import DEFAULT_TASK, LinRegTask, evaluate
from tokenpatch.workbench.train.loop import TrainingConfig, check_recipe, load_optim, optim_tensors, run_steps

__all__ = ["TrainConfig", "train", "lr_at", "DEFAULT_MODEL", "DEFAULT_TASK", "DEFAULT_TRAIN"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig(TrainingConfig):
    steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    warmup: int = 100
    checkpoint_every: int = 250
    min_lr_ratio: float = 0.05
    eval_tasks: int = 2048

    COUNTS = ("eval_tasks",)
    NONNEGATIVE = ("min_lr_ratio",)
    RECIPE_KEYS = (
        "steps",
        "batch_size",
        "lr",
        "warmup",
        "min_lr_ratio",
        "grad_clip",
        "seed",
        "checkpoint_every",
        "eval_tasks",
    )

    def lr_at(self, step: int) -> float:
        """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# The shipped checkpoint (tokenpatch/models/data/linreg-pre10.safetensors) is exactly this recipe.
DEFAULT_MODEL = ICLConfig(d_in=DEFAULT_TASK.d_in, d_out=1, d_model=64, n_layers=10, n_heads=4, norm="pre")
DEFAULT_TRAIN = TrainConfig()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """``cfg.lr_at(step)``: linear warm-up, then cosine decay to ``min_lr_ratio * lr``."""
    return cfg.lr_at(step)


def train(
    out: str | Path,
    model_config: ICLConfig = DEFAULT_MODEL,
    task: LinRegTask = DEFAULT_TASK,
    cfg: TrainConfig = DEFAULT_TRAIN,
    resume: bool = True,
    progress: bool | None = None,
) -> ICLTransformer:
    """Train (or resume training) and return the model; the checkpoint lives at ``out``.

    Resuming checks that the file was written by the same recipe (model, task, training
    config) and raises ``FileFormatError`` otherwise, rather than mixing two runs.
    """
    out = Path(out)
    recipe = {"model": model_config.to_dict(), "task": task.to_dict(), "train": cfg.to_dict()}
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    history: list[list[float]] = []
    start, ema = 0, None
    if resume and out.exists():
        model, doc, extra = read_checkpoint(out)
        if "rng" not in extra:
            raise FileFormatError(
                f"{out} holds weights only (no optimizer or data-stream state), so training cannot resume "
                "from it; pass another path, or resume=False to start afresh"
            )
        check_recipe(out, doc.get("meta", {}).get("recipe"), recipe)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        load_optim(opt, extra)
        gen.set_state(extra["rng"])
        start = int(doc["meta"]["step"])
        history = doc["meta"].get("history", [])
        ema = doc["meta"].get("loss_ema")
        log.info("resuming %s at step %d", out, start)
    else:
        torch.manual_seed(cfg.seed)
        model = ICLTransformer(model_config).train()
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    def checkpoint(step: int, extra_meta: dict | None = None) -> None:
        meta = {"recipe": recipe, "step": step, "loss_ema": ema, "history": history, **(extra_meta or {})}
        tensors = {**optim_tensors(opt), "rng": gen.get_state()}
        save_model(model, out, meta=meta, extra=tensors)

    def loss_at(step: int) -> torch.Tensor:
        batch = task.sample(cfg.batch_size, gen)
        pred = model(batch.tokens)[:, -1, 0]  # [B]
        return torch.nn.functional.mse_loss(pred, batch.target)

    def after(step: int, loss: float) -> dict:
        nonlocal ema
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        if step % 50 == 0:
            history.append([step, ema])
        return {"loss": f"{ema:.4f}"}

    t0 = time.perf_counter()
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
        desc="train",
        progress=progress,
        where=str(out),
    )
    model.eval()
    result = evaluate(model, task, n_tasks=cfg.eval_tasks)
    seconds = time.perf_counter() - t0
    checkpoint(cfg.steps, {"eval": result, "seconds_last_session": seconds})
    log.info(
        "trained %s: MSE %.4f (zero %.4f, least squares %.4f)",
        out,
        result["mse_model"],
        result["mse_zero"],
        result["mse_least_squares"],
    )
    return model
