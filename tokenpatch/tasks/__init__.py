"""The data the methods are measured on, one module per task family.

* ``linreg``: in-context linear regression (``docs/linear-regression.md``);
* ``markov``: Markov chains in context (``docs/markov.md``);
* ``recall``: the lag probe and few-shot serial recall (``docs/induction.md``);
* ``repeats``: sequences with repeats, the small induction LM's training data;
* ``wordpairs``: word-pair tasks for prompt compression (``docs/prompt-compression.md``).

"""

import importlib
import importlib.util

__all__ = ["linreg", "markov", "recall", "repeats", "wordpairs"]


def __getattr__(name: str):
    """``tp.tasks.<module>`` imports the module on first use (PEP 562), however the package was first
    imported; nothing is imported with the package itself (the command line stays torch-free)."""
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
