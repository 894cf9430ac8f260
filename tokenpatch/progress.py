"""Progress bars with library manners.

A library call shows a bar only where it helps: on a terminal, and once the work has taken more
than a second (``progress=None``, the default of every library function). ``progress=True``
always shows one (the command line does), ``progress=False`` never does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

__all__ = ["progress_bar"]

DELAY_S = 1.0  # a bar appears only after this long: short calls stay silent


def progress_bar(iterable: Iterable[T], progress: bool | None, **kwargs) -> Iterable[T]:
    """``tqdm(iterable)`` shown per ``progress``: ``None`` -> only on a terminal and after
    ``DELAY_S`` seconds; ``True`` -> always, at once; ``False`` -> never."""
    if progress is None:  # tqdm's disable=None: off when the output is not a terminal
        return tqdm(iterable, disable=None, delay=DELAY_S, **kwargs)
    return tqdm(iterable, disable=not progress, **kwargs)
