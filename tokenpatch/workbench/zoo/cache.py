"""A folder built once, atomically, and trusted only while its marker matches what it was made from.

``ensure(folder, expected, build)`` is the whole protocol: ``build`` writes into a fresh temporary
sibling of ``folder``; a JSON marker (``expected`` plus the size of every file built) is written
last; the sibling is renamed onto ``folder``. A reader trusts ``folder`` only if its marker matches
``expected`` and every listed file has its recorded size, so an interrupted build, a changed source
or a truncated file makes the next call rebuild instead of trusting it. Concurrent builders are
safe: a valid folder installed by another process first is kept. ``pretrained`` uses it for the
float32 copies of real models (``expected``: the source package, files and library versions).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenpatch.errors import InputError

__all__ = ["MARKER", "STALE_S", "ensure", "matches", "write_marker"]

MARKER = "tokenpatch-cache.json"
STALE_S = 3600.0  # a temporary sibling folder older than this belongs to a build that was killed


def write_marker(folder: Path, expected: dict[str, Any]) -> None:
    """Stamp ``folder`` with ``expected`` plus the size of every file in it (written last)."""
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}
    (folder / MARKER).write_text(json.dumps({**expected, "cached_files": sizes}, indent=1) + "\n")


def matches(folder: Path, expected: dict[str, Any]) -> bool:
    """True if ``folder`` holds a complete cache made from exactly what ``expected`` describes.

    Missing, unreadable or mismatching marker, or a listed file missing or of another size: False,
    and the caller rebuilds. The marker is written last into a folder that is renamed into place
    only when complete, so a marker that matches means the folder is whole.
    """
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or {k: marker.get(k) for k in expected} != expected:
        return False
    sizes = marker.get("cached_files")
    if not isinstance(sizes, dict) or not any(str(file).endswith(".safetensors") for file in sizes):
        return False
    for file, size in sizes.items():
        try:
            if (folder / file).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _remove_stale_siblings(folder: Path) -> None:
    """Delete temporary siblings (``.<name>.tmp-*``, ``.<name>.old-*``) left by loads killed over an hour ago."""
    now = time.time()
    for prefix in (f".{folder.name}.tmp-", f".{folder.name}.old-"):
        for path in folder.parent.glob(prefix + "*"):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > STALE_S:
                    shutil.rmtree(path, ignore_errors=True)


def _sibling(folder: Path, kind: str) -> Path:
    return folder.with_name(f".{folder.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def ensure(folder: Path, expected: dict[str, Any], build: Callable[[Path], None]) -> bool:
    """Make ``folder`` a cache matching ``expected``; return True if it had to be built.

    ``build(tmp)`` writes the cache files into the empty folder ``tmp``, a sibling of ``folder``.
    The marker is then written and ``tmp`` renamed onto ``folder`` (an old, untrusted ``folder`` is
    moved aside first and deleted after). If ``build`` fails or the process dies, ``folder`` is
    unchanged and the next load starts over; if another process installed a valid cache meanwhile,
    that one is kept.
    """
    if matches(folder, expected):
        return False
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_siblings(folder)
        tmp = _sibling(folder, "tmp")
        tmp.mkdir()
    except OSError as exc:
        raise InputError(
            f"cannot write the tokenpatch cache in {folder.parent} ({exc.strerror or exc}); "
            "pass cache_dir= or set TOKENPATCH_CACHE to a writable folder"
        ) from exc
    try:
        build(tmp)
        write_marker(tmp, expected)
        _install(tmp, folder, expected)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def _install(tmp: Path, folder: Path, expected: dict[str, Any]) -> None:
    """Rename the complete cache ``tmp`` onto ``folder``, replacing an untrusted old one."""
    old = None
    if folder.exists() or folder.is_symlink():
        if matches(folder, expected):  # another process finished first: keep theirs
            return
        old = _sibling(folder, "old")
        os.replace(folder, old)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not matches(folder, expected):  # lost a race to a valid cache: fine; anything else: raise
            raise
    finally:
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
