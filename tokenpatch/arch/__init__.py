"""Model families as data: one ``Adapter`` per family (see ``base.py`` for the interface: every
method the rest of tokenpatch calls on a model family is declared there).

``adapter_for(model)`` picks the first registered adapter that matches; ``register`` adds one
(a user's own family, or a built-in one overridden). Built in: our ``ICLTransformer`` / ``Block``.
"""

from __future__ import annotations

import warnings

from torch import nn

from tokenpatch.arch.base import Adapter
from tokenpatch.arch.families import FAMILIES
from tokenpatch.arch.hf import HFAdapter
from tokenpatch.arch.hf_modules import text_config
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.arch.icl import ICLAdapter
from tokenpatch.arch.outputs import (
    BiasOutput,
    ExpertsOutput,
    GatedOutput,
    MatrixOutput,
    OutputSite,
    ScaledMatrixOutput,
)
from tokenpatch.arch.record import LayerRecord
from tokenpatch.arch.sites import WEIGHT_LAYOUTS, Sites, weight_layout
from tokenpatch.errors import UnsupportedModelError, caller_stacklevel

__all__ = [
    "Adapter",
    "ICLAdapter",
    "HFAdapter",
    "FAMILIES",
    "Sites",
    "OutputSite",
    "BiasOutput",
    "MatrixOutput",
    "ScaledMatrixOutput",
    "GatedOutput",
    "ExpertsOutput",
    "LayerRecord",
    "ADAPTERS",
    "adapter_for",
    "register",
    "registered_hooks",
    "weight_layout",
    "WEIGHT_LAYOUTS",
    "text_config",
]

ADAPTERS: list[Adapter] = [ICLAdapter(), HFAdapter()]


def register(adapter: Adapter) -> Adapter:
    """Register ``adapter`` ahead of the built-in ones; returns it. An adapter whose passes are its
    ``embed``/``mix``/``finish`` (the interface of earlier versions) still works, with a
    ``DeprecationWarning``: implement ``recording``, ``trace`` and ``anchors`` (``Adapter``)."""
    if adapter.layer_by_layer():
        warnings.warn(
            f"the {adapter.name} adapter's passes are its embed/mix/finish (arch.layered), deprecated: implement "
            "trace and anchors (tokenpatch.arch.Adapter); the layer-by-layer passes go in the next release",
            DeprecationWarning,
            stacklevel=caller_stacklevel(),
        )
    ADAPTERS.insert(0, adapter)
    return adapter


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for ``model``, or ``UnsupportedModelError`` naming the supported families."""
    for adapter in ADAPTERS:
        if adapter.matches(model):
            return adapter
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    hf = ", ".join(sorted({t for f in FAMILIES for t in f.model_types}))
    what = f" (Hugging Face model_type {model_type!r})" if model_type is not None else ""
    if any(model_type in f.model_types for f in FAMILIES):  # a known type in a configuration of another design
        designs = ", ".join(f.name for f in FAMILIES if model_type in f.model_types)
        raise UnsupportedModelError(
            f"{type(model).__name__}: this configuration of model_type {model_type!r} matches none of its supported "
            f"block designs ({designs}; docs/hugging-face.md says which configs each covers)"
        )
    raise UnsupportedModelError(
        f"tokenpatch has no adapter for {type(model).__module__}.{type(model).__name__}{what}; supported: "
        f"tokenpatch's own ICLTransformer and Block, and Hugging Face causal LMs of model_type [{hf}] "
        "(see tokenpatch.arch.register to add one)"
    )
