"""Prompt baking (tokenpatch/baselines/baking.py): the gradient baseline trains a peft LoRA on KL to
the prompted model; what it returns is that LoRA as a patch, whose KL is the one it reports."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp

pytest.importorskip("transformers", reason="the Hugging Face extra is not installed")
pytest.importorskip("peft", reason="the lora extra (pip install 'tokenpatch[lora]') is not installed")
from conftest import build, ids  # noqa: E402

from tokenpatch.baselines.baking import bake  # noqa: E402


@torch.no_grad()
def _kl(model, prompt, calibration, patch) -> float:
    """``mean_j KL(p(. | prompt, q_<=j) || p_patched(. | BOS, q_<=j))``, written out."""
    total, n = 0.0, 0
    for q in calibration:
        with_prompt = model(torch.cat([prompt[None].expand(len(q), -1), q], 1)).logits[:, len(prompt) :]
        alone = torch.cat([prompt[None, :1].expand(len(q), -1), q], 1)
        with tp.apply(model, patch):
            without = model(alone).logits[:, 1:]
        p, logq = with_prompt.log_softmax(-1), without.log_softmax(-1)
        total += float((p.exp() * (p - logq)).sum())
        n += q.shape[0] * q.shape[1]
    return total / n


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_baking_lowers_the_kl_it_reports_and_leaves_the_model_alone(name, float64_gemma_norms):
    model = build(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt, calibration = ids(1, 10, seed=3)[0], [ids(4, 3, seed=4), ids(2, 5, seed=5)]
    (baked,) = bake(model, prompt, calibration, seconds=1e9, max_steps=6, rank=2, lr=1e-2)
    assert baked.steps == 6 and len(baked.losses) == 7
    assert baked.losses[-1] < 0.9 * baked.losses[0]
    keys = set(baked.patch)
    assert keys and all(k.endswith(".weight") and ".mlp." in k for k in keys)
    assert all(d.u.shape[-2] == 2 for d in baked.patch.values())  # rank 2: a LoRA's deltas
    # the patch is the adapter: its KL, measured here through tp.apply, is the last one reported
    assert abs(_kl(model, prompt, calibration, baked.patch) - baked.losses[-1]) <= 1e-9 * baked.losses[0]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # trained on a copy


def test_baking_on_top_of_a_thought_patch_starts_from_it():
    """The hybrid: the thought patch written in first, the LoRA trained on top (B = 0 at the start)."""
    model = build("llama")
    prompt, calibration = ids(1, 10, seed=3)[0], [ids(6, 3, seed=4)]
    thought = tp.thought_patch(model, prompt, calibration, ridge=0.1, keep_bos=True).patch
    (baked,) = bake(model, prompt, calibration, seconds=1e9, max_steps=3, rank=2, lr=1e-2, base=thought)
    assert abs(baked.losses[0] - _kl(model, prompt, calibration, thought)) <= 1e-9 * baked.losses[0]
    assert abs(_kl(model, prompt, calibration, baked.patch) - baked.losses[-1]) <= 1e-9 * baked.losses[0]
    assert baked.losses[-1] < baked.losses[0]


def test_baking_snapshots_each_budget_of_one_run():
    model = build("llama")
    prompt, calibration = ids(1, 8, seed=3)[0], [ids(3, 3, seed=4)]
    first, second = bake(model, prompt, calibration, seconds=[1e9, 1e-9], max_steps=2, rank=1)
    assert (first.steps, second.steps) == (0, 2) and first.losses == second.losses[:1]
    with pytest.raises(tp.InputError, match="seconds must be > 0"):
        bake(model, prompt, calibration, seconds=0)
