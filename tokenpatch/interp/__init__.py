"""Circuits behind in-context learning (``docs/markov.md``, ``docs/induction.md``).

* ``phases``, ``circuits``, ``bridge``: Markov-chain phases, their probes, and the bridge to token patches;
* ``induction``: induction-head scores (diagonal, TransformerLens' detector, previous- and duplicate-token);
* ``ablation``: head ablation as a context manager, head selection and the random control;
* ``temporal``: the lag curve, serial recall and their dose-response to ablation;
* ``head_patches``: each head's exact part of every layer's token patch.
"""

import importlib
import importlib.util

__all__ = ["ablation", "bridge", "circuits", "head_patches", "induction", "phases", "temporal"]


def __getattr__(name: str):
    """``tp.interp.<module>`` imports the module on first use (PEP 562), however the package was first
    imported; nothing is imported with the package itself (the command line stays torch-free)."""
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
