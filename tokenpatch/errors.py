"""Exceptions. Every error tokenpatch raises on purpose is a ``TokenpatchError``.

Each one also derives from the builtin a caller would naturally catch (``ValueError`` for bad
values and files, ``TypeError`` for an unsupported model), so ``except ValueError`` still works.
Warnings point at the right line: ``user_stacklevel()`` (runtime warnings: the user's call) and
``caller_stacklevel()`` (deprecations: the call of the old spelling) give their ``stacklevel``.
"""

from __future__ import annotations

import inspect
import os

__all__ = [
    "TokenpatchError",
    "InputError",
    "ZeroAnchorError",
    "FileFormatError",
    "UnsupportedModelError",
    "user_stacklevel",
    "caller_stacklevel",
]


class TokenpatchError(Exception):
    """Base class of tokenpatch's own errors."""


class InputError(TokenpatchError, ValueError):
    """Inputs of the wrong shape, dtype or value (NaN/inf, query outside the sequence, ...)."""


class ZeroAnchorError(TokenpatchError, ValueError):
    """The no-context anchor vector is zero while a change is needed: no weight patch exists.

    A patch ``dW`` acts on the anchor ``a`` as ``dW a``; with ``a = 0`` it cannot produce the
    required nonzero change ``r``, so no minimal (or any) patch on that matrix exists.
    ``index`` lists the offending leading indices (e.g. ``(batch, query)`` pairs).
    """

    def __init__(self, message: str, index: list[tuple[int, ...]] | None = None):
        super().__init__(message)
        self.index = index or []


class FileFormatError(TokenpatchError, ValueError):
    """A patch or checkpoint file that is corrupt, truncated, edited, or not meant for this model."""


class UnsupportedModelError(TokenpatchError, TypeError):
    """No adapter in ``tokenpatch.arch`` knows this model, or a parameter cannot be patched."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the tokenpatch/ folder
_TORCH = f"{os.sep}torch{os.sep}"


def user_stacklevel() -> int:
    """The ``stacklevel`` (for ``warnings.warn`` called by the caller of this function) of the first
    frame outside tokenpatch and torch: a runtime warning points at the user's call."""
    level, frame = 1, inspect.currentframe().f_back
    while frame is not None and any(part in frame.f_code.co_filename for part in (_PACKAGE, _TORCH)):
        level, frame = level + 1, frame.f_back
    return level


def caller_stacklevel() -> int:
    """The ``stacklevel`` of whoever called the function that warns, past torch's decorators
    (``torch.no_grad``) only: a deprecation points at the call of the old spelling, tokenpatch's own
    calls included (the test suite turns those into errors)."""
    level, frame = 2, inspect.currentframe().f_back.f_back
    while frame is not None and _TORCH in frame.f_code.co_filename:
        level, frame = level + 1, frame.f_back
    return level
