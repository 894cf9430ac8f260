"""Our own models, model code only (training lives in the workbench).

* ``icl``: the in-context-learning transformer, read top to bottom (``ICLTransformer``, ``Block``),
  its checkpoints and the shipped ones (``data/``);
* ``layers``: its contextual layers (softmax / linear attention, Elman RNN, GRU, LSTM);
* ``markov``: the Markov-chain model on one-hot ``[state; position]`` vectors;
* ``lm``: the small induction language model on one-hot ``[token; position]`` vectors.
"""

from tokenpatch.models.icl import (
    SHIPPED,
    Block,
    ICLConfig,
    ICLTransformer,
    as_device,
    as_dtype,
    check_inputs,
    load_model,
    read_checkpoint,
    save_model,
)
from tokenpatch.models.layers import LAYERS, make_layer

__all__ = [
    "ICLConfig",
    "ICLTransformer",
    "Block",
    "load_model",
    "save_model",
    "read_checkpoint",
    "SHIPPED",
    "as_dtype",
    "as_device",
    "check_inputs",
    "LAYERS",
    "make_layer",
]
