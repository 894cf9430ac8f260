"""Trained runs shipped with tokenpatch (``tokenpatch/models/data/``), so that ``tokenpatch reproduce``
reads them instead of training them again on every run: the small LM of the induction section
(``train_lm``'s default recipe, 3000 steps) and the reduced Markov sweep (``markov.REDUCED``: K = 2,
16, 128, 1024, seed 0, 2000 steps). Each is the file its trainer writes (weights, optimizer and
sampler state, the recipe and the history), so the trainer reads it back as a finished run, checks
its recipe, and would resume it bit for bit. ``tokenpatch reproduce --full`` trains them afresh.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

__all__ = ["SHIPPED_RUNS", "place_shipped"]

SHIPPED_RUNS = {
    "small-lm": "small-lm.safetensors",
    **{f"markov-K{k:05d}-s0": f"markov-K{k:05d}-s0.safetensors" for k in (2, 16, 128, 1024)},
}


def place_shipped(name: str, dest: str | Path) -> bool:
    """Copy the shipped run ``name`` (``SHIPPED_RUNS``) to ``dest`` unless a file is there already (an
    earlier or a user's run is never overwritten); True if it was copied."""
    dest = Path(dest)
    if dest.exists():
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with resources.as_file(resources.files("tokenpatch.models") / "data" / SHIPPED_RUNS[name]) as src:
        shutil.copyfile(src, dest)
    return True
