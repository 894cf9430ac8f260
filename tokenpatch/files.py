"""Files and fingerprints: safetensors + JSON metadata + a checksum. Never pickle.

Every file tokenpatch writes is a plain safetensors file whose header metadata holds one JSON
document under the key ``"tokenpatch"``::

    {"format": "<kind>/<version>", "sha256": "<digest of every tensor>", ...caller's fields}

The checksum covers names, dtypes, shapes and bytes of all tensors and the rest of the metadata,
so a truncated file fails to parse and an edited one fails the checksum; both raise ``FileFormatError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from tokenpatch.errors import FileFormatError, InputError
from tokenpatch.file_header import META_KEY, read_header
from tokenpatch.offload import named_values
from tokenpatch.paths import write_new
from tokenpatch.per_model import PerModel

__all__ = ["write_file", "read_file", "tensor_digest", "fingerprint", "config_record", "check_config", "versions"]


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
    named = os.fspath(path)
    path = Path(path)
    if not named or named.endswith(("/", os.sep)) or path.name in ("", ".", "..") or path.is_dir():
        what = "an empty path" if not named else "a folder, not a file"
        raise InputError(f"cannot write to {named!r}: {what}; pass a file path such as patch.safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    doc = {"format": kind, **meta}
    doc["sha256"] = tensor_digest(tensors, doc)
    data = st_save(tensors, metadata={META_KEY: json.dumps(doc)})
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        write_new(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_file(path: str | os.PathLike, kind: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a file written by ``write_file`` with the same ``kind``; verify its checksum. The path, the
    header and the document are checked by ``file_header.read_header`` first (the same checks and
    words as the command line's), then the tensors are read."""
    path = Path(path)
    _, meta = read_header(path, kind)
    try:
        tensors = st_load(path.read_bytes())
    except Exception as exc:  # safetensors raises its own error type
        raise FileFormatError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc
    unsigned = {k: v for k, v in meta.items() if k != "sha256"}
    if meta.get("sha256") != tensor_digest(tensors, unsigned):
        raise FileFormatError(
            f"{path}: checksum mismatch, its tensors or metadata changed after it was written (edited or corrupt)"
        )
    return tensors, meta


# --------------------------------------------------------------------------- model fingerprints
#
# A patch is exact only for the weights it was computed from, so patches record the model's
# fingerprint and every use checks it. The digest hashes every weight once per model state; a
# later check reads two integers per parameter (storage address, torch's version counter) of the
# parameters it saw last time, and a sample of their values (``_SAMPLE`` per parameter, one comparison
# per device): no walk over the modules, no pass over the weights. Writes through ``p.data`` leave the
# version counter alone; the sample catches those that change many values (a whole tensor scaled,
# shifted, copied into), not an edit of a few values it does not hold (``cached=False`` re-hashes).
# The cache is a ``PerModel`` (no weakref callback: one is where Python swallows a KeyboardInterrupt).


@dataclass
class _State:
    refs: list  # weak references to the parameters, in named_parameters order
    ptrs: tuple  # storage address of each
    versions: tuple  # torch version counter of each (bumped by in-place ops, optimizer steps, load_state_dict)
    digest: str
    spots: list = dataclasses.field(default_factory=list)  # per parameter, the flat indices sampled (_spots)
    sample: dict = dataclasses.field(default_factory=dict)  # (device, dtype) -> the values there (_sampled)

    def same_storage(self) -> list[Tensor] | None:
        """The parameters, if all are alive and in the storage seen (a replaced module's are gone)."""
        params = [r() for r in self.refs]
        ok = all(p is not None for p in params) and tuple(p.data_ptr() for p in params) == self.ptrs
        return params if ok else None

    def current(self) -> bool:
        params = self.same_storage()
        if params is None or tuple(_version(p) for p in params) != self.versions:
            return False
        now = _sampled(params, self.spots)  # writes through p.data leave the version counter alone
        return now.keys() == self.sample.keys() and all(torch.equal(now[k], v) for k, v in self.sample.items())


_FINGERPRINTS: PerModel[_State] = PerModel()
_CHUNK = 1 << 22  # elements hashed per step: bounds the float32 copy of a half-precision weight


_SAMPLE = 64  # values per parameter read by a cached check


def _spots(params: list[Tensor]) -> list[Tensor | None]:
    """Per parameter, the flat indices of up to ``_SAMPLE`` values spread over it (a stride that is
    rarely a row's length), on its device; ``None`` for an empty one or one on the meta device (whose
    data accelerate keeps elsewhere)."""
    out = []
    for p in params:
        n = p.numel()
        step = max(1, n // _SAMPLE)
        out.append(
            None if not n or p.device.type == "meta" else torch.arange((step // 2 + 7) % step, n, step, device=p.device)
        )
    return out


def _sampled(params: list[Tensor], spots: list[Tensor | None]) -> dict:
    """The values at ``spots`` of every parameter, one tensor per device and dtype (one ``take`` each)."""
    by_kind: dict = {}
    with torch.no_grad():
        for p, at in zip(params, spots):
            if at is not None:
                by_kind.setdefault((p.device, p.dtype), []).append(torch.take(p.detach(), at))
    return {k: torch.cat(v) for k, v in by_kind.items()}


def versions(params) -> tuple[int, ...]:
    """Torch's version counter of each of ``params`` (bumped by every in-place write but through ``.data``)."""
    return tuple(_version(p) for p in params)


def _version(p: Tensor) -> int:
    try:
        return p._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _digest(params: list[tuple[str, Tensor]]) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in params:
            h.update(f"{name}|{tuple(p.shape)}|".encode())
            flat = p.detach().reshape(-1)
            for start in range(0, flat.numel(), _CHUNK):  # float32 bytes, one bounded chunk at a time
                h.update(_raw_bytes(flat[start : start + _CHUNK].to(torch.float32)))
    return h.hexdigest()[:32]


def _cached(model: nn.Module) -> _State | None:
    """The cache entry of ``model`` (not of a dead model whose id it reuses)."""
    return _FINGERPRINTS.get(model)


def _remember(model: nn.Module, params: list[tuple[str, Tensor]], digest: str) -> None:
    ps = [p for _, p in params]
    _FINGERPRINTS[model] = _State(
        [weakref.ref(p) for p in ps],
        tuple(p.data_ptr() for p in ps),
        tuple(_version(p) for p in ps),
        digest,
        spots := _spots(ps),
        _sampled(ps, spots),
    )


def fingerprint(model: nn.Module, cached: bool = True) -> str:
    """A digest (sha256) of the model's parameter names, shapes and values (as float32).

    Casting to float32 makes ``model.double()`` keep the fingerprint of the float32 model it came
    from. With ``cached=True`` the digest is reused while the parameters last seen keep their
    storage, version counter and sampled values and are still alive (``_State.current``), which catches
    in-place edits, optimizer steps, ``load_state_dict``, ``.to()`` and replaced modules. Writes through
    ``p.data`` bypass torch's version counter: the sample catches those that change many values, not an
    edit of a few values outside it; ``cached=False`` (what ``load_patch(path, model)`` uses) always
    re-hashes. The config is recorded beside it
    (``config_record``): a digest of the weights alone keeps the checkpoints' fingerprints valid.
    """
    hit = _cached(model)
    if cached and hit is not None and hit.current():
        return hit.digest
    params = list(named_values(model))  # an accelerate-offloaded parameter: its data, wherever it is
    digest = _digest(params)
    _remember(model, params, digest)
    return digest


def restored(model: nn.Module, before: _State | None, touched: set[int]) -> None:
    """After ``apply`` wrote and restored the parameters with ids ``touched`` bit for bit, keep the
    cached digest: only their version counters moved. Anything else changed: re-hash next time."""
    hit = _cached(model)
    if before is None or hit is not before:
        return
    params = hit.same_storage()
    if params is None:
        return
    versions = tuple(_version(p) for p in params)
    if all(v == w or id(p) in touched for p, v, w in zip(params, versions, hit.versions)):
        hit.versions = versions  # bit for bit restored: the sample holds too


def cached_state(model: nn.Module) -> _State | None:
    """The current cached fingerprint state of ``model`` (``None`` if stale or absent)."""
    hit = _cached(model)
    return hit if hit is not None and hit.current() else None


# --------------------------------------------------------------------------- model configs
#
# Weights alone do not make the computation: a norm's epsilon, the rotary base, the activation live
# in the config. A patch records its model's config fields (``config_record``, in its ``meta["model"]
# ["config"]``, written by ``Adapter.describe``) beside the weight fingerprint, and every check
# compares them (``check_config``); a record without them (files of tokenpatch 0.2) checks the
# weights only. Which fields do not change the forward (names, versions, output flags) the adapter
# says (``Adapter.config_ignored``); every other field counts.

_MISSING = "<not set>"


def _plain(value: Any, ignored: tuple[str, ...] = ()) -> Any:
    """``value`` as its JSON form (what a patch file gives back): tuples as lists, a nested config as its
    dict without the fields ``ignored`` (a multimodal model's text config), other objects as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v, ignored) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, ignored) for v in value]
    if callable(getattr(value, "to_dict", None)):  # a nested config
        return _plain({k: v for k, v in value.to_dict().items() if k not in ignored}, ignored)
    return str(value)


def _fields(config: Any, names, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config fields ``names``, JSON-able, read from the instance's dict first (a Hugging Face
    config's attribute lookup costs microseconds each)."""
    held = getattr(config, "__dict__", {})
    return {n: _plain(held[n] if n in held else getattr(config, n, _MISSING), ignored) for n in names}


def _recorded(then: Any, now: Any) -> bool:
    """Whether ``now`` holds what the record ``then`` holds. A nested config (a dict with a ``model_type``)
    is compared on the fields recorded: the record left out the ones that do not change the forward; any
    other value, a plain dict included, must be equal."""
    if isinstance(then, dict) and isinstance(now, dict) and "model_type" in then:
        return all(k in now and _recorded(v, now[k]) for k, v in then.items())
    return then == now


def _readable(config: Any, name: str) -> bool:
    """Whether ``config`` gives its field ``name``: held by the instance, or an attribute it gives (a
    transformers config with per-layer fields, dots.llm3 Note's, refuses a global read of one, raising
    an error of its own: its ``per_layer_config`` holds them)."""
    if name in getattr(config, "__dict__", {}):
        return True
    try:
        getattr(config, name)
    except Exception:  # noqa: BLE001 - AttributeError, or transformers' AmbiguousGlobalPerLayerAttributeError
        return False
    return True


def config_record(config: Any, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of a model's ``config`` (a dataclass, or an object with ``to_dict`` such as a Hugging
    Face config), JSON-able, without ``ignored``; ``{}`` for a model without one."""
    if dataclasses.is_dataclass(config):
        names = [f.name for f in dataclasses.fields(config)]
    elif callable(getattr(config, "to_dict", None)):
        names = list(config.to_dict())
    else:
        return {}
    return _fields(config, [n for n in names if n not in ignored and _readable(config, n)], ignored)


def check_config(model: nn.Module, record: dict[str, Any] | None) -> None:
    """Raise ``InputError`` if the model's config now holds another value in a field of ``record`` (a
    patch's record, ``config_record``; ``None``: nothing recorded). A few attribute reads: every call."""
    config = getattr(model, "config", None)
    now = _fields(config, record or {})
    changed = [f"{k}: {record[k]!r} then, {now[k]!r} now" for k in now if not _recorded(record[k], now[k])]
    if changed:
        raise InputError(
            f"this patch was computed for another model config ({'; '.join(changed[:3])}); a token patch "
            "is exact only for the model it came from: use that model, or compute the patch again on this one"
        )
