"""A small language model trained by the project so that induction heads form (``docs/induction.md``).

The model is an ``ICLTransformer`` reading one-hot ``[token; position]`` vectors (width
``V + T``), as the Markov models do, so its ``read_in`` holds a token embedding and a learned
position embedding, and every tokenpatch tool applies to it. Token 0 is BOS.

Training data (``LMData.sample``): ``[BOS, x_1 .. x_{T-1}]`` with ``x_1`` uniform over ``1..V-1``
and, for ``t >= 1``,

    x_{t+1} = (what followed x_t the last time it occurred)   with probability ``follow``, if x_t occurred before,
    x_{t+1} ~ uniform(1..V-1)                                   otherwise.

Each sequence thus has its own successor map, written only in its context: the only way to beat
``log(V - 1)`` nats is to find the previous occurrence of the current token and copy what came
after it, which is what an induction head does (a previous-token head in layer 0, a head in layer 1
matching the current token against it). With one head per layer this is the circuit that forms
(``docs/induction.md`` §5 has the trials: with more heads in layer 0 the model also builds a
*shifted* circuit, two layer-0 heads at offsets k and k + 1, which the standard scores miss).
Resumable training with a progress bar, as ``tokenpatch.workbench.train.markov``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenpatch.errors import FileFormatError, InputError
from tokenpatch.models.icl import ICLConfig, ICLTransformer, read_checkpoint
from tokenpatch.tasks.repeats import BOS, LMData

__all__ = ["LMData", "lm_model", "lm_inputs", "load_lm", "BOS"]


def lm_model(data: LMData, d_model: int = 64, n_layers: int = 4, n_heads: int = 1, mlp: bool = True) -> ICLTransformer:
    """A Pre-LN ``ICLTransformer`` for ``data`` (``mlp=False``: attention-only)."""
    return ICLTransformer(
        ICLConfig(
            d_in=data.vocab + data.length,
            d_out=data.vocab,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            norm="pre",
            mlp=mlp,
        )
    )


def lm_inputs(model: ICLTransformer, ids: torch.Tensor) -> torch.Tensor:
    """One-hot ``[token; position]`` inputs ``[B, T, V + T_max]`` from token ids ``[B, T]``."""
    vocab = model.config.d_out
    n_pos = model.config.d_in - vocab
    if ids.ndim != 2 or ids.shape[1] > n_pos or (ids.numel() and (ids.min() < 0 or ids.max() >= vocab)):
        raise InputError(f"token ids must be [batch, <= {n_pos}] in 0..{vocab - 1}, got {tuple(ids.shape)}")
    dtype = next(model.parameters()).dtype
    eye_v, eye_p = torch.eye(vocab, dtype=dtype), torch.eye(n_pos, dtype=dtype)
    return torch.cat([eye_v[ids], eye_p[: ids.shape[1]].expand(ids.shape[0], -1, -1)], -1)


def load_lm(path: str | Path) -> ICLTransformer:
    """A small LM written by ``train_lm``."""
    model, doc, _ = read_checkpoint(path)
    if "bos" not in doc.get("meta", {}):
        raise FileFormatError(f"{path} is not a small LM of tokenpatch.models.lm (no BOS in its record)")
    return model
