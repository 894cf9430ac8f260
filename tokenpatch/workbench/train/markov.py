"""Train small transformers on Markov-chain mixtures and follow their phase (``docs/markov.md``).

The model (``tokenpatch.models.markov``) is an ``ICLTransformer`` reading one-hot
``[state; position]`` vectors.

Training is next-state cross-entropy at every position on fresh sequences from the K training
chains (random streams: ``tasks.markov.STREAMS``) (AdamW, linear warm-up, then a constant rate, so that time on the x-axis is not
confounded with a decay schedule). At log-spaced steps the run evaluates a fixed, seeded set of
sequences from the training chains and from fresh chains: the model's cross-entropy, its KL to
each ideal predictor, the phase label and the mixture weights (``interp.phases``), and keeps a
weights-only snapshot. The run directory holds ``model.safetensors`` (resumable: optimizer,
random state and history inside) and ``step-XXXXXXX.safetensors`` snapshots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenpatch.errors import FileFormatError, InputError
from tokenpatch.interp.phases import PHASES, cross_entropy, kl_to, mixture_fit, phase_label, predictors
from tokenpatch.models.icl import ICLTransformer, read_checkpoint, save_model
from tokenpatch.models.markov import MarkovModel, log_probs, markov_model, model_inputs
from tokenpatch.tasks.markov import STREAMS, MarkovTask
from tokenpatch.workbench.train.loop import TrainingConfig, check_recipe, load_optim, optim_tensors, run_steps

__all__ = [
    "MarkovTrain",
    "EvalSet",
    "eval_set",
    "evaluate",
    "train_markov",
    "load_run",
    "log_steps",
    "MarkovModel",
    "markov_model",
    "log_probs",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MarkovTrain(TrainingConfig):
    steps: int = 4000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 50
    checkpoint_every: int = 500
    weight_decay: float = 0.0
    evals: int = 24  # log-spaced evaluation points (plus step 0)
    eval_sequences: int = 256

    COUNTS = ("evals", "eval_sequences")
    NONNEGATIVE = ("weight_decay",)
    RECIPE_KEYS = (
        "steps",
        "batch_size",
        "lr",
        "warmup",
        "weight_decay",
        "grad_clip",
        "seed",
        "evals",
        "eval_sequences",
        "checkpoint_every",
    )


@dataclass
class EvalSet:
    """Fixed evaluation sequences and every predictor's log-probabilities on them."""

    train: torch.Tensor  # [S, N] states from the training chains
    fresh: torch.Tensor  # [S, N] states from fresh chains
    refs: dict[str, dict[str, torch.Tensor]]  # "train"/"fresh" -> predictor -> [S, N, C]


def eval_set(task: MarkovTask, sequences: int = 256, seed: int = 0) -> EvalSet:
    """``sequences`` from the training chains and as many from fresh chains, from the stream
    ``[seed, STREAMS["eval"]]``, with every predictor's log-probabilities."""
    rng = np.random.default_rng([seed, STREAMS["eval"]])
    chains = task.train_chains
    sets, refs = {}, {}
    for which in ("train", "fresh"):
        batch = task.sample(sequences, rng, which, matrices=chains if which == "train" else None)
        sets[which] = batch.states
        refs[which] = predictors(batch.states, chains, task.alpha, true_chains=batch.matrices, chain=batch.chain)
    return EvalSet(sets["train"], sets["fresh"], refs)


def evaluate(model: ICLTransformer, task: MarkovTask, data: EvalSet, margin: float = 0.01) -> dict:
    """Cross-entropies, ``KL(p_P || p_model)`` per predictor, the phase label and the mixture
    weights, on the training chains (``train``) and on fresh chains (``fresh``)."""
    out = {}
    for which, states in (("train", data.train), ("fresh", data.fresh)):
        lp = log_probs(model, task, states)
        refs = data.refs[which]
        kl = {name: kl_to(refs[name], lp).mean().item() for name in refs}
        weights, resid = mixture_fit(lp, {name: refs[name] for name in PHASES})
        out[which] = {
            "loss": cross_entropy(lp, states).mean().item(),
            "kl": kl,
            "label": phase_label(kl, margin),
            "mixture": weights,
            "mixture_kl": resid,
        }
    return out


def reference_losses(data: EvalSet) -> dict:
    """Every predictor's cross-entropy on the evaluation set."""
    return {
        which: {name: cross_entropy(lp, getattr(data, which)).mean().item() for name, lp in refs.items()}
        for which, refs in data.refs.items()
    }


def log_steps(steps: int, points: int) -> list[int]:
    """``0`` and ``points`` log-spaced steps in ``1..steps`` (deduplicated, ``steps`` included)."""
    return sorted({0, *np.unique(np.round(np.geomspace(1, steps, points)).astype(int)).tolist(), steps})


def _recipe(task, shape, cfg) -> dict:
    return {"task": task.to_dict(), "model": shape.to_dict(), "train": cfg.to_dict()}


def train_markov(
    out: str | Path,
    task: MarkovTask,
    shape: MarkovModel = MarkovModel(),
    cfg: MarkovTrain = MarkovTrain(),
    resume: bool = True,
    progress: bool | None = None,
    snapshots: bool = True,
) -> tuple[ICLTransformer, list[dict]]:
    """Train (or resume) in the directory ``out``; returns the model and the evaluation history.

    History entries: ``{"step", "train": {...}, "fresh": {...}}`` as ``evaluate`` returns them.
    Resuming checks the recipe and continues bit-for-bit (model, optimizer and sampler state).
    """
    out = Path(out)
    path = out / "model.safetensors"
    recipe = _recipe(task, shape, cfg)
    data = eval_set(task, cfg.eval_sequences, seed=cfg.seed)
    chains = task.train_chains
    when = log_steps(cfg.steps, cfg.evals)
    if resume and path.exists():
        model, doc, extra = read_checkpoint(path)
        meta = doc.get("meta", {})
        check_recipe(path, meta.get("recipe"), recipe)
        rng = np.random.default_rng()
        rng.bit_generator.state = meta["rng"]
        start, history = int(meta["step"]), meta["history"]
        model.train()
        opt = _optimizer(model, cfg)
        load_optim(opt, extra)
        log.info("resuming %s at step %d", path, start)
    else:
        for stale in out.glob("step-*.safetensors"):  # starting afresh: the old run's snapshots go too
            stale.unlink()
        torch.manual_seed(cfg.seed)
        model = markov_model(task, shape).train()
        opt = _optimizer(model, cfg)
        rng = np.random.default_rng([cfg.seed, STREAMS["train"]])
        start, history = 0, []

    def checkpoint(step: int) -> None:
        meta = {
            "recipe": recipe,
            "step": step,
            "rng": rng.bit_generator.state,
            "history": history,
            "references": reference_losses(data),
        }
        save_model(model, path, meta=meta, extra=optim_tensors(opt))

    def record(step: int) -> None:  # a Ctrl-C may cut it short (run_steps): the history entry comes last
        model.eval()
        try:
            entry = {"step": step, **evaluate(model, task, data)}
        finally:
            model.train()
        if snapshots:
            save_model(model, out / f"step-{step:07d}.safetensors", meta={"recipe": recipe, "step": step})
        history.append(entry)

    if start in when and (not history or history[-1]["step"] < start):  # new, or its evaluation was cut short
        record(start)

    def loss_at(step: int) -> torch.Tensor:
        batch = task.sample(cfg.batch_size, rng, "train", matrices=chains)
        logits = model(model_inputs(model, task, batch.states))  # [B, N, C]
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, task.states), batch.states[:, 1:].reshape(-1)
        )

    def after(step: int, loss: float) -> dict | None:
        if step not in when:
            return None
        record(step)
        return {"loss": f"{history[-1]['train']['loss']:.3f}", "phase": history[-1]["train"]["label"]}

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
        desc=f"train K={task.chains}",
        progress=progress,
        where=str(path),
    )
    checkpoint(cfg.steps)
    return model.eval(), history


def _optimizer(model, cfg: MarkovTrain) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def load_run(out: str | Path) -> tuple[ICLTransformer, MarkovTask, dict]:
    """``(model, task, meta)`` of a run directory written by ``train_markov``."""
    path = Path(out) / "model.safetensors"
    if not path.exists():
        raise InputError(f"{out} holds no Markov run (no model.safetensors); train one with `tokenpatch markov train`")
    model, doc, _ = read_checkpoint(path)
    meta = doc.get("meta", {})
    if "recipe" not in meta or "task" not in meta["recipe"]:
        raise FileFormatError(f"{path} is not a Markov run (no task in its recipe)")
    return model, MarkovTask(**meta["recipe"]["task"]), meta
