"""Where outputs go, without torch (the command line checks its paths before torch loads): a new
file written durably, and whether a folder is new. ``files.write_file`` (patch and model files),
``lora.save_lora`` (adapter folders) and the command line's checks share them."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_new", "not_a_new_folder"]


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (never an existing file) holding ``data``, on disk when this returns (fsync)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the usual mode: the OS applies the umask
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def not_a_new_folder(folder: Path) -> str | None:
    """Why ``folder`` is not a new or empty folder (``"a file"``, ``"a folder that is not empty"``), or None."""
    if folder.exists() and not folder.is_dir():
        return "a file"
    return "a folder that is not empty" if folder.is_dir() and any(folder.iterdir()) else None
