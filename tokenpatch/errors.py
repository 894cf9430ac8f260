"""Exceptions. Every error tokenpatch raises on purpose is a ``TokenpatchError``.

Each one also derives from the builtin a caller would naturally catch (``ValueError`` for bad
values and files, ``TypeError`` for an unsupported model), so ``except ValueError`` still works.
"""

from __future__ import annotations

__all__ = [
    "TokenpatchError",
    "InputError",
    "ZeroAnchorError",
    "FileFormatError",
    "UnsupportedModelError",
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
