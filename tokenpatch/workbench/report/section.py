"""One section of the report: what every section module returns and ``reproduce`` assembles."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Section"]


@dataclass
class Section:
    """``key``: the section's snake_case key in ``results.json``; ``body``: its markdown;
    ``figures``: the PNG files it wrote; ``data``: the numbers of its figures and tables."""

    key: str
    title: str
    body: str
    figures: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
