"""``PerModel``: values remembered for each live model (a fingerprint, a layer-name map), without
weakref callbacks.

A ``weakref.WeakKeyDictionary`` drops an entry from a callback when its key dies, and a callback is
where Python swallows a ``KeyboardInterrupt`` ("Exception ignored in: ... WeakKeyDictionary ...
remove"): a Ctrl-C that lands there is lost and the run goes on. Here entries are keyed by
``id(model)`` and hold a weak reference *without* a callback; an entry answers only for the very
object it was made for (a new model may reuse a dead one's id), and entries of dead models are
dropped whenever a value is stored.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

__all__ = ["PerModel"]

V = TypeVar("V")


class PerModel(Generic[V]):
    """A mapping from live objects to values: ``cache.get(model)``, ``cache[model] = value``,
    ``cache.pop(model)``. Never keeps an object alive, never runs a callback."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, obj: object, default: V | None = None) -> V | None:
        hit = self._entries.get(id(obj))
        return hit[1] if hit is not None and hit[0]() is obj else default

    def __setitem__(self, obj: object, value: V) -> None:
        for key in [k for k, (ref, _) in self._entries.items() if ref() is None]:
            del self._entries[key]
        self._entries[id(obj)] = (weakref.ref(obj), value)

    def pop(self, obj: object, default: V | None = None) -> V | None:
        value = self.get(obj, default)
        if id(obj) in self._entries and self._entries[id(obj)][0]() is obj:
            del self._entries[id(obj)]
        return value

    def __len__(self) -> int:
        return sum(ref() is not None for ref, _ in self._entries.values())
