"""tokenpatch: context is a weight update.

A transformer block that reads a context behaves exactly like the same block, without the
context, whose MLP weights got a rank-1 patch. ``token_patch`` computes that patch for every
layer and query of a model from one forward pass; ``verify`` checks it; ``apply`` and
``functional_call`` run the model with it; ``save_patch`` / ``load_patch`` keep it.

    import tokenpatch as tp
    model = tp.load_model()                        # shipped 10-layer Pre-LN ICL transformer
    batch = tp.LinRegTask(4, 16).sample(8)
    patch = tp.token_patch(model, batch.tokens)    # query = last position, all context removed
    print(tp.verify(model, batch.tokens, patch).table())

The math is in ``docs/`` of the repository (the patch theorem, the deep-model algorithm, the
error metric) and in *Learning without training: the implicit dynamics of in-context learning*
(Dherin et al., 2025).

``trajectory`` gives the patch after every context token (the implicit learning dynamics),
``finetune`` the explicit fine-tuning it is compared with, ``thought_patch`` / ``compress`` one
static patch that stands in for a whole prompt on queries never seen.

A new model family is one ``Adapter`` (``tp.register_adapter``); ``tp.Sites`` says where its
patch goes.
"""

import warnings

from tokenpatch.arch import Adapter, Sites, adapter_for
from tokenpatch.arch import register as register_adapter
from tokenpatch.patch import Patch
from tokenpatch.patch_files import load_patch, save_patch
from tokenpatch.dynamics import diagnostics
from tokenpatch.dynamics.trajectories import Trajectory, trajectory
from tokenpatch.errors import FileFormatError, InputError, TokenpatchError, UnsupportedModelError, ZeroAnchorError
from tokenpatch.dynamics.finetuning import FineTune, finetune, finetuned, simaou
from tokenpatch.generate import Generation, generate
from tokenpatch.run import apply, functional_call
from tokenpatch.models.layers import LAYERS, make_layer
from tokenpatch.lowrank import LowRank
from tokenpatch.dynamics.online_gd import Replay, replay
from tokenpatch.models.icl import Block, ICLConfig, ICLTransformer, load_model, save_model
from tokenpatch.patching import strip_context, token_patch
from tokenpatch.plans import Plan, make_plan
from tokenpatch.tasks.linreg import LinRegTask
from tokenpatch.thought.distillation import Distilled, distill
from tokenpatch.thought.front import LayerFit, ThoughtPatch, ThoughtWarning, compress, evaluate_thought_patch, thought_patch
from tokenpatch.verify import TOLERANCES, SiteError, Verification, verify

__version__ = "0.2.0"

# Old names, kept for one release; each warns with the new spelling.
_DEPRECATED = {"save": ("save_patch", save_patch), "load": ("load_patch", load_patch), "LayerError": ("SiteError", SiteError)}


def __getattr__(name: str):
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(f"tokenpatch.{name} is deprecated; use tokenpatch.{new}", DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module 'tokenpatch' has no attribute {name!r}")

__all__ = [
    "token_patch",
    "trajectory",
    "Trajectory",
    "replay",
    "Replay",
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
    "register_adapter",
    "adapter_for",
    "TokenpatchError",
    "InputError",
    "ZeroAnchorError",
    "FileFormatError",
    "UnsupportedModelError",
]
