"""Our own models, model code only (training lives in the workbench).

* ``icl``: the in-context-learning transformer, read top to bottom (``ICLTransformer``, ``Block``),
  its checkpoints and the shipped ones (``data/``);
* ``layers``: its contextual layers (softmax / linear attention, Elman RNN, GRU, LSTM);
* ``hf_layers``: contextual layers that are ``transformers``' own mixers (Llama attention, Gated DeltaNet,
  Mamba 2, RG-LRU, LFM2's short convolution), and ``icl.SHIPPED_TRANSFORMERS`` trained with them;
* ``markov``: the Markov-chain model on one-hot ``[state; position]`` vectors;
* ``lm``: the small induction language model on one-hot ``[token; position]`` vectors.
"""

from tokenpatch.models.icl import (
    SHIPPED,
    SHIPPED_TRANSFORMERS,
    Block,
    ICLConfig,
    ICLTransformer,
    check_inputs,
    load_model,
    read_checkpoint,
    save_model,
)
from tokenpatch.models.layers import LAYERS, make_layer
from tokenpatch.models.placement import as_device, as_dtype

__all__ = [
    "ICLConfig",
    "ICLTransformer",
    "Block",
    "load_model",
    "save_model",
    "read_checkpoint",
    "SHIPPED",
    "SHIPPED_TRANSFORMERS",
    "as_dtype",
    "as_device",
    "check_inputs",
    "LAYERS",
    "make_layer",
]
