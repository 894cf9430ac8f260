"""One section of the report: what every section module returns and ``reproduce`` assembles; and the
record a long run keeps of each finished part (a report section, a task of the compression table), so
that an interrupted run resumes: ``write_part`` saves the part's data beside what it was run with as
soon as it finishes, ``read_part`` gives it back on a rerun when it was run with the same inputs."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Section", "read_part", "write_part", "part_inputs", "differences", "code_digest"]


@dataclass
class Section:
    """``key``: the section's snake_case key in ``results.json``; ``body``: its markdown;
    ``figures``: the PNG files it wrote; ``data``: the numbers of its figures and tables."""

    key: str
    title: str
    body: str
    figures: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, keys as strings): what a record compares."""
    return json.loads(json.dumps(value))


def write_part(path: Path, inputs: dict, data: dict) -> None:
    """Save a finished part's ``data`` with the ``inputs`` it was run with, atomically (a temporary
    file renamed onto ``path``: an interrupted write leaves the old record or none, never half of one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(json.dumps({"inputs": _plain(inputs), "data": data}, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def part_inputs(path: Path) -> dict | None:
    """The inputs a saved part was run with; None if there is no readable record at ``path``."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record.get("inputs") if isinstance(record, dict) and isinstance(record.get("data"), dict) else None


def read_part(path: Path, inputs: dict) -> dict | None:
    """The data saved at ``path`` if it was run with ``inputs``; None if there is none or it was run
    with other inputs (the caller runs the part again)."""
    if part_inputs(path) != _plain(inputs):
        return None
    return json.loads(Path(path).read_text())["data"]


def differences(saved: dict, inputs: dict) -> str:
    """How ``inputs`` differ from a saved part's, in words: ``"shots 10, not 5; seed 0, not 1"``."""
    now = _plain(inputs)
    keys = [k for k in {**saved, **now} if saved.get(k) != now.get(k)]
    return "; ".join(f"{k} {saved.get(k)!r}, not {now.get(k)!r}" for k in keys)


@functools.cache
def code_digest() -> str:
    """A digest of tokenpatch's own source (every ``.py`` file of the package, by path and content): a
    part recorded by other code, even under the same version number, runs again."""
    root = Path(__file__).resolve().parents[2]  # the tokenpatch/ folder
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
