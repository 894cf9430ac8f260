"""tokenpatch: context is a weight update.

A transformer block that reads a context behaves exactly like the same block, without the
context, whose MLP weights got a rank-1 patch. ``token_patch`` computes that patch for every
layer and query of a model from one forward pass; ``verify`` checks it; ``apply`` and
``functional_call`` run the model with it; ``save_patch`` / ``load_patch`` keep it.

    import tokenpatch as tp
    model = tp.load_model()                        # shipped 10-layer Pre-LN ICL transformer
    batch = tp.LinRegTask(4, 16).sample(8)
    patch = tp.token_patch(model, batch.tokens)    # query = last position, all context removed
    print(tp.verify(model, patch, batch.tokens).table())

The math is in ``docs/`` of the repository (the patch theorem, the deep-model algorithm, the
error metric) and in *Learning without training: the implicit dynamics of in-context learning*
(Dherin et al., 2025).

``trajectory`` gives the patch after every context token (the implicit learning dynamics),
``finetune`` the explicit fine-tuning it is compared with, ``thought_patch`` / ``compress`` one
static patch that stands in for a whole prompt on queries never seen.

A new model family is one ``Adapter`` (``tp.register_adapter``); ``tp.Sites`` says where its
patch goes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from typing import TYPE_CHECKING

from tokenpatch.version import __version__  # noqa: F401 (a plain attribute; the CLI reads tokenpatch.version)

if TYPE_CHECKING:  # what the names below are, for readers and type checkers; at run time they load on first use
    from tokenpatch.arch import Adapter, OutputSite, Sites, adapter_for
    from tokenpatch.arch import register as register_adapter
    from tokenpatch.dynamics import diagnostics
    from tokenpatch.dynamics.finetuning import FineTune, finetune, finetuned, simaou
    from tokenpatch.dynamics.online_gd import Replay, replay
    from tokenpatch.dynamics.online_sgd import OnlineAlignment, online_alignment
    from tokenpatch.dynamics.trajectories import Trajectory, trajectory
    from tokenpatch.errors import FileFormatError, InputError, TokenpatchError, UnsupportedModelError, ZeroAnchorError
    from tokenpatch.generate import Generation, generate
    from tokenpatch.lora import LoraExport, save_lora
    from tokenpatch.lowrank import LowRank
    from tokenpatch.models.icl import Block, ICLConfig, ICLTransformer, load_model, save_model
    from tokenpatch.models.layers import LAYERS, make_layer
    from tokenpatch.patch import Patch
    from tokenpatch.patch_files import load_patch, save_patch
    from tokenpatch.patching import strip_context, token_patch
    from tokenpatch.plans import Plan, make_plan
    from tokenpatch.run import apply, functional_call
    from tokenpatch.tasks.linreg import LinRegTask
    from tokenpatch.thought.distillation import Distilled, distill
    from tokenpatch.thought.front import (
        LayerFit,
        ThoughtPatch,
        ThoughtWarning,
        compress,
        evaluate_thought_patch,
        thought_patch,
    )
    from tokenpatch.verify import TOLERANCES, SiteError, Verification, verify

# ``import tokenpatch`` loads no torch: every public name is imported from its module on first use
# (PEP 562), so the command line can check its arguments in milliseconds. The table is the block above.
_WHERE: dict[str, tuple[str, str | None]] = {  # public name -> (module, its name there; None: the module itself)
    **{n: ("tokenpatch.arch", n) for n in ("Adapter", "OutputSite", "Sites", "adapter_for")},
    "register_adapter": ("tokenpatch.arch", "register"),
    "Patch": ("tokenpatch.patch", "Patch"),
    **{n: ("tokenpatch.patch_files", n) for n in ("load_patch", "save_patch")},
    "diagnostics": ("tokenpatch.dynamics.diagnostics", None),
    **{n: ("tokenpatch.dynamics.trajectories", n) for n in ("Trajectory", "trajectory")},
    **{
        n: ("tokenpatch.errors", n)
        for n in ("FileFormatError", "InputError", "TokenpatchError", "UnsupportedModelError", "ZeroAnchorError")
    },
    **{n: ("tokenpatch.dynamics.finetuning", n) for n in ("FineTune", "finetune", "finetuned", "simaou")},
    **{n: ("tokenpatch.generate", n) for n in ("Generation", "generate")},
    **{n: ("tokenpatch.run", n) for n in ("apply", "functional_call")},
    **{n: ("tokenpatch.models.layers", n) for n in ("LAYERS", "make_layer")},
    "LowRank": ("tokenpatch.lowrank", "LowRank"),
    **{n: ("tokenpatch.lora", n) for n in ("LoraExport", "save_lora")},
    **{n: ("tokenpatch.dynamics.online_gd", n) for n in ("Replay", "replay")},
    **{n: ("tokenpatch.dynamics.online_sgd", n) for n in ("OnlineAlignment", "online_alignment")},
    **{n: ("tokenpatch.models.icl", n) for n in ("Block", "ICLConfig", "ICLTransformer", "load_model", "save_model")},
    **{n: ("tokenpatch.patching", n) for n in ("strip_context", "token_patch")},
    **{n: ("tokenpatch.plans", n) for n in ("Plan", "make_plan")},
    "LinRegTask": ("tokenpatch.tasks.linreg", "LinRegTask"),
    **{n: ("tokenpatch.thought.distillation", n) for n in ("Distilled", "distill")},
    **{
        n: ("tokenpatch.thought.front", n)
        for n in ("LayerFit", "ThoughtPatch", "ThoughtWarning", "compress", "evaluate_thought_patch", "thought_patch")
    },
    **{n: ("tokenpatch.verify", n) for n in ("TOLERANCES", "SiteError", "Verification", "verify")},
}

# Old names, kept for one release; each warns with the new spelling.
_DEPRECATED = {"save": "save_patch", "load": "load_patch", "LayerError": "SiteError"}


def _resolve(name: str):
    module, attr = _WHERE[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __getattr__(name: str):
    if name in _WHERE:
        value = globals()[name] = _resolve(name)
        return value
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(f"tokenpatch.{name} is deprecated; use tokenpatch.{new}", DeprecationWarning, stacklevel=2)
        return getattr(sys.modules[__name__], new)
    if not name.startswith("_") and name != "workbench" and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # A submodule not imported yet (``tp.models.SHIPPED``, ``tp.tasks.linreg``; also ``from tokenpatch
        # import files``): import it, with the modules of the table inside it, as the eager package had.
        value = importlib.import_module(f"{__name__}.{name}")
        for module in sorted({m for m, _ in _WHERE.values() if m.startswith(f"{__name__}.{name}.")}):
            importlib.import_module(module)
        return value
    raise AttributeError(f"module 'tokenpatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


class _Face(types.ModuleType):
    """The package module. Importing a submodule binds it as an attribute of the package; for
    ``tokenpatch.verify`` and ``tokenpatch.generate``, whose names are also public functions, the
    function keeps the name (as when the package imported everything eagerly)."""

    def __setattr__(self, name: str, value) -> None:
        if (
            name in _WHERE
            and isinstance(value, types.ModuleType)
            and _WHERE[name][1] is not None
            and value.__name__ == _WHERE[name][0]
        ):
            value = getattr(value, _WHERE[name][1])
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face

__all__ = [
    "token_patch",
    "trajectory",
    "Trajectory",
    "replay",
    "Replay",
    "online_alignment",
    "OnlineAlignment",
    "finetune",
    "finetuned",
    "FineTune",
    "simaou",
    "thought_patch",
    "ThoughtPatch",
    "LayerFit",
    "ThoughtWarning",
    "evaluate_thought_patch",
    "compress",
    "distill",
    "Distilled",
    "generate",
    "Generation",
    "diagnostics",
    "verify",
    "apply",
    "functional_call",
    "strip_context",
    "save_patch",
    "load_patch",
    "save_lora",
    "LoraExport",
    "Patch",
    "LowRank",
    "Plan",
    "make_plan",
    "Verification",
    "SiteError",
    "TOLERANCES",
    "ICLConfig",
    "ICLTransformer",
    "Block",
    "load_model",
    "save_model",
    "LAYERS",
    "make_layer",
    "LinRegTask",
    "Adapter",
    "Sites",
    "OutputSite",
    "register_adapter",
    "adapter_for",
    "TokenpatchError",
    "InputError",
    "ZeroAnchorError",
    "FileFormatError",
    "UnsupportedModelError",
]
