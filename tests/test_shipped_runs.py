"""The trained runs shipped for ``tokenpatch reproduce`` are what their trainers' default recipes give:
each is read back as a finished run (the trainer checks its recipe and trains nothing), so a change of
a recipe that leaves them stale fails here, not silently in the report."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tokenpatch.models.icl import read_checkpoint
from tokenpatch.tasks.markov import MarkovTask
from tokenpatch.workbench.report.markov import REDUCED
from tokenpatch.workbench.train.lm import LMTrain, train_lm
from tokenpatch.workbench.train.markov import MarkovTrain, train_markov
from tokenpatch.workbench.train.shipped import SHIPPED_RUNS, place_shipped


def test_the_small_lm_is_the_default_recipe_finished(tmp_path):
    path = tmp_path / "small-lm.safetensors"
    assert place_shipped("small-lm", path) and not place_shipped("small-lm", path)  # never overwrites
    t0 = time.perf_counter()
    train_lm(path, progress=False)  # reads it back: the recipe matches, nothing left to train
    assert time.perf_counter() - t0 < 20
    assert read_checkpoint(path)[1]["meta"]["step"] == LMTrain().steps


@pytest.mark.parametrize("chains", REDUCED["chains"])
def test_the_markov_runs_are_the_reduced_sweep_finished(tmp_path, chains):
    seed = REDUCED["seeds"][0]
    run = tmp_path / f"K{chains:05d}-s{seed}"
    assert f"markov-{run.name}" in SHIPPED_RUNS
    place_shipped(f"markov-{run.name}", run / "model.safetensors")
    cfg = MarkovTrain(steps=REDUCED["steps"], seed=seed)
    _, history = train_markov(
        run, replace(MarkovTask(), chains=chains, seed=seed), cfg=cfg, progress=False, snapshots=False
    )
    assert history[-1]["step"] == REDUCED["steps"]
    assert not list(run.glob("step-*.safetensors"))  # read back, not trained
