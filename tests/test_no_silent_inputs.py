"""No silent wrong answer on ill-formed inputs (issue 20, items 1, 7, 9, 10): padding is refused or
handled the same way in every mode, ``remove=`` takes index lists as the docs show, models and inputs
the patch cannot be made for are refused by ``token_patch`` with one line, and a patch says the dtype
its model computed in. Tiny random float64 Hugging Face models (``conftest.build``)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import CONFIGS, build, ids, random_model

import tokenpatch as tp

MODES = {
    "alone": {},
    "keep_bos": {"keep_bos": True},
    "remove slice": {"remove": slice(1, 3)},
    "remove list": {"remove": [1, 2]},
    "remove mask": {"remove": torch.tensor([False, True, True, False, False, False])},
}


def _padded(side: str, batch: int = 3, length: int = 6, pad: int = 2) -> dict:
    """Token ids with row 1 padded by ``pad`` zeros on ``side``, as a tokenizer returns them."""
    x = ids(batch, length)
    mask = torch.ones_like(x)
    where = slice(length - pad, None) if side == "right" else slice(0, pad)
    x[1, where] = 0
    mask[1, where] = 0
    return {"input_ids": x, "attention_mask": mask}


def _close(a: tp.Patch, b: tp.Patch) -> float:
    """The largest difference between the dense deltas of two patches with the same keys."""
    da, db = a.dense(), b.dense()
    assert set(da) == set(db)
    return max(float((da[k] - db[k]).abs().max()) for k in da)


# ----------------------------------------------------------------------------- 1. padding in every mode
@pytest.mark.parametrize("mode", sorted(MODES))
def test_right_padding_is_refused_the_same_way_in_every_mode(mode):
    model, enc = build("llama"), _padded("right")
    kw = MODES[mode]
    with pytest.raises(tp.InputError, match=r"padding in batch rows \[1\]: pad on the left"):
        tp.token_patch(model, enc, **kw)
    with pytest.raises(tp.InputError, match=r"pad on the left"):
        tp.strip_context(model, enc, **kw)
    if "remove" in kw:  # verify, given a patch made on the same tokens without padding
        patch = tp.token_patch(model, enc["input_ids"], **kw)
        with pytest.raises(tp.InputError, match=r"pad on the left"):
            tp.verify(model, patch, enc)


def test_keep_bos_on_a_left_padded_row_is_refused():
    """Position 0 of a left-padded row is padding, not its first token: keeping it would keep nothing."""
    with pytest.raises(tp.InputError, match=r"keep_bos=True keeps position 0, which is padding in batch rows \[1\]"):
        tp.token_patch(build("llama"), _padded("left"), keep_bos=True)


@pytest.mark.parametrize("remove", [slice(3, 5), [3, 4]])
def test_a_removed_chunk_on_a_left_padded_batch_is_the_rows_own(remove):
    """Handled: a left-padded row's patch with a chunk removed is the one it gets alone, the chunk
    shifted by its padding (float64, to ~1e-12)."""
    model, enc = build("llama"), _padded("left")
    patch = tp.token_patch(model, enc, remove=remove)
    assert tp.verify(model, patch, enc).max_abs <= 1e-10
    alone = tp.token_patch(model, enc["input_ids"][1:2, 2:], remove=slice(1, 3))
    assert _close(patch[1:2], alone) <= 1e-10


@pytest.mark.parametrize("value", [0.5, 2, -1, float("nan")])
def test_a_mask_that_is_not_0_or_1_is_refused_not_cast(value):
    x = ids(2, 5)
    mask = torch.ones(2, 5, dtype=torch.float64)
    mask[1, 0] = value
    with pytest.raises(tp.InputError, match=r"attention_mask must hold 0 \(padding\) and 1 \(token\) only"):
        tp.token_patch(build("llama"), {"input_ids": x, "attention_mask": mask})


def test_a_mask_that_is_not_a_tensor_is_named_as_such():
    with pytest.raises(
        tp.InputError, match=r"attention_mask must be a tensor of the shape of input_ids \(2, 5\), got list"
    ):
        tp.token_patch(build("llama"), {"input_ids": ids(2, 5), "attention_mask": [[1] * 5] * 2})


def test_a_boolean_or_float_mask_of_0_and_1_is_accepted():
    model, enc = build("llama"), _padded("left")
    want = tp.token_patch(model, enc)
    for mask in (enc["attention_mask"].bool(), enc["attention_mask"].double()):
        got = tp.token_patch(model, {**enc, "attention_mask": mask})
        assert _close(got, want) == 0


# ----------------------------------------------------------------------------- 10. remove= index lists
@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_neox"])
def test_remove_takes_a_list_of_indices_exactly(name):
    model, x = build(name), ids(2, 7)
    listed = tp.token_patch(model, x, query=[5, 6], remove=[1, 2, 3])
    assert tp.verify(model, listed, x).max_abs <= 1e-10
    assert _close(listed, tp.token_patch(model, x, query=[5, 6], remove=slice(1, 4))) == 0
    assert listed.plan.describe()["removed"] == [1, 2, 3]
    # the docs' one-token removal (docs/dynamics.md): an int list, a tensor of indices, a range
    for same in ([-3], torch.tensor([4]), range(4, 5)):
        assert _close(tp.token_patch(model, x, remove=same), tp.token_patch(model, x, remove=slice(4, 5))) == 0


def test_the_docs_increment_is_remove_a_list_of_one_index():
    """docs/dynamics.md and docs/hugging-face.md: ``traj.step(i)`` is ``token_patch(prefix_i, remove=[i - 1])``."""
    model, x = build("llama"), ids(2, 6)
    traj = tp.trajectory(model, x, steps=True)
    for i in range(1, traj.query + 1):
        prefix = traj.prefix_inputs(x, i)
        assert _close(traj.step(i), tp.token_patch(model, prefix, remove=[i - 1])) <= 1e-12


def test_remove_index_lists_on_our_models():
    model = random_model(tp.ICLConfig(d_in=5, d_model=8, n_layers=3, n_heads=2, norm="pre"), seed=1)
    x = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    listed = tp.token_patch(model, x, query="all", remove=[0, 2])
    assert tp.verify(model, listed, x).max_abs <= 1e-10
    mask = torch.tensor([True, False, True, False, False, False, False])
    assert _close(listed, tp.token_patch(model, x, query="all", remove=mask)) == 0


@pytest.mark.parametrize(
    "remove,message",
    [
        ([1, 1], r"remove indices repeat: \[1, 1\]"),
        ([2, -5], r"remove indices repeat: \[2, 2\]"),
        ([7], r"remove index 7 is outside the sequence of length 7"),
        ([1, 2.0], r"remove indices must be integers, got 2.0"),
        ([], r"the removed chunk \[\] is empty"),
        (list(range(7)), r"remove covers every position, the query included"),
    ],
)
def test_bad_remove_index_lists_get_one_line(remove, message):
    with pytest.raises(tp.InputError, match=message):
        tp.token_patch(build("llama"), ids(2, 7), remove=remove)


# ----------------------------------------------------------------------------- 7. clear errors
@pytest.mark.parametrize(
    "cls,config",
    [
        ("LlamaForSequenceClassification", "llama"),
        ("LlamaModel", "llama"),
        ("GPT2Model", "gpt2"),
        ("GPT2ForSequenceClassification", "gpt2"),
        ("Qwen2ForTokenClassification", "qwen2"),
    ],
)
def test_models_that_are_not_causal_lms_are_refused_by_token_patch(cls, config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = getattr(transformers, cls)(CONFIGS[config]()).double().eval()
    with pytest.raises(tp.UnsupportedModelError, match=rf"{cls} is not a causal language model"):
        tp.token_patch(model, ids(2, 5))
    with pytest.raises(tp.UnsupportedModelError, match=rf"{cls} is not a causal language model"):
        tp.thought_patch(model, ids(1, 5)[0], ids(8, 3), progress=False)  # was fitted without a word


def test_thought_patch_refuses_a_model_in_training_mode():
    """Like ``token_patch``: with dropout the with-prompt targets and the fit's passes differ."""
    with pytest.raises(tp.InputError, match=r"the model is in training mode .*call model.eval\(\)"):
        tp.thought_patch(build("llama").train(), ids(1, 5)[0], ids(8, 3), progress=False)


@pytest.mark.parametrize("name", ["gpt2", "opt"])  # 64 positions; OPT's table has 2 more rows (ids offset by 2)
def test_positions_past_the_learned_position_table_are_refused(name):
    model = build(name)
    with pytest.raises(tp.InputError, match=r"position id 64 is past the model's learned position table"):
        tp.token_patch(model, ids(1, 65))
    with pytest.raises(tp.InputError, match=r"position id 80 is past"):
        tp.token_patch(model, {"input_ids": ids(1, 4), "position_ids": torch.tensor([[0, 1, 2, 80]])})
    assert tp.verify(model, tp.token_patch(model, ids(1, 64)), ids(1, 64)).max_abs <= 1e-10  # the last one fits


def test_generation_past_the_learned_position_table_is_refused_before_it_starts():
    """``tp.generate`` ran into a raw ``IndexError`` of the position embedding at the step that left
    the table; the whole run is checked before the first step."""
    model = build("gpt2")  # n_positions=64: a 60-token prompt may run 5 steps (positions 59..63)
    with pytest.raises(
        tp.InputError,
        match=r"60 positions and max_new_tokens=6 run past the model.s 64 positions: pass max_new_tokens <= 5",
    ):
        tp.generate(model, ids(1, 60), max_new_tokens=6, progress=False)
    assert tp.generate(model, ids(1, 60), max_new_tokens=5, progress=False).tokens.shape == (1, 5)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)])
def test_empty_batches_are_refused(shape):
    with pytest.raises(tp.InputError, match=re.escape(f"input_ids are empty (shape {shape})")):
        tp.token_patch(build("llama"), torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize(
    "share", ["model.layers.{}.mlp", "model.layers.{}.post_attention_layernorm", "model.layers.{}.mlp.down_proj"]
)
def test_a_module_shared_by_two_layers_is_refused(share):
    """A shared norm is not patched, but the hooks on it fire once per layer and mix their records
    (verify gave max abs 0.47 in float64 before this check)."""
    model = build("llama")
    parent, _, attr = share.format(2).rpartition(".")
    setattr(model.get_submodule(parent), attr, model.get_submodule(share.format(0)))
    with pytest.raises(tp.UnsupportedModelError, match=r"layers 0 and 2 share one module"):
        tp.token_patch(model, ids(2, 5))


def test_a_mlp_shared_by_two_layers_is_refused_by_token_patch():
    model = build("llama")
    model.model.layers[2].mlp = model.model.layers[0].mlp
    with pytest.raises(tp.UnsupportedModelError, match=r"layers 0 and 2 share one module"):
        tp.token_patch(model, ids(2, 5))
    ours = random_model(tp.ICLConfig(d_in=5, d_model=8, n_layers=3, n_heads=2, norm="pre"), seed=1)
    ours.blocks[1].mlp = ours.blocks[0].mlp
    with pytest.raises(tp.UnsupportedModelError, match=r"layers 0 and 1 share one module"):
        tp.token_patch(ours, torch.randn(2, 4, 5, dtype=torch.float64))


@pytest.mark.parametrize("shape,query", [((2, 1), -1), ((2, 2), -1), ((2, 3), [1, 2]), ((2, 5), 0), ((2, 4), "all")])
def test_keep_bos_with_nothing_to_remove_is_refused(shape, query):
    with pytest.raises(tp.InputError, match=r"keep_bos=True: there is no context to remove"):
        tp.token_patch(build("llama"), ids(*shape), query, keep_bos=True)


# ----------------------------------------------------------------------------- 9. the patch's dtype
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_patch_says_the_dtype_its_model_computed_in(dtype):
    model, x = build("llama").to(dtype), ids(2, 6)
    patch = tp.token_patch(model, x)
    assert patch.dtype == dtype and f"dtype={dtype}" in repr(patch)
    assert patch.meta["model_dtype"] == str(dtype).removeprefix("torch.")
    assert tp.verify(model, patch, x).ok()
    ours = random_model(tp.ICLConfig(d_in=5, d_model=8, n_layers=2, n_heads=2, norm="pre"), seed=1, dtype=dtype)
    assert tp.token_patch(ours, torch.randn(2, 4, 5).to(dtype)).dtype == dtype
