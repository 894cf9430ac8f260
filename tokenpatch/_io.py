"""Files and fingerprints: safetensors + JSON metadata + a checksum. Never pickle.

Every file tokenpatch writes is a plain safetensors file whose header metadata holds one JSON
document under the key ``"tokenpatch"``::

    {"format": "<kind>/<version>", "sha256": "<digest of every tensor>", ...caller's fields}

The checksum covers names, dtypes, shapes and bytes of all tensors and the rest of the metadata,
so a truncated file fails to parse and an edited one fails the checksum; both raise ``FileFormatError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from .errors import FileFormatError

__all__ = ["write_file", "read_file", "tensor_digest", "fingerprint"]

_META_KEY = "tokenpatch"


def _raw_bytes(t: Tensor):
    """The tensor's bytes as a buffer (no copy for a contiguous CPU tensor)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_digest(tensors: dict[str, Tensor], doc: dict | None = None) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in sorted name order, then over
    the canonical JSON of ``doc`` (the file's metadata without its checksum)."""
    h = hashlib.sha256()
    if doc is not None:
        h.update(json.dumps(doc, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_raw_bytes(t))
    return h.hexdigest()


def write_file(path: str | os.PathLike, tensors: dict[str, Tensor], kind: str, meta: dict) -> Path:
    """Write ``tensors`` and ``meta`` atomically (temp file + rename): an interrupted write
    never leaves a half-written file at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    doc = {"format": kind, **meta}
    doc["sha256"] = tensor_digest(tensors, doc)
    data = st_save(tensors, metadata={_META_KEY: json.dumps(doc)})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; done once, at import
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def read_file(path: str | os.PathLike, kind: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a file written by ``write_file`` with the same ``kind``; verify its checksum."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    data = path.read_bytes()
    try:
        if len(data) < 8:
            raise ValueError(f"{len(data)} bytes, shorter than a safetensors header")
        n = int.from_bytes(data[:8], "little")
        if n > len(data) - 8:
            raise ValueError(f"header claims {n} bytes but the file has {len(data) - 8} after it")
        header = json.loads(data[8 : 8 + n])
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error type; json raises ValueError
        raise FileFormatError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {exc}"
        ) from exc
    raw = (header.get("__metadata__") or {}).get(_META_KEY)
    if raw is None:
        raise FileFormatError(f"{path} is a safetensors file but not one written by tokenpatch")
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise FileFormatError(f"{path}: tokenpatch metadata is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != kind:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise FileFormatError(f"{path} holds a {found!r}, not a {kind!r}")
    unsigned = {k: v for k, v in meta.items() if k != "sha256"}
    if meta.get("sha256") != tensor_digest(tensors, unsigned):
        raise FileFormatError(
            f"{path}: checksum mismatch, its tensors or metadata changed after it was written (edited or corrupt)"
        )
    return tensors, meta


# --------------------------------------------------------------------------- model fingerprints

_FINGERPRINTS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def _version(p: Tensor) -> int:
    try:
        return p._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def fingerprint(model: nn.Module, cached: bool = True) -> str:
    """A digest (sha256) of the model's parameter names, shapes and values (cast to float32).

    A patch is exact only for the weights it was computed from, so patches record it and
    ``apply`` / ``functional_call`` / ``verify`` / ``load(path, model)`` check it. Casting to
    float32 makes ``model.double()`` keep the fingerprint of the float32 model it came from (two
    float64 models that differ only below float32 precision share one).

    Hashing every weight on every call would cost more than a patch, so with ``cached=True`` the
    digest is reused while each parameter keeps its identity, storage, torch version counter
    (bumped by in-place ops, optimizer steps, ``load_state_dict``) and the sum of its values
    (which catches writes through ``p.data``, invisible to the counter). Only an edit through
    ``p.data`` that leaves every parameter's float sum unchanged escapes; ``cached=False`` (what
    ``load(path, model)`` uses) always re-hashes.
    """
    params = list(model.named_parameters())
    with torch.no_grad():
        key = tuple((name, id(p), p.data_ptr(), _version(p), float(p.sum())) for name, p in params)
    hit = _FINGERPRINTS.get(model)
    if cached and hit is not None and hit[0] == key:
        return hit[1]
    h = hashlib.sha256()
    for name, p in params:
        h.update(f"{name}|{tuple(p.shape)}|".encode())
        h.update(_raw_bytes(p.detach().to(torch.float32)))
    digest = h.hexdigest()[:32]
    _FINGERPRINTS[model] = (key, digest)
    return digest
