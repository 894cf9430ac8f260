"""The examples a new user copies from keep running."""

from __future__ import annotations

import ast
import re
import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_examples_exist_and_say_how_to_run():
    """An empty (or moved) examples/ would make test_example_runs skip, not fail; each example's
    module docstring says what it shows and how to run it (``python examples/<name>.py``)."""
    assert EXAMPLES, "examples/ holds no *.py scripts"
    for path in EXAMPLES:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc, f"{path.name} has no module docstring"
        assert f"python examples/{path.name}" in doc, f"{path.name}: the docstring does not say how to run it"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert out and "False" not in out
    if path.stem == "compress_instruction":  # the prompt alone, compressed: it must answer, not only run
        right = re.search(r"with the thought patch and no prompt: (\d+)/5 right", out)
        assert right and int(right.group(1)) >= 4, out
