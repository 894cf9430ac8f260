"""Old spellings kept for one release. Each warns with a ``DeprecationWarning`` that names the new one.

``renamed_keywords(old="new")`` decorates a function whose keyword argument was renamed: a call with
the old keyword warns and passes the value on under the new one (both at once is an error).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

from tokenpatch.errors import InputError, caller_stacklevel

__all__ = ["renamed_keywords"]


def renamed_keywords(**renames: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise InputError(f"{fn.__name__}: pass {new}= only ({old}= is its deprecated name)")
                warnings.warn(
                    f"{fn.__name__}({old}=...) is deprecated; the argument is now {new}=",
                    DeprecationWarning,
                    stacklevel=caller_stacklevel(),
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return wrap
