"""What every command of the command line shares: the parser with one-line errors, the help formatter,
the argument types, the common switches, the checks of every value, path and file the user names, and
the writing of an output file (``new_file``: created at the end, never replacing one). Nothing here
imports torch: every command checks its arguments with these before torch or a model loads."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from tokenpatch.errors import InputError, TokenpatchError
from tokenpatch.file_header import read_header
from tokenpatch.paths import not_a_new_folder

__all__ = [
    "USAGE_ERROR",
    "Parser",
    "Help",
    "count",
    "number",
    "common",
    "usage",
    "shown",
    "check_values",
    "check_out_file",
    "check_out_folder",
    "new_file",
    "read_text_file",
    "read_header",
]

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


def shown(text: str, limit: int = 80) -> str:
    """``text`` as it can be printed on one line: a byte that is not UTF-8 (a surrogate escape from argv) as
    ``\\xe9``, a line break or another control character as its escape (``\\n``), cut after ``limit``
    characters."""
    text = os.fsencode(text).decode("utf-8", "backslashreplace")
    text = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_values(args: argparse.Namespace) -> None:
    """Every text, path and name the user gave: not empty, and UTF-8 (on Linux a byte that is not UTF-8
    arrives in argv as a surrogate escape, which no tokenizer, file name in JSON or print takes)."""
    for dest, value in vars(args).items():
        if not isinstance(value, str) or dest.endswith("command"):
            continue
        flag = "--" + dest.replace("_", "-")
        if value == "":
            raise usage(f"{flag} is empty; give it a value (or leave {flag} out where it is optional)")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise usage(
                f"{flag} '{shown(value)}' is not UTF-8 (byte {shown(value[exc.start])}): tokenpatch reads "
                "its arguments as UTF-8 text; give the text, or rename the file or folder, in UTF-8"
            ) from None


def _check_writable(path: Path, flag: str, shown_as: str) -> None:
    """A file can be created at ``path`` (its missing folders included): tried in the nearest folder that
    exists, with a file created and removed there (``os.access`` says yes to root on a read-only mount)."""
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise usage(f"{flag} {shown_as}: {folder} is a file, not a folder")
    probe = folder / f".tokenpatch-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise usage(f"{flag} {shown_as} cannot be written: {folder}: {exc.strerror}") from None
    os.unlink(probe)


def check_out_folder(path: str, flag: str, what: str = "") -> Path:
    """``path`` is a folder, or can be created as one (``what``: e.g. " for the report", for the message)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise usage(f"{flag} {path} is a file; give a folder{what} (it is created if missing)")
    _check_writable(p / "x", flag, path)
    return p


def check_new_folder(path: str, flag: str) -> Path:
    """``path`` is a new or an empty folder that can be created (nothing in it would be replaced)."""
    p = Path(path)
    what = not_a_new_folder(p)
    if what:
        raise usage(f"{flag} {path} is {what}; give a new folder (nothing is replaced)")
    _check_writable(p, flag, path)
    return p


def new_file(path: str | Path, flag: str) -> contextlib.AbstractContextManager[Path]:
    """``with new_file(path, flag) as tmp:`` write the output to ``tmp`` (a hidden sibling with the same
    suffix); when the block ends, ``tmp`` becomes ``path`` by a hard link, which never replaces a file:
    if one appeared at ``path`` during the run, it is kept, and so is this run's result (the error names
    where). Missing folders are created. A write that fails names ``path``, not the temporary file."""
    return _new_file(Path(path), flag)


@contextlib.contextmanager
def _new_file(path: Path, flag: str) -> Iterator[Path]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise usage(f"{flag} {path} cannot be written: {exc.strerror}") from None
    tmp = path.parent / f".partial-{secrets.token_hex(4)}-{path.name}"
    done = False
    try:
        try:
            yield tmp
        except OSError as exc:
            raise usage(f"{flag} {path} could not be written: {exc.strerror or exc}") from None
        try:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # no hard links here (FAT, some network folders): claim the name, then move in
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                os.replace(tmp, path)
        except FileExistsError:
            done = True  # keep tmp: it holds the work
            raise usage(
                f"{flag} {path} appeared during the run and is kept (nothing is overwritten); this run's "
                f"result is in {tmp}; rename it"
            ) from None
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of ``path`` (a byte-order mark in front, as some editors write, dropped); a binary file
    or one in another encoding is one line."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise usage(
            f"{flag} {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); give a "
            "text file, UTF-8"
        ) from None
    if "\x00" in text:
        raise usage(f"{flag} {path} is a binary file (it holds a NUL byte); give a text file, UTF-8")
    return text


def check_out_file(path: str, flag: str, may_exist: bool) -> None:
    """``path`` can be written as a file: not a folder, its parent not a file, and (unless
    ``may_exist``) nothing there yet, and a file can be created there (missing folders are created)."""
    p = Path(path)
    if p.is_dir():
        raise usage(f"{flag} {path} is a folder; give a file path (e.g. {p / 'model.safetensors'})")
    if not may_exist and p.exists():
        raise usage(f"{flag} {path} already exists; remove it or choose another path (nothing is overwritten)")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise usage(f"{flag} {path}: {parent} is a file, not a folder")
    _check_writable(p, flag, path)
