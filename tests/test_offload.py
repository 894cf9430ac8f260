"""Models split by ``accelerate``: layers offloaded to disk (and, with a GPU, split across CUDA and
CPU) are patched exactly as the same model held whole.

A ``device_map`` with ``"disk"`` entries leaves those layers' parameters on the ``meta`` device,
loaded by ``accelerate``'s hooks for each forward; tokenpatch's forwards run through the hooks and
what it reads outside a forward, or in a hook around one (a LoRA's ``B = W d``, the stacked experts'
hidden states), comes from the offload (``tokenpatch.offload``). ``tp.apply`` cannot write into
weights that are not there: it refuses in one line and names ``functional_call``. A LoRA of stacked
experts has no peft form: refused in one line, as for the model held whole.

Each family is split once per module (``models``): the tests only read the models.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tokenpatch as tp
from tokenpatch.baselines import pad_left, recording_heads, task_vectors
from tokenpatch.baselines.vectors import _norm_gain
from tokenpatch.dynamics.online_sgd import matrix_deltas
from tokenpatch.testing import MOE, float64_norms, tiny_hf_model

T = pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
pytest.importorskip("accelerate", reason="accelerate (part of the Hugging Face extra) is not installed")
peft = pytest.importorskip("peft")
from conftest import ids  # noqa: E402

# one design per output-side kind: a matrix (Llama), a matrix and a norm scale (Gemma 3), a bias (GPT-2),
# stacked experts (Qwen3-MoE, with a plain-MLP layer; Mixtral); recurrent layers beside attention (LFM2, Qwen3-Next)
# and alone (Mamba, no MLP); lightning attention and a normalised residual stream (MiniMax); a multimodal
# model's decoder (Gemma 3's, under language_model)
NAMES = [
    "llama",
    "gemma3",
    "gemma3_multimodal",
    "gpt2",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "lfm2",
    "qwen3_next",
    "mamba",
    "recurrent_gemma",
    "minimax",
]


def split(name: str, folder, device_map: dict | None = None, whole=None):
    """``(model held whole, the same weights loaded with layers 1-2 on disk)``, float64, eval mode."""
    whole = tiny_hf_model(name) if whole is None else whole
    whole.save_pretrained(folder / "model")
    base = whole.base_model_prefix
    # the layers' path in the base model: "layers", GPT-2's "h", a multimodal model's "language_model.layers"
    outer, _, layers = tp.arch.HFAdapter.family(whole).layers.rpartition(".")
    holder, at = (whole.base_model.get_submodule(outer), f"{base}.{outer}") if outer else (whole.base_model, base)
    device_map = device_map or {
        **{f"{at}.{layers}.{i}": "disk" if i else "cpu" for i in range(3)},
        **{f"{at}.{m}": "cpu" for m, _ in holder.named_children() if m != layers},
        **{f"{base}.{m}": "cpu" for m, _ in whole.base_model.named_children() if outer and m != outer},
        "lm_head": "cpu",
    }
    extra = {"experts_implementation": "eager"} if name in MOE else {}  # as tiny_hf_model's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split_model = T.AutoModelForCausalLM.from_pretrained(
            folder / "model", device_map=device_map, offload_folder=folder / "offload", dtype=torch.float64, **extra
        ).eval()
    split_model.generation_config.eos_token_id = None
    assert any(p.device.type == "meta" for p in split_model.parameters())  # really offloaded
    return whole, split_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(name)``: ``split(name, ...)``, made once per module (never change these models)."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = split(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def thoughts(models):
    """``thoughts(name)``: ``(thought patch of the offloaded model, of the model held whole)``, made once."""
    made = {}

    def get(name: str):
        if name not in made:
            with float64_norms():
                made[name] = tuple(_thought(m) for m in reversed(models(name)))
        return made[name]

    return get


@pytest.fixture
def f64():
    with float64_norms():
        yield


def _thought(model, seed: int = 4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.ThoughtWarning)  # 6 calibration queries: rank-deficient, fine here
        return tp.thought_patch(model, ids(1, 8, seed)[0], ids(6, 3, seed + 1), progress=False)


def _assert_same_deltas(patch, want) -> None:
    want = want.dense()
    got = patch.dense()
    assert got.keys() == want.keys()
    for key, delta in got.items():
        assert delta.device.type == "cpu", key  # the execution device, never meta
        torch.testing.assert_close(delta, want[key], rtol=0, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_an_offloaded_model_gets_the_patch_of_the_whole_one(name, models, f64):
    whole, model = models(name)
    x = ids(2, 10)
    patch = tp.token_patch(model, x, query=[-1, 4])
    _assert_same_deltas(patch, tp.token_patch(whole, x, query=[-1, 4]))
    assert tp.verify(model, patch, x).max_abs <= 1e-12
    stripped = tp.strip_context(model, x[:, :5])
    want = whole(x[:, :5]).logits[:, -1]
    for one in (tp.token_patch(model, x[:, :5]), tp.token_patch(whole, x[:, :5])):  # its own, the whole's
        logits = tp.functional_call(model, one, **stripped).logits[:, -1]
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_generate_trajectory_and_thought_patch_run_through_the_offload(name, models, thoughts, f64):
    whole, model = models(name)
    x = ids(2, 9)
    gen = tp.generate(model, x, max_new_tokens=3)
    assert torch.equal(gen.tokens, whole.generate(x, max_new_tokens=3, do_sample=False)[:, 9:])
    assert float(gen.logit_error.max()) <= 1e-12
    traj = tp.trajectory(model, x[:1], query=-1)
    _assert_same_deltas(traj.patch(5), tp.trajectory(whole, x[:1], query=-1).patch(5))
    fit, want = thoughts(name)
    _assert_same_deltas(fit.patch, want.patch)
    q = ids(3, 5, seed=7)
    torch.testing.assert_close(
        tp.functional_call(model, fit.patch, q).logits,
        tp.functional_call(whole, fit.patch, q).logits,
        rtol=0,
        atol=1e-12,
    )


@torch.no_grad()
@pytest.mark.parametrize("name", NAMES)
def test_save_lora_of_an_offloaded_model_is_the_whole_ones(name, models, thoughts, tmp_path, f64):
    """The LoRA written from the offloaded model (``B = W d`` read from the offload), loaded by peft
    onto the unmodified model held whole, gives ``functional_call``'s logits; stacked experts: refused."""
    whole, model = models(name)
    fit = thoughts(name)[0]
    if name in MOE:
        with pytest.raises(tp.UnsupportedModelError, match=r"experts\.gate_up_proj .* a LoRA cannot target") as info:
            tp.save_lora(model, fit, tmp_path / "lora")
        assert "\n" not in str(info.value) and not (tmp_path / "lora").exists()
        return
    tp.save_lora(model, fit, tmp_path / "lora")
    q = ids(3, 5, seed=7)
    want = tp.functional_call(whole, fit.patch, q).logits
    assert float((want - whole(q).logits).abs().max()) > 1e-2  # the patch changes the model
    got = peft.PeftModel.from_pretrained(copy.deepcopy(whole), tmp_path / "lora").eval()(q).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("name", ["gpt2"])
def test_tied_embeddings_on_disk(name, tmp_path, f64):
    """The tied embedding table and output head offloaded with layers 1-2: inputs go where the table's
    hook runs it, and every result is the whole model's."""
    whole = tiny_hf_model(name)
    assert whole.config.tie_word_embeddings
    base, layers = whole.base_model_prefix, "h" if name == "gpt2" else "layers"
    table = f"{base}.{'wte' if name == 'gpt2' else 'embed_tokens'}"
    device_map = {
        **{f"{base}.{layers}.{i}": "disk" if i else "cpu" for i in range(3)},
        **{f"{base}.{m}": "cpu" for m, _ in whole.base_model.named_children() if m != layers},
        table: "disk",
        "lm_head": "disk",
    }
    whole, model = split(name, tmp_path, device_map, whole)
    assert model.get_input_embeddings().weight.device.type == "meta"
    x = ids(2, 9)
    patch = tp.token_patch(model, x, query=[-1, 4])
    _assert_same_deltas(patch, tp.token_patch(whole, x, query=[-1, 4]))
    assert tp.verify(model, patch, x).max_abs <= 1e-12
    gen = tp.generate(model, x, max_new_tokens=2)
    assert torch.equal(gen.tokens, whole.generate(x, max_new_tokens=2, do_sample=False)[:, 9:])
    assert float(gen.logit_error.max()) <= 1e-12
    _assert_same_deltas(_thought(model).patch, _thought(whole).patch)
    prompted = pad_left([[1, 5, 6, 7, 8], [1, 9, 4]], 0)  # a baseline: its inputs go where the table runs
    got, want = task_vectors(model, prompted).vectors, task_vectors(whole, prompted).vectors
    assert all(torch.equal(got[k], want[k]) for k in want)


@torch.no_grad()
def test_a_baselines_norm_gain_reads_the_offloaded_norm(models, f64):
    """The function-vector baseline's gain through Gemma 3's norm after ``o_proj``, on a layer on disk."""
    gains = []
    for model in reversed(models("gemma3")):  # the offloaded model, then the whole one
        with recording_heads(model) as rec:
            model(ids(2, 8))
        gains.append(_norm_gain(model, 2, rec[2]))
    assert gains[0].device.type == "cpu"  # not meta
    torch.testing.assert_close(gains[0], gains[1], rtol=0, atol=1e-12)


@torch.no_grad()
def test_matrix_deltas_read_the_weights_from_the_offload(models):
    """``W D`` of an input change (the online-SGD comparison's weight deltas) on the offloaded layers."""
    whole, model = models("llama")
    patch = tp.token_patch(whole, ids(2, 8), query=[-1, 4])
    got, want = matrix_deltas(model, patch), matrix_deltas(whole, patch)
    assert got.keys() == want.keys() and any(".layers.2." in k for k in got)
    for key, delta in got.items():
        torch.testing.assert_close(delta.dense(), want[key].dense(), rtol=0, atol=1e-12)


@torch.no_grad()
def test_apply_refuses_weights_that_are_on_disk(models):
    _, model = models("llama")
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
