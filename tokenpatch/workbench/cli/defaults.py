"""The library values the parser shows, written out: choices, defaults and file kinds.

Their homes (``tokenpatch.models``, ``tokenpatch.workbench.train``, ``tokenpatch.tasks.markov``)
import torch, and the command line parses and checks its arguments before torch loads.
``tests/test_cli_errors.py`` checks that every value here is the library's.
"""

from __future__ import annotations

__all__ = [
    "LAYERS",
    "HEADED_LAYERS",
    "HF_LAYERS",
    "NORMS",
    "MODEL_FORMAT",
    "PATCH_FORMAT",
    "LORA_CONFIG",
    "LINREG_TASK",
    "LINREG_MODEL",
    "LINREG_TRAIN",
    "MARKOV_TASK",
    "MARKOV_MODEL",
    "MARKOV_TRAIN",
]

LAYERS = ("gru", "linear", "lstm", "rnn", "softmax")  # sorted(tokenpatch.models.layers.LAYERS)
# sorted(tokenpatch.models.hf_layers.HF_LAYERS): transformers' own mixers
HF_LAYERS = ("gated_deltanet", "llama", "mamba2", "rg_lru", "short_conv")
HEADED_LAYERS = ("softmax", "linear", *HF_LAYERS)  # layers whose d_model must divide into heads (ICLConfig)
NORMS = ("none", "pre", "post")  # tokenpatch.models.icl.NORMS
MODEL_FORMAT = "tokenpatch.model/1"  # tokenpatch.models.icl.MODEL_FORMAT
PATCH_FORMAT = "tokenpatch.patch/1"  # tokenpatch.patch_files.PATCH_FORMAT
LORA_CONFIG = "adapter_config.json"  # tokenpatch.lora.CONFIG_FILE: a peft LoRA adapter folder's config

# tokenpatch.workbench.train.linreg: DEFAULT_TASK, DEFAULT_MODEL, DEFAULT_TRAIN
LINREG_TASK = {"dim": 4, "n_context": 16, "noise": 0.1}
LINREG_MODEL = {"d_model": 64, "n_layers": 10, "n_heads": 4, "layer": "softmax", "norm": "pre"}
LINREG_TRAIN = {"steps": 2000, "batch_size": 256, "lr": 1e-3, "seed": 0, "checkpoint_every": 250}

# tokenpatch.tasks.markov.MarkovTask(), tokenpatch.models.markov.MarkovModel(), tokenpatch.workbench.train.markov.MarkovTrain()
MARKOV_TASK = {"states": 10, "alpha": 0.25, "length": 64}
MARKOV_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 1}
MARKOV_TRAIN = {"steps": 4000, "batch_size": 32, "lr": 1e-3, "seed": 0}
