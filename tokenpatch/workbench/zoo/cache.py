"""A folder built once, atomically, and trusted only while its marker matches what it was made from.

``ensure(folder, expected, build)`` is the whole protocol: ``build`` writes into a fresh temporary
sibling of ``folder``; a JSON marker (``expected`` plus the size and digests of every file built,
see ``verify``) is written last; the sibling is renamed onto ``folder``. A reader trusts ``folder``
only if its marker matches ``expected``, it holds exactly the listed files, and each has its
recorded size and digests (all bytes hashed, or a sample: ``verify``), so an interrupted build, a
changed source or a damaged file makes the next call rebuild instead of trusting it. Concurrent
builders are safe: a valid folder installed by another process first is kept. A builder holds a
lock on a file in its temporary folder while it writes; every call removes the temporary folders
whose lock is free (their builder was killed) or that are over an hour old. ``pretrained`` uses it
for the float32 copies of real models (``expected``: the source package, files and library versions).
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
from tokenpatch.workbench.zoo import verify as digests

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows: temporary folders are only removed by age)
    fcntl = None

__all__ = ["MARKER", "STALE", "STALE_S", "LOCK", "ensure", "matches", "problem", "write_marker"]

MARKER = "tokenpatch-cache.json"
LOCK = ".building.lock"  # held by the builder of a temporary folder while it writes
STALE_S = 3600.0  # a temporary sibling folder older than this belongs to a build that was killed
STALE = "it is not a complete cache of this source"  # ``problem``'s answer for a missing or other marker


def write_marker(folder: Path, expected: dict[str, Any]) -> None:
    """Stamp ``folder`` with ``expected`` plus the size and digests of every file in it but dot-files (written last)."""
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER and not p.name.startswith(".")]
    sizes = {p.name: p.stat().st_size for p in files}
    marker = {**expected, "cached_files": sizes, "digests": digests.record(folder, MARKER)}
    (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def problem(folder: Path, expected: dict[str, Any], verify: str = "full") -> str | None:
    """Why ``folder`` is not a trustworthy cache made from ``expected``, or None if it is.

    ``STALE`` if the marker is missing, unreadable or made from something else (an interrupted
    build, another source: a rebuild is routine); otherwise the damage found, in a few words: a
    listed file missing or of another size, a file too many, or a digest that differs (``verify``:
    ``"full"`` hashes every byte, ``"sample"`` a sample of every tensor; see ``verify``).
    """
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return STALE
    if not isinstance(marker, dict) or {k: marker.get(k) for k in expected} != expected:
        return STALE
    sizes = marker.get("cached_files")
    if not isinstance(sizes, dict) or not any(str(file).endswith(".safetensors") for file in sizes):
        return STALE
    for file, size in sizes.items():
        try:
            if (folder / file).stat().st_size != size:
                return f"{file} has {(folder / file).stat().st_size} bytes, not {size}"
        except OSError:
            return f"{file} is missing"
    return digests.check(folder, marker.get("digests"), MARKER, verify)


def matches(folder: Path, expected: dict[str, Any], verify: str = "full") -> bool:
    """True if ``folder`` holds a complete, undamaged cache made from exactly what ``expected`` describes."""
    return problem(folder, expected, verify) is None


def _abandoned(path: Path, now: float) -> bool:
    """Whether the temporary folder ``path`` is no builder's: its lock is free, or it is over an hour old."""
    if now - path.stat().st_mtime > STALE_S:
        return True
    if fcntl is None:  # pragma: no cover
        return False
    try:
        fd = os.open(path / LOCK, os.O_RDWR)
    except OSError:  # no lock yet: a builder may be starting; the age rule takes it later
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its builder is alive
        return False
    finally:
        os.close(fd)
    return True


def _remove_stale_siblings(folder: Path) -> None:
    """Delete the temporary siblings of ``folder`` that no live process uses.

    ``.<name>.tmp-*``: a build's folder, removed once its lock is free (the builder died) or after
    an hour. ``.<name>.old-*``: a replaced cache moved aside, garbage from the moment it is renamed.
    """
    now = time.time()
    with contextlib.suppress(OSError):
        for path in folder.parent.glob(f".{folder.name}.tmp-*"):
            with contextlib.suppress(OSError):
                if _abandoned(path, now):
                    shutil.rmtree(path, ignore_errors=True)
        for path in folder.parent.glob(f".{folder.name}.old-*"):
            shutil.rmtree(path, ignore_errors=True)


def _hold_lock(tmp: Path) -> int:
    """Lock a file in ``tmp`` for as long as the returned descriptor is open (under its final name only once held)."""
    partial = tmp / f"{LOCK}-{secrets.token_hex(4)}"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(partial, tmp / LOCK)
    return fd


def _sibling(folder: Path, kind: str) -> Path:
    return folder.with_name(f".{folder.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def ensure(
    folder: Path,
    expected: dict[str, Any],
    build: Callable[[Path], None],
    verify: str = "full",
    damaged: Callable[[str], None] | None = None,
) -> bool:
    """Make ``folder`` a cache matching ``expected``; return True if it had to be built.

    ``build(tmp)`` writes the cache files into the empty folder ``tmp``, a sibling of ``folder``.
    The marker is then written and ``tmp`` renamed onto ``folder`` (an old, untrusted ``folder`` is
    moved aside first and deleted after). If ``build`` fails or the process dies, ``folder`` is
    unchanged and the next load starts over; if another process installed a valid cache meanwhile,
    that one is kept. ``verify`` is the check of an existing ``folder`` (``problem``); when its
    marker matches but the check finds damage, ``damaged(why)`` is called before rebuilding.
    Temporary folders of killed builds are removed on every call.
    """
    _remove_stale_siblings(folder)
    why = problem(folder, expected, verify)
    if why is None:
        return False
    if why != STALE and damaged is not None:
        damaged(why)
    tmp = _sibling(folder, "tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        lock = _hold_lock(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        damage = "" if why == STALE else f"the cached copy in {folder} is damaged ({why}) and "
        raise InputError(
            f"{damage}cannot write the tokenpatch cache in {folder.parent} ({exc.strerror or exc}); "
            "pass cache_dir= or set TOKENPATCH_CACHE to a writable folder"
        ) from exc
    try:
        build(tmp)
        write_marker(tmp, expected)
        (tmp / LOCK).unlink(missing_ok=True)  # not part of the cache; the lock stays held until the end
        _install(tmp, folder, expected, verify)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return True


def _install(tmp: Path, folder: Path, expected: dict[str, Any], verify: str) -> None:
    """Rename the complete cache ``tmp`` onto ``folder``, replacing an untrusted old one."""
    old = None
    if folder.exists() or folder.is_symlink():
        if matches(folder, expected, verify):  # another process finished first: keep theirs
            return
        old = _sibling(folder, "old")
        os.replace(folder, old)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not matches(folder, expected, verify):  # lost a race to a valid cache: fine; anything else: raise
            raise
    finally:
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
