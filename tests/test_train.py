"""Training: checkpoints, bit-exact resume (also after Ctrl-C), clear errors on bad files."""

from __future__ import annotations

import signal

import pytest
import torch

import tokenpatch as tp
from tokenpatch.models.icl import read_checkpoint
from tokenpatch.tasks.linreg import LinRegTask, least_squares, ridge
from tokenpatch.workbench.train.linreg import TrainConfig, lr_at, train

TASK = LinRegTask(dim=2, n_context=4, noise=0.1)
MODEL = tp.ICLConfig(d_in=3, d_model=8, n_layers=2, n_heads=2)


def _cfg(steps, every=4):
    return TrainConfig(steps=steps, batch_size=8, lr=1e-2, warmup=2, checkpoint_every=every, eval_tasks=16)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _CrashingTask(LinRegTask):
    """Raises while sampling the batch of step ``crash_at`` (counting from 1), like a crash."""

    def sample(self, batch, generator=None, dtype=torch.float32):
        object.__setattr__(self, "calls", self.__dict__.get("calls", 0) + 1)
        if self.calls == self.__dict__["crash_at"]:
            raise RuntimeError("crash")
        return super().sample(batch, generator, dtype)


def test_resume_after_a_crash_is_bit_exact(tmp_path):
    path = tmp_path / "run.safetensors"
    task = _CrashingTask(**TASK.to_dict())
    object.__setattr__(task, "crash_at", 7)
    with pytest.raises(RuntimeError, match="crash"):
        train(path, MODEL, task, _cfg(10, every=4), progress=False)
    assert read_checkpoint(path)[1]["meta"]["step"] == 4  # the last periodic checkpoint
    resumed = train(path, MODEL, TASK, _cfg(10, every=4), progress=False)
    straight = train(tmp_path / "straight.safetensors", MODEL, TASK, _cfg(10, every=4), progress=False)
    a, b = _params(straight), _params(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    hist_a = read_checkpoint(tmp_path / "straight.safetensors")[1]["meta"]
    hist_b = read_checkpoint(path)[1]["meta"]
    assert hist_a["loss_ema"] == hist_b["loss_ema"] and hist_a["eval"] == hist_b["eval"]


class _InterruptingTask(LinRegTask):
    """Sends SIGINT to the process while sampling the batch of step 5."""

    def sample(self, batch, generator=None, dtype=torch.float32):
        object.__setattr__(self, "calls", self.__dict__.get("calls", 0) + 1)
        if self.calls == 5:
            signal.raise_signal(signal.SIGINT)
        return super().sample(batch, generator, dtype)


def test_ctrl_c_saves_a_consistent_checkpoint_and_resumes_bit_exact(tmp_path):
    path = tmp_path / "run.safetensors"
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a backgrounded shell
    task = _InterruptingTask(**TASK.to_dict())
    with pytest.raises(KeyboardInterrupt):
        train(path, MODEL, task, _cfg(10, every=100), progress=False)
    _, doc, _ = read_checkpoint(path)
    assert doc["meta"]["step"] == 5  # the step in flight finished, then the run stopped
    resumed = train(path, MODEL, TASK, _cfg(10, every=100), progress=False)
    straight = train(tmp_path / "straight.safetensors", MODEL, TASK, _cfg(10, every=100), progress=False)
    a, b = _params(straight), _params(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert signal.getsignal(signal.SIGINT) is before  # the trainer's handler is gone


def test_resume_refuses_another_recipe(tmp_path):
    path = tmp_path / "r.safetensors"
    train(path, MODEL, TASK, _cfg(3), progress=False)
    with pytest.raises(tp.FileFormatError, match="another training recipe"):
        train(path, MODEL, LinRegTask(dim=2, n_context=5), _cfg(3), progress=False)


def test_checkpoint_round_trip_and_corruption(tmp_path, small_model):
    path = tmp_path / "m.safetensors"
    tp.save_model(small_model, path, meta={"note": "x"})
    back = tp.load_model(path)
    assert back.meta == {"note": "x"} and back.config == small_model.config
    assert all(torch.equal(p, q) for p, q in zip(small_model.parameters(), back.parameters()))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(tp.FileFormatError, match="truncated or corrupt"):
        tp.load_model(path)
    patch = tp.token_patch(small_model, torch.randn(1, 3, 5, dtype=torch.float64))
    tp.save_patch(patch, tmp_path / "p.safetensors")
    with pytest.raises(tp.FileFormatError, match="holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1'"):
        tp.load_model(tmp_path / "p.safetensors")


def test_bad_training_settings_are_refused():
    with pytest.raises(tp.InputError, match="TrainConfig.steps must be an integer >= 1, got 0"):
        TrainConfig(steps=0)
    with pytest.raises(tp.InputError, match="TrainConfig.min_lr_ratio must be a number >= 0"):
        TrainConfig(min_lr_ratio=-0.1)
    with pytest.raises(tp.InputError, match="TrainConfig.grad_clip must be a number > 0"):
        TrainConfig(grad_clip=True)


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)


def test_task_and_baselines():
    batch = LinRegTask(dim=3, n_context=8, noise=0.0).sample(5, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert batch.tokens.shape == (5, 9, 4) and torch.all(batch.tokens[:, -1, -1] == 0)
    torch.testing.assert_close(batch.tokens[:, :-1, -1], torch.einsum("btd,bd->bt", batch.x[:, :-1], batch.w))
    ls = least_squares(batch.x[:, :-1], batch.y[:, :-1], batch.x[:, -1])
    torch.testing.assert_close(ls, batch.target)  # noise-free, n > D: exact
    r = ridge(batch.x[:, :-1], batch.y[:, :-1], batch.x[:, -1], lam=1e3)
    assert r.abs().max() < ls.abs().max()  # heavy ridge shrinks to zero


def test_the_shipped_recipe_learns_in_context_quickly(tmp_path):
    """`tokenpatch train` with the shipped model and task, cut to 300 steps (~1 minute on 2 cores),
    already beats the 20%-of-zero-predictor bar: the checkpoint is retrainable here."""
    from tokenpatch.workbench.train.linreg import DEFAULT_MODEL, DEFAULT_TASK, DEFAULT_TRAIN

    cfg = TrainConfig(**{**DEFAULT_TRAIN.to_dict(), "steps": 300, "checkpoint_every": 1000, "eval_tasks": 1024})
    model = train(tmp_path / "r.safetensors", DEFAULT_MODEL, DEFAULT_TASK, cfg, progress=False)
    ev = read_checkpoint(tmp_path / "r.safetensors")[1]["meta"]["eval"]
    assert model.config.n_layers == 10 and ev["mse_model"] <= 0.2 * ev["mse_zero"], ev
