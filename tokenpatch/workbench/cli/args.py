"""What every command of the command line shares: the parser with one-line errors, the help formatter,
the argument types, the common switches, and the checks of paths and files the user names. Nothing
here imports torch: every command checks its arguments with these before torch or a model loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenpatch.errors import InputError, TokenpatchError
from tokenpatch.file_header import read_header

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
