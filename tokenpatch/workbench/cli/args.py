"""What every command of the command line shares: the parser with one-line errors, the help formatter,
the argument types, the common switches, and the checks of paths and files the user names. Nothing
here imports torch: every command checks its arguments with these before torch or a model loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokenpatch.errors import FileFormatError, InputError, TokenpatchError
from tokenpatch.workbench.cli.defaults import MODEL_FORMAT, PATCH_FORMAT

__all__ = ["USAGE_ERROR", "Parser", "Help", "count", "number", "common", "usage", "check_out_file", "read_header"]

USAGE_ERROR = 2


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (what is wrong, and where to read more)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every default; switches (off) and options whose help says it do not repeat it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def count(minimum: int):
    """argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be at least {minimum}")
        return value

    parse.__name__ = "integer"
    return parse


def number(positive: bool):
    """argparse type: a float > 0 (``positive``) or >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value > 0 if positive else value >= 0) or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text} must be a finite number {'> 0' if positive else '>= 0'}")
        return value

    parse.__name__ = "number"
    return parse


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=count(0), default=0, help="torch threads (0: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    p.add_argument(
        "--debug", action="store_true", help="show the Python traceback of an error (also: TOKENPATCH_DEBUG=1)"
    )


def usage(message: str) -> TokenpatchError:
    """The error of a user mistake on the command line: one line on stderr, exit status 2."""
    return InputError(message)


def check_out_file(path: str, flag: str, may_exist: bool) -> None:
    """``path`` can be written as a file: not a folder, its parent not a file, and (unless
    ``may_exist``) nothing there yet."""
    p = Path(path)
    if p.is_dir():
        raise usage(f"{flag} {path} is a folder; give a file path (e.g. {p / 'model.safetensors'})")
    if not may_exist and p.exists():
        raise usage(f"{flag} {path} already exists; remove it or choose another path (nothing is overwritten)")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise usage(f"{flag} {path}: {parent} is a file, not a folder")


_HINTS = {  # (found, wanted) -> what the user probably meant; tokenpatch.files says the same
    (PATCH_FORMAT, MODEL_FORMAT): " (a patch file: load it with tp.load_patch, pass a model checkpoint here)",
    (MODEL_FORMAT, PATCH_FORMAT): " (a model checkpoint: load it with tp.load_model)",
}


def read_header(path: str, kind: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """``(tensor names, tokenpatch document)`` of the safetensors file ``path``, from its header alone:
    8 bytes and a JSON text, no tensor read, no torch. With ``kind`` (``"tokenpatch.model/1"``, ...),
    the file must be a tokenpatch file of that kind; without it, any safetensors file passes
    (document ``{}``).

    Raises what the full reader (``tokenpatch.files.read_file``) raises for the same file, with the
    same words: ``FileNotFoundError``, ``FileFormatError``. The full reader still runs when the file
    is used; the tensors and the checksum are its alone.
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
    raw = (header.get("__metadata__") or {}).get("tokenpatch")
    if raw is None:
        raise FileFormatError(f"{p} is a safetensors file but not one written by tokenpatch")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise FileFormatError(f"{p}: tokenpatch metadata is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != kind:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise FileFormatError(f"{p} holds a {found!r}, not a {kind!r}{_HINTS.get((found, kind), '')}")
    return names, doc
