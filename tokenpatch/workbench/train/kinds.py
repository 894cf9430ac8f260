"""The linear-regression models whose contextual layers are ``transformers``' own mixers (``models.hf_layers``;
``docs/dynamics.md``, section 5): one per layer kind and a hybrid, one recipe, only the mixer differing.

    name        mixer of every block                               as in
    llama       softmax attention with rotary positions            Llama
    deltanet    Gated DeltaNet                                     Qwen3-Next, Qwen3.5
    mamba2      Mamba 2 selective scan                             Mamba 2, Nemotron-H, Bamba
    rg_lru      real-gated linear recurrence                       RecurrentGemma
    short_conv  gated short convolution                            LFM2
    hybrid      Gated DeltaNet, with attention in every 4th block  Qwen3.5 (3 linear to 1 full)

Four Pre-LN blocks of width 64 (4 heads, MLP 256), Adam on fresh tasks of the default task (D = 4,
16 context pairs, noise 0.1), 2000 steps of 64 tasks: smaller than the ten-block toy models because
the reference PyTorch scans of Gated DeltaNet and Mamba 2 are slow on a CPU (pad 17 tokens to a chunk
of 64 or 32). The weights ship in ``tokenpatch/models/data/`` (``models.icl.SHIPPED_TRANSFORMERS``);
``tokenpatch reproduce --full`` trains them again with ``train_kind``.
"""

from __future__ import annotations

from pathlib import Path

from tokenpatch.models.icl import SHIPPED_TRANSFORMERS, ICLConfig, ICLTransformer, read_checkpoint, save_model
from tokenpatch.tasks.linreg import DEFAULT_TASK
from tokenpatch.workbench.train.linreg import TrainConfig, train

__all__ = ["KINDS", "KINDS_TRAIN", "train_kind", "weights_only"]

_SHAPE = dict(d_in=DEFAULT_TASK.d_in, d_out=1, d_model=64, n_layers=4, n_heads=4, norm="pre")
KINDS = {
    "llama": ICLConfig(**_SHAPE, layer="llama"),
    "deltanet": ICLConfig(**_SHAPE, layer="gated_deltanet"),
    "mamba2": ICLConfig(**_SHAPE, layer="mamba2"),
    "rg_lru": ICLConfig(**_SHAPE, layer="rg_lru"),
    "short_conv": ICLConfig(**_SHAPE, layer="short_conv"),
    "hybrid": ICLConfig(**_SHAPE, layer="gated_deltanet", interleave="llama", interval=4),
}
assert set(KINDS) == set(SHIPPED_TRANSFORMERS)
KINDS_TRAIN = TrainConfig(steps=2000, batch_size=64, warmup=50, checkpoint_every=250)


def train_kind(name: str, out: str | Path, progress: bool | None = None) -> ICLTransformer:
    """Train (or resume) the model ``name`` of ``KINDS`` with ``KINDS_TRAIN`` into the run file ``out``."""
    return train(out, KINDS[name], DEFAULT_TASK, KINDS_TRAIN, progress=progress)


def weights_only(run: str | Path, dest: str | Path) -> None:
    """Write the finished run ``run`` as a model file ``dest``: the weights and the training record
    (recipe, loss history, evaluation), without the optimizer and data-stream state."""
    model, doc, _ = read_checkpoint(run)
    save_model(model, dest, meta=doc["meta"])
