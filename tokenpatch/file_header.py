"""A tokenpatch file's header, read without torch: the safetensors header (8 bytes of length, then
JSON) and the tokenpatch document in its metadata. ``tokenpatch.files.read_file`` starts here; the
command line calls ``read_header`` alone, to check a file in milliseconds before torch loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenpatch.errors import FileFormatError

__all__ = ["META_KEY", "HINTS", "read_header"]

META_KEY = "tokenpatch"  # the safetensors metadata key that holds the tokenpatch document
HINTS = {  # (found, wanted) -> what the user probably meant
    (
        "tokenpatch.patch/1",
        "tokenpatch.model/1",
    ): " (a patch file: load it with tp.load_patch, pass a model checkpoint here)",
    ("tokenpatch.model/1", "tokenpatch.patch/1"): " (a model checkpoint: load it with tp.load_model)",
}


def read_header(path: str, kind: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """``(tensor names, tokenpatch document)`` of the safetensors file ``path``, from its header alone:
    8 bytes and a JSON text, no tensor read, no torch. With ``kind`` (``"tokenpatch.model/1"``, ...),
    the file must be a tokenpatch file of that kind; without it, any safetensors file passes
    (document ``{}``).

    Raises ``FileNotFoundError`` or ``FileFormatError``. ``tokenpatch.files.read_file`` starts with it,
    then reads the tensors and checks the checksum; the command line calls it alone, to check a file
    before torch loads.
    """
    p = Path(path)
    if p.is_dir():
        raise FileFormatError(f"{p} is a directory; give the path of a {kind or 'safetensors'} file")
    if not p.exists():
        raise FileNotFoundError(f"no such file: {p}")
    if not p.is_file():
        raise FileFormatError(f"{p} is not a regular file")
    try:
        with p.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{len(head)} bytes, shorter than a safetensors header")
            n, size = int.from_bytes(head, "little"), p.stat().st_size - 8
            if n > size:
                raise ValueError(f"header claims {n} bytes but the file has {size} after it")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    except ValueError as exc:
        raise FileFormatError(
            f"{p} is not a readable safetensors file (truncated or corrupt?): "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc
    names = [k for k in header if k != "__metadata__"]
    if kind is None:
        return names, {}
    raw = (header.get("__metadata__") or {}).get(META_KEY)
    if raw is None:
        raise FileFormatError(f"{p} is a safetensors file but not one written by tokenpatch")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise FileFormatError(f"{p}: tokenpatch metadata is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != kind:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise FileFormatError(f"{p} holds a {found!r}, not a {kind!r}{HINTS.get((found, kind), '')}")
    return names, doc
