"""tokenpatch: context is a weight update.

A transformer block that reads a context behaves exactly like the same block, without the
context, whose MLP weights got a rank-1 patch. ``token_patch`` computes that patch for every
layer and query of a model from one forward pass; ``verify`` checks it; ``apply`` and
``functional_call`` run the model with it; ``save`` / ``load`` keep it.

    import tokenpatch as tp
    model = tp.load_model()                        # shipped 10-layer Pre-LN ICL transformer
    batch = tp.LinRegTask(4, 16).sample(8)
    patch = tp.token_patch(model, batch.tokens)    # query = last position, all context removed
    print(tp.verify(model, batch.tokens, patch).table())

The math is in ``solve.py`` and in science/token_patches.md of the design notes.
"""

from .delta import LowRank, Patch, load, save
from .errors import FileFormatError, InputError, TokenpatchError, UnsupportedModelError, ZeroAnchorError
from .layers import LAYERS, make_layer
from .models import Block, ICLConfig, ICLTransformer, load_model, save_model
from .patching import (
    LayerError,
    Plan,
    Verification,
    apply,
    functional_call,
    make_plan,
    strip_context,
    token_patch,
    verify,
)
from .tasks.linreg import LinRegTask

__version__ = "0.1.0"

__all__ = [
    "token_patch",
    "verify",
    "apply",
    "functional_call",
    "strip_context",
    "save",
    "load",
    "Patch",
    "LowRank",
    "Plan",
    "make_plan",
    "Verification",
    "LayerError",
    "ICLConfig",
    "ICLTransformer",
    "Block",
    "load_model",
    "save_model",
    "LAYERS",
    "make_layer",
    "LinRegTask",
    "TokenpatchError",
    "InputError",
    "ZeroAnchorError",
    "FileFormatError",
    "UnsupportedModelError",
]
