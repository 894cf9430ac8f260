"""Every causal LM that ``transformers`` registers is patched exactly or refused with a clear error.

``tests/test_hf.py`` checks exactness (float64, every layer and the logits to 1e-12; generation,
trajectories, thought patches, ``functional_call``/``apply``/save) on one tiny model per block design
(``conftest.CONFIGS``). This file walks the registry: a ``model_type`` whose default config maps to a
``Family`` must have its design among those tested; every other one must be refused with
``UnsupportedModelError`` before anything runs. A new ``transformers`` release that adds a family
lands in the second group until someone adds its design and a tiny model of it.
"""

from __future__ import annotations

import logging
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import tokenpatch as tp
from tokenpatch.arch.hf_modules import HFModules

T = pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import CONFIGS  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402


def design(config) -> str | None:
    """The ``Family`` record tokenpatch picks for a model of ``config`` (``None``: refused)."""
    family = HFModules.family(types.SimpleNamespace(config=config))
    return None if family is None else family.name


TESTED = {(config().model_type, design(config())) for config in CONFIGS.values()}
# a mixture of experts' plain-MLP layers have their own record (MoE.dense), tested with the model's
DENSE = {
    f.moe.dense for f in tp.arch.FAMILIES if f.moe is not None and f.moe.dense and f.name in {n for _, n in TESTED}
}


def default_config(model_type: str):
    """The registry's default config of ``model_type``, or ``None`` where transformers cannot make one."""
    try:
        return T.AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - transformers' own validation (a composite config without its parts)
        return None


def test_every_supported_design_is_tested_on_a_tiny_model():
    assert {name for _, name in TESTED} | DENSE == {f.name for f in tp.arch.FAMILIES}


@pytest.mark.filterwarnings("ignore")
def test_every_causal_lm_in_transformers_is_exact_or_refused():
    logging.disable(logging.WARNING)  # default configs of 200 families: transformers' notes about them
    try:
        refused, built, patched, untested = 0, 0, 0, []
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            config = default_config(model_type)
            if config is None:
                continue
            name = design(config)
            if name is not None:  # patched: the design must be one tests/test_hf.py checks to 1e-12
                patched += 1
                if (config.model_type, name) not in TESTED:
                    untested.append((model_type, name))
                continue
            try:  # the real class, on the meta device (no memory): refused before anything runs
                with torch.device("meta"), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = T.AutoModelForCausalLM.from_config(config).eval()
                built += 1
            except Exception:  # noqa: BLE001 - transformers cannot build its own default config: a shell with it
                model = nn.Module()
                model.config = config
            with pytest.raises(tp.UnsupportedModelError, match="model_type"):
                tp.token_patch(model, torch.zeros(1, 3, dtype=torch.long))
            refused += 1
    finally:
        logging.disable(logging.NOTSET)
    assert not untested, f"designs no tiny model tests: {untested} (add a config to tests/conftest.py CONFIGS)"
    assert patched + refused > 180 and built > 0.8 * refused  # the walk reached the registry, mostly real classes


def test_a_known_type_in_an_unsupported_configuration_is_refused_by_name():
    """Falcon's new decoder architecture without parallel attention has no design here (transformers
    itself cannot run it): the error names the model_type and its supported designs."""
    config = T.FalconConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=11)
    config.new_decoder_architecture, config.parallel_attn = True, False
    shell = nn.Module()
    shell.config = config
    with pytest.raises(tp.UnsupportedModelError, match=r"configuration of model_type 'falcon'.*falcon_parallel"):
        tp.token_patch(shell, torch.zeros(1, 3, dtype=torch.long))


def test_hyperclovax_with_a_residual_multiplier_is_refused_by_its_design():
    """HyperCLOVA X's norm after the MLP is patched in its scale only where the residual multiplier is 1
    (the output shift through a norm times a constant is not derived): any other multiplier is refused
    before anything runs, naming the model_type and the design it would have."""
    model = tp.testing.tiny_hf_model("hyperclovax", residual_multiplier=0.5)
    with pytest.raises(tp.UnsupportedModelError, match=r"configuration of model_type 'hyperclovax'.*hyperclovax"):
        tp.token_patch(model, torch.zeros(1, 3, dtype=torch.long) + 5)


def test_doge_with_its_mixture_of_experts_is_refused_by_its_design():
    """Doge's mixture of experts (``is_moe``) routes a token on router logits reshaped across tokens, so its
    experts depend on other tokens: only the dense Doge is patched; the other is refused before anything
    runs, naming the model_type and the design it would have."""
    model = tp.testing.tiny_hf_model("doge", is_moe=True, num_experts=16, num_experts_per_tok=2)
    with pytest.raises(tp.UnsupportedModelError, match=r"configuration of model_type 'doge'.*doge"):
        tp.token_patch(model, torch.zeros(1, 3, dtype=torch.long) + 5)


def test_the_docs_table_has_a_row_for_every_tiny_model():
    """``docs/hugging-face.md``'s family table (``python benchmarks/hf_families.py --table``) has a row for
    every tiny model the tests run (its first column)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "hugging-face.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")}
    assert sorted(set(CONFIGS) - rows) == []
