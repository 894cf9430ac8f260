"""Digests of a cache folder's files: recorded when the folder is built, checked before it is read.

``record(folder)`` returns, for every file of ``folder`` (dot-files and the marker aside), its
CRC-32; for a safetensors file also the CRC-32 of its header and, per tensor, that of the
tensor's bytes and of a sample of them (16 windows of 4 KiB spread over the tensor). ``check``
compares a folder with such a record and says what differs, or None:

- ``"full"`` (the default of ``load_pretrained``): every byte of every file is read (SmolLM2's
  538 MB in 0.2 s on a quiet core, 0.6 s on a busy one; sha256 takes 0.45 / 1.3 s, blake2b 1.1 s).
  Any change of up to 32 bits in a row is caught for sure, any other with odds of 1 - 2**-32.
- ``"sample"``: the small files and every safetensors header in full, and the sampled windows of
  every tensor (about 64 KiB per tensor; 0.07 s). A damaged run of bytes is caught if it reaches
  a window (half of a tensor zeroed always is); a few changed values elsewhere are not.

The record guards against accidental damage (a bad disk, a stray write, a truncating copy), not
against someone who edits the folder on purpose: the marker sits next to the files and could be
rewritten too. That is why a checksum is enough and a cryptographic hash would only cost time.

Files listed in the record must be there, and no file outside it (transformers reads some
optional files, e.g. a ``model.safetensors.index.json``, when they appear). A successful check is
remembered for the life of the process, keyed by each file's size, mtime, ctime and inode (any
write or ``utime`` changes the ctime), so a second load of an unchanged folder reads nothing again.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any

from tokenpatch.errors import InputError

__all__ = ["MODES", "ENV", "resolve_mode", "record", "check"]

MODES = ("full", "sample")
ENV = "TOKENPATCH_VERIFY"  # the default mode when ``verify=`` is not given
WINDOWS, WINDOW = 16, 4096  # the sample of one tensor
_ALGO = "crc32"
_CHUNK = 1 << 22  # bytes read at a time
_SETTLED_S = 2.0  # a file changed this recently is checked again next time (file times are coarse)
_verified: set[tuple] = set()


def resolve_mode(verify: Any) -> str:
    """``verify`` if it is a mode; None: ``$TOKENPATCH_VERIFY`` or ``"full"``. Anything else: ``InputError``."""
    if verify is None:
        env = os.environ.get(ENV, "")
        if env and env not in MODES:
            raise InputError(f"{ENV} must be 'full' or 'sample', not {env!r}")
        return env or "full"
    if not isinstance(verify, str) or verify not in MODES:
        raise InputError(f"verify must be 'full' or 'sample', not {verify!r}")
    return verify


def _files(folder: Path, marker: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != marker)


def _hex(crc: int) -> str:
    return f"{crc:08x}"


class _Bytes:
    """A file read by byte ranges (plain reads, not a memory map: a file cut short meanwhile is an error, not SIGBUS)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("rb", buffering=0)
        self.size = os.fstat(self._file.fileno()).st_size
        self._buffer = bytearray(_CHUNK)

    def __enter__(self) -> _Bytes:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def read(self, begin: int, end: int) -> bytes:
        self._file.seek(begin)
        data = self._file.read(end - begin)
        if len(data) != end - begin:
            raise OSError(f"{Path(self._file.name).name} is shorter than it was")
        return data

    def crc(self, begin: int, end: int, crc: int = 0) -> int:
        """The CRC-32 of bytes ``begin:end``, continuing ``crc``."""
        self._file.seek(begin)
        view, left = memoryview(self._buffer), end - begin
        while left > 0:
            n = self._file.readinto(view[: min(left, _CHUNK)])
            if not n:
                raise OSError(f"{Path(self._file.name).name} is shorter than it was")
            crc, left = zlib.crc32(view[:n], crc), left - n  # zlib releases the GIL for long buffers
        return crc

    def digest(self, begin: int, end: int) -> str:
        return _hex(self.crc(begin, end))

    def sample(self, begin: int, end: int) -> str:
        """The CRC-32 of ``WINDOWS`` windows of ``WINDOW`` bytes spread over ``begin:end`` (all of it if short)."""
        length, crc = end - begin, 0
        if length <= WINDOWS * WINDOW:
            return self.digest(begin, end)
        step = (length - WINDOW) // (WINDOWS - 1)
        for i in range(WINDOWS):
            crc = self.crc(begin + i * step, begin + i * step + WINDOW, crc)
        return _hex(crc)

    def tensors(self) -> tuple[int, dict[str, tuple[int, int]]] | None:
        """The header length and each tensor's absolute byte range, if this is a safetensors file; else None."""
        if self.size < 8:
            return None
        (n,) = struct.unpack("<Q", self.read(0, 8))
        if 8 + n > self.size:
            return None
        try:
            header = json.loads(self.read(8, 8 + n))
            ranges = {
                name: (8 + n + int(info["data_offsets"][0]), 8 + n + int(info["data_offsets"][1]))
                for name, info in header.items()
                if name != "__metadata__"
            }
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None
        if any(not 8 + n <= a <= b <= self.size for a, b in ranges.values()):
            return None
        return 8 + n, ranges


def record(folder: Path, marker: str) -> dict[str, Any]:
    """The digests of every file in ``folder`` (but ``marker`` and dot-files), to be checked by ``check``."""
    out: dict[str, Any] = {}
    for name in _files(folder, marker):
        with _Bytes(folder / name) as f:
            entry: dict[str, Any] = {_ALGO: f.digest(0, f.size)}
            parsed = f.tensors() if name.endswith(".safetensors") else None
            if parsed is not None:
                head, ranges = parsed
                entry["header"] = f.digest(0, head)
                entry["tensors"] = {
                    t: {_ALGO: f.digest(a, b), "sample": f.sample(a, b)} for t, (a, b) in ranges.items()
                }
        out[name] = entry
    return out


def _check_safetensors(path: Path, entry: dict[str, Any], mode: str) -> str | None:
    tensors = entry["tensors"]
    with _Bytes(path) as f:
        parsed = f.tensors()
        if parsed is None or f.digest(0, parsed[0]) != entry.get("header"):
            return f"{path.name}: its header does not match its digest"
        ranges = parsed[1]
        if sorted(ranges) != sorted(tensors):
            return f"{path.name}: its tensors are not the ones recorded"
        if mode == "full" and f.digest(0, f.size) == entry.get(_ALGO):
            return None
        key = _ALGO if mode == "full" else "sample"  # full and wrong: find the tensor to name it
        for t, (a, b) in ranges.items():
            if (f.digest(a, b) if key == _ALGO else f.sample(a, b)) != tensors[t].get(key):
                return f"{path.name}: tensor {t} does not match its digest"
    return None if mode == "sample" else f"{path.name} does not match its digest"


def _file_digest(path: Path) -> str:
    with _Bytes(path) as f:
        return f.digest(0, f.size)


def _stamp(folder: Path, names: list[str]) -> tuple | None:
    """What identifies the current contents of ``names``, or None if one changed in the last seconds."""
    stamp, now = [], time.time_ns()
    for name in names:
        st = (folder / name).stat()
        if now - max(st.st_mtime_ns, st.st_ctime_ns) < _SETTLED_S * 1e9:
            return None
        stamp.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    return tuple(stamp)


def check(folder: Path, digests: Any, marker: str, mode: str = "full") -> str | None:
    """What in ``folder`` differs from ``digests`` (from ``record``), in a few words; None if nothing does.

    ``mode`` is ``"full"`` or ``"sample"`` (see the module). Unreadable files count as differing.
    """
    if not isinstance(digests, dict) or not digests:
        return "its marker records no digests"
    try:
        names = _files(folder, marker)
        if names != sorted(digests):
            extra, missing = sorted(set(names) - set(digests)), sorted(set(digests) - set(names))
            return f"{missing[0]} is missing" if missing else f"{extra[0]} is not part of it"
        stamp = _stamp(folder, names)
        key = (str(folder.resolve()), json.dumps(digests, sort_keys=True), stamp)
        if stamp is not None and ((*key, "full") in _verified or (*key, mode) in _verified):
            return None
        for name in names:
            entry = digests[name]
            if not isinstance(entry, dict):
                return f"its marker has no digest of {name}"
            if isinstance(entry.get("tensors"), dict):
                problem = _check_safetensors(folder / name, entry, mode)
            else:
                problem = (
                    None if _file_digest(folder / name) == entry.get(_ALGO) else f"{name} does not match its digest"
                )
            if problem:
                return problem
    except OSError as exc:
        return f"a file cannot be read ({exc.strerror or exc})"
    except (AttributeError, TypeError, KeyError):  # a marker edited by hand
        return "its marker's digests are malformed"
    if stamp is not None and stamp == _stamp(folder, names):
        _verified.add((*key, mode))
    return None
