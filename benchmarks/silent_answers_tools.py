"""What ``silent_answers.py`` and ``silent_answers_cli.py`` share: the scratch folders, the tiny inputs, and
how a measurement becomes a table cell (an error above ``TOL`` or an unexpected refusal is NOT FIXED)."""

from __future__ import annotations

import math
import re
import tempfile
import warnings
from pathlib import Path

import torch

import tokenpatch as tp

TOL, NOT_FIXED, LM = 1e-12, "**NOT FIXED**", "smollm2-135m"
SCRATCH = Path(
    tempfile.gettempdir()
)  # silent_answers.main() makes a folder of its own (use_scratch), removed at the end


def use_scratch(path: Path) -> None:
    """Make every ``folder`` under ``path`` from now on."""
    global SCRATCH
    SCRATCH = path


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 101, (batch, length), generator=torch.Generator().manual_seed(seed))


def folder(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=SCRATCH))


def gap(a, b) -> float:
    """The largest difference of two tensors, or of two patches' dense deltas (inf if their keys differ)."""
    if isinstance(a, torch.Tensor):
        return float((a.double() - b.double()).abs().max())
    a, b = a.dense(), b.dense()
    return max(gap(a[k], b[k]) for k in a) if a.keys() == b.keys() else math.inf


def refused(fn, match: str) -> str:
    """The refusal ``fn()`` gives, in one line; NOT FIXED if it runs, raises anything but a tokenpatch
    error, in more than one line, or without ``match``."""
    try:
        fn()
    except Exception as exc:  # what it raises is the measurement
        text = f"{type(exc).__name__}: {str(exc)[:120]}".replace("\n", "\\n")
        good = isinstance(exc, tp.TokenpatchError) and "\n" not in str(exc) and re.search(match, str(exc))
        return text if good else f"{NOT_FIXED} {text}"
    return f"{NOT_FIXED} ran without an error"


def cell(values: dict) -> str:
    """``name value; ...``: errors as ``.1e`` (NOT FIXED above 1e-12, or NaN), texts as they are."""
    parts, bad = [], False
    for name, v in values.items():
        if isinstance(v, float):
            bad, v = bad or not v <= TOL, f"{v:.1e}"
        else:
            bad, v = bad or NOT_FIXED in v, v.replace(NOT_FIXED, "").strip()
        parts.append(f"{name} {v}" if name else v)
    return ((f"{NOT_FIXED}: " if bad else "") + "; ".join(parts)).replace("|", "\\|")


def quiet_thought(model, prompt, calibration, **kw):
    with warnings.catch_warnings():  # few calibration queries: rank-deficient, as in the tests
        warnings.simplefilter("ignore", tp.ThoughtWarning)
        return tp.thought_patch(model, prompt, calibration, progress=False, **kw)
