"""Models split by ``accelerate``: layers offloaded to disk (and, with a GPU, split across CUDA and
CPU) are patched exactly as the same model held whole.

A ``device_map`` with ``"disk"`` entries leaves those layers' parameters on the ``meta`` device,
loaded by ``accelerate``'s hooks for each forward; tokenpatch's forwards run through the hooks and
what it reads outside a forward comes from the offload (``tokenpatch.offload``). ``tp.apply`` cannot
write into weights that are not there: it refuses in one line and names ``functional_call``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tokenpatch as tp
from tokenpatch.testing import float64_norms, tiny_hf_model

T = pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
pytest.importorskip("accelerate", reason="accelerate (part of the Hugging Face extra) is not installed")
from conftest import ids  # noqa: E402

# one design per output-side kind: a matrix (Llama), a matrix and a norm scale (Gemma 3), a bias (GPT-2)
NAMES = ["llama", "gemma3", "gpt2"]


def split(name: str, folder, device_map: dict | None = None):
    """``(model held whole, the same weights loaded with layers 1-2 on disk)``, float64, eval mode."""
    whole = tiny_hf_model(name)
    whole.save_pretrained(folder / "model")
    base = whole.base_model_prefix
    layers = "h" if name == "gpt2" else "layers"
    device_map = device_map or {
        **{f"{base}.{layers}.{i}": "disk" if i else "cpu" for i in range(3)},
        **{f"{base}.{m}": "cpu" for m, _ in whole.base_model.named_children() if m != layers},
        "lm_head": "cpu",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split_model = T.AutoModelForCausalLM.from_pretrained(
            folder / "model", device_map=device_map, offload_folder=folder / "offload", dtype=torch.float64
        ).eval()
    split_model.generation_config.eos_token_id = None
    assert any(p.device.type == "meta" for p in split_model.parameters())  # really offloaded
    return whole, split_model


@pytest.fixture
def f64():
    with float64_norms():
        yield


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_an_offloaded_model_gets_the_patch_of_the_whole_one(name, tmp_path, f64):
    whole, model = split(name, tmp_path)
    x = ids(2, 10)
    patch = tp.token_patch(model, x, query=[-1, 4])
    want = tp.token_patch(whole, x, query=[-1, 4]).dense()
    for key, delta in patch.dense().items():
        assert delta.device.type == "cpu", key  # the execution device, never meta
        torch.testing.assert_close(delta, want[key], rtol=0, atol=1e-12)
    assert tp.verify(model, patch, x).max_abs <= 1e-12
    stripped = tp.strip_context(model, x[:, :5])
    one = tp.token_patch(model, x[:, :5])
    logits = tp.functional_call(model, one, **stripped).logits[:, -1]
    torch.testing.assert_close(logits, whole(x[:, :5]).logits[:, -1], rtol=0, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_generate_trajectory_and_thought_patch_run_through_the_offload(name, tmp_path, f64):
    whole, model = split(name, tmp_path)
    x = ids(2, 9)
    gen = tp.generate(model, x, max_new_tokens=6)
    assert torch.equal(gen.tokens, whole.generate(x, max_new_tokens=6, do_sample=False)[:, 9:])
    assert float(gen.logit_error.max()) <= 1e-12
    traj = tp.trajectory(model, x[:1], query=-1)
    want = tp.trajectory(whole, x[:1], query=-1)
    for key, delta in traj.patch(5).dense().items():
        torch.testing.assert_close(delta, want.patch(5).dense()[key], rtol=0, atol=1e-12)
    prompt, query = ids(1, 12, seed=4)[0], ids(1, 1, seed=5)
    with pytest.warns(tp.ThoughtWarning, match="rank-deficient"):
        fit = tp.thought_patch(model, prompt, query, progress=False)
    got = tp.functional_call(model, fit.patch, query).logits[:, -1]
    assert float((got - whole(torch.cat([prompt[None], query], 1)).logits[:, -1]).abs().max()) <= 1e-10


@torch.no_grad()
def test_apply_refuses_weights_that_are_on_disk(tmp_path):
    _, model = split("llama", tmp_path)
    patch = tp.token_patch(model, ids(1, 6))
    with pytest.raises(tp.InputError, match=r"offloaded.*functional_call") as info:
        with tp.apply(model, patch):
            pass
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_a_model_split_across_cuda_and_cpu(name, tmp_path, f64):
    """Layer 0 on the GPU, layers 1-2 offloaded to CPU memory (run on the GPU), the rest on the GPU:
    every delta on its parameter's execution device, and the patch of the model held whole."""
    probe = tiny_hf_model(name)
    base, layers = probe.base_model_prefix, "h" if name == "gpt2" else "layers"
    device_map = {
        **{f"{base}.{layers}.{i}": "cpu" if i else 0 for i in range(3)},
        **{f"{base}.{m}": 0 for m, _ in probe.base_model.named_children() if m != layers},
        "lm_head": 0,
    }
    whole, model = split(name, tmp_path, device_map)
    x = ids(2, 10)
    patch = tp.token_patch(model, x.cuda(), query=[-1, 4])
    want = tp.token_patch(whole, x, query=[-1, 4]).dense()
    for key, delta in patch.dense().items():
        assert delta.device.type == "cuda", key
        torch.testing.assert_close(delta.cpu(), want[key], rtol=0, atol=1e-10)
    assert tp.verify(model, patch, x.cuda()).max_abs <= 1e-10
