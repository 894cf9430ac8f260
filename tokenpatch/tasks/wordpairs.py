"""Word-pair tasks for prompt compression on language models (``docs/prompt-compression.md``).

Each task is a list of ``(input, answers)`` pairs written by the project from general knowledge
(``tokenpatch/tasks/data/wordpairs/<task>.tsv``: ``input<TAB>answer|alternative``), or read from a
user's file of the same format (``parse_pairs``; ``tokenpatch compress --task-file``). A seeded
split gives the ``demos`` (the k-shot prompt is the first k), ``calibration`` queries (what the
thought patch and the vectors are fitted on), ``dev`` (layer choices) and ``test`` (reported).

The prompt format is ``Format``: by default ``"Q: {x}\\nA: {y}\\n\\n"`` per demonstration and
``"Q: {x}\\nA:"`` for the query, the answer read from ``" {y}"``. An answer is right when the first
line of the greedy continuation, lower-cased, starts with one of the answers as whole words.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from importlib import resources

from tokenpatch.errors import InputError

MAIN_TASKS = ("country_capital", "present_past", "singular_plural", "english_french", "antonym")
RESERVE_TASKS = ("adjective_comparative", "present_gerund", "english_spanish", "english_german")


@dataclass(frozen=True)
class Format:
    """How pairs become text: a demonstration is ``query.format(x=x) + answer.format(y=y) + separator``."""

    query: str = "Q: {x}\nA:"
    answer: str = " {y}"
    separator: str = "\n\n"

    def __post_init__(self):
        if "{x}" not in self.query or "{y}" not in self.answer:
            raise InputError(
                f"a prompt format needs {{x}} in its query and {{y}} in its answer, got "
                f"{self.query!r} / {self.answer!r}"
            )

    def demos(self, pairs: list[tuple[str, tuple[str, ...]]]) -> str:
        return "".join(self.query.format(x=x) + self.answer.format(y=ys[0]) + self.separator for x, ys in pairs)


@dataclass(frozen=True)
class WordPairs:
    name: str
    description: str
    pairs: tuple[tuple[str, tuple[str, ...]], ...]

    def split(
        self, seed: int = 0, demos: int = 10, calibration: int = 40, dev: int = 30, test: int | None = None
    ) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
        """Disjoint seeded splits ``demos / calibration / dev / test`` (``test``: the rest, or at most that many)."""
        need = demos + calibration + dev + 1  # needed_pairs, with the demonstrations as given
        if len(self.pairs) < need:
            raise InputError(f"task {self.name!r} has {len(self.pairs)} pairs; the split needs at least {need}")
        order = list(self.pairs)
        random.Random(seed).shuffle(order)
        cuts = [demos, demos + calibration, demos + calibration + dev]
        rest = order[cuts[2] :]
        return {
            "demos": order[: cuts[0]],
            "calibration": order[cuts[0] : cuts[1]],
            "dev": order[cuts[1] : cuts[2]],
            "test": rest if test is None else rest[:test],
        }


def task_names() -> list[str]:
    return sorted(
        p.name[:-4]
        for p in resources.files(__package__).joinpath("data", "wordpairs").iterdir()
        if p.name.endswith(".tsv")
    )


def load_task(name: str) -> WordPairs:
    """The word-pair task ``name`` (``task_names()`` lists them)."""
    if name not in task_names():
        raise InputError(f"unknown word-pair task {name!r}; known: {task_names()}")
    text = resources.files(__package__).joinpath("data", "wordpairs", f"{name}.tsv").read_text(encoding="utf-8")
    return parse_pairs(text, name, f"{name}.tsv")


TASK_FILE_FORMAT = (
    "one pair per line, 'input<TAB>answer', alternatives after '|' ('big<TAB>small|little'); "
    "an optional first line '# description'; blank lines and lines starting with '#' are skipped"
)


def parse_pairs(text: str, name: str, source: str) -> WordPairs:
    """A word-pair task from the text of a TSV file (``TASK_FILE_FORMAT``); ``source`` names the file
    in errors, which give the line number. An input may appear once (a repeat would sit in two splits)."""
    lines = text.splitlines()
    description = lines[0][2:].strip() if lines and lines[0].startswith("# ") else name
    pairs, seen = [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        x, tab, ys = line.partition("\t")
        answers = tuple(a.strip() for a in ys.split("|"))
        if not tab or not x.strip() or not all(answers) or "\t" in ys:
            raise InputError(f"{source} line {n}: expected 'input<TAB>answer[|alternative]', got {line!r}")
        if x.strip() in seen:
            raise InputError(f"{source} line {n}: the input {x.strip()!r} is already on line {seen[x.strip()]}")
        seen[x.strip()] = n
        pairs.append((x.strip(), answers))
    if not pairs:
        raise InputError(f"{source} holds no pairs; write {TASK_FILE_FORMAT}")
    return WordPairs(name, description, tuple(pairs))


def needed_pairs(shots: int, calibration: int = 40, dev: int = 30) -> int:
    """Pairs a task needs for ``compare``'s split: the demonstrations (at least 10), calibration, dev, one test."""
    return max(shots, 10) + calibration + dev + 1


def _words(text: str) -> list[str]:
    return re.findall(r"[^\W_]+(?:['-][^\W_]+)*", text.lower())


def is_correct(generated: str, answers: tuple[str, ...]) -> bool:
    """Whole-word match: the first line of ``generated`` starts with the words of one of ``answers``."""
    first = _words(generated.split("\n", 1)[0])
    return any(first[: len(w)] == w for w in (_words(a) for a in answers) if w)
