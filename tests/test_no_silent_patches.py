"""No silent wrong answer from a patch run on inputs it was not made for (issue 41, item 3): stacks and
sums of patches of different plans keep what each row needs, a ``keep_bos`` thought patch needs its
BOS, a token patch refuses another prompt's tokens, weights edited after a check or inside ``tp.apply``
are caught, and ill-formed inputs get one line. Tiny random float64 Hugging Face models
(``conftest.build``); exactness checked against the with-context forward itself."""

from __future__ import annotations

import pytest
import torch
from conftest import build, ids

import tokenpatch as tp


def _logits(model, patch, **inputs) -> torch.Tensor:
    return tp.functional_call(model, patch, **inputs).logits[:, -1].double()


def _alone(model, x, query: int) -> dict:
    """The no-context inputs of ``query`` alone, at its own position (what strip_context gives)."""
    return tp.strip_context(model, x, query=query)


# ----------------------------------------------------------------------------- stacks and sums of plans
@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_a_stack_of_patches_of_different_queries_keeps_each_rows_positions(family):
    """Before: the stack dropped the plans, ran without position ids and was off by 1.4e-2 (GPT-2),
    1.5e-2 (OPT). Now refused without them, exact with them, and each row keeps its own plan."""
    model, x = build(family), ids(1, 12)
    a, b = tp.token_patch(model, x, query=9), tp.token_patch(model, x, query=4)
    stack = tp.Patch.stack([a, b])
    assert stack.plan is None and stack[0].plan == a.plan and stack[1].plan == b.plan
    tokens = torch.cat([x[:, 9:10], x[:, 4:5]])
    with pytest.raises(tp.InputError, match=r"no position_ids were given"):
        tp.functional_call(model, stack, tokens)
    inputs = {"input_ids": tokens, "position_ids": torch.tensor([[9], [4]])}
    want = model(x).logits[0, [9, 4]].double()
    assert float((_logits(model, stack, **inputs) - want).abs().max()) <= 1e-12


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_a_sum_of_patches_of_different_plans_needs_position_ids(family, tmp_path):
    """Before: ``a + b`` dropped both plans and ran at position 0, off by 2e-2. A sum is the patch of no
    single input: every row keeps both plans, so a forward without position ids is refused (also after
    a round trip through a file)."""
    model, x = build(family), ids(1, 12)
    both = tp.token_patch(model, x, query=9) + tp.token_patch(model, x, query=4)
    assert both.plan is None and set(both.made_for()) == {both.plans[0][0], both.plans[0][1]}
    tp.save_patch(both, tmp_path / "sum.safetensors")
    for patch in (both, tp.load_patch(tmp_path / "sum.safetensors", model)):
        with pytest.raises(tp.InputError, match=r"no position_ids were given"):
            tp.functional_call(model, patch, x[:, 9:10])
        tp.functional_call(model, patch, **_alone(model, x, 9))  # the caller's positions: runs


# ----------------------------------------------------------------------------- a thought patch's BOS
@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")
def test_a_keep_bos_thought_patch_refuses_inputs_without_its_bos(tmp_path):
    """Before: run without the BOS it was fitted with, off by 0.197 (0.43 here) without a word."""
    model, prompt, query = build("llama"), ids(1, 10, seed=3)[0], ids(1, 4, seed=7)
    patch = tp.thought_patch(model, prompt, ids(6, 4, seed=4), keep_bos=True).patch
    assert patch.prefix == (int(prompt[0]),)
    tp.save_patch(patch, tmp_path / "thought.safetensors")
    for p in (patch, tp.load_patch(tmp_path / "thought.safetensors", model)):
        with pytest.raises(
            tp.InputError, match=r"begin with the token ids \[\d+\] \(a thought patch fitted with keep_bos"
        ):
            tp.functional_call(model, p, query)
        tp.functional_call(model, p, torch.cat([prompt[None, :1], query], 1))  # with it: runs


# ----------------------------------------------------------------------------- the tokens a patch was made for
@pytest.mark.parametrize("remove", [None, slice(2, 6)])
def test_a_token_patch_refuses_another_prompts_tokens(remove, tmp_path):
    """Before: ``functional_call(M, p, **strip_context(M, other_prompt))`` ran, off by 0.25 (0.70 here).
    The patch keeps a fingerprint of each no-context sequence's tokens; ``broadcast=True`` or
    ``any_length=True`` still run it on other tokens on purpose."""
    model, x, other = build("llama"), ids(2, 9), ids(2, 9, seed=5)
    patch = tp.token_patch(model, x, query=[6, 8], remove=remove)
    tp.save_patch(patch, tmp_path / "p.safetensors")
    for p in (patch, tp.load_patch(tmp_path / "p.safetensors", model)):
        own = tp.functional_call(model, p, **tp.strip_context(model, x, query=[6, 8], remove=remove))
        assert own.logits.isfinite().all()
        with pytest.raises(
            tp.InputError, match=r"input sequences \[.*\] hold other tokens than the ones this token patch"
        ):
            tp.functional_call(model, p, **tp.strip_context(model, other, query=[6, 8], remove=remove))
    kw = {"broadcast": True} if remove is None else {"any_length": True}
    tp.functional_call(model, patch, **tp.strip_context(model, other, query=[6, 8], remove=remove), **kw)
    # a row, a query, a stack and a sum keep the fingerprints that still hold
    assert torch.equal(tp.Patch.stack([patch[1], patch[0]]).tokens, patch.tokens.flip(0))
    with pytest.raises(tp.InputError, match=r"hold other tokens"):
        tp.functional_call(model, patch[1:], **tp.strip_context(model, x[:1], query=[6, 8], remove=remove))


def test_the_fingerprint_of_tokens_is_exact_on_its_own_tokens():
    """The check refuses nothing it should run: each row's own tokens give the with-context logits."""
    model, x = build("llama"), ids(2, 9)
    patch = tp.token_patch(model, x, query=[6, 8])
    got = tp.functional_call(model, patch, **tp.strip_context(model, x, query=[6, 8])).logits[:, 0].double()
    want = model(x).logits[:, [6, 8]].double().reshape(-1, got.shape[-1])
    assert float((got - want).abs().max()) <= 1e-12


# ----------------------------------------------------------------------------- weights edited behind the check
def test_weights_edited_through_data_after_a_check_are_caught():
    """Before: ``p.data`` edits after a first run escaped the fingerprint cache (torch's version counter
    does not move), off by 0.13 in functional_call and apply."""
    model, x = build("llama"), ids(1, 9)
    patch = tp.token_patch(model, x)
    tp.functional_call(model, patch, **tp.strip_context(model, x))  # checked: the digest is cached
    model.model.layers[1].mlp.down_proj.weight.data.mul_(1.01)
    with pytest.raises(tp.InputError, match=r"computed for another model"):
        tp.functional_call(model, patch, **tp.strip_context(model, x))
    with pytest.raises(tp.InputError, match=r"computed for another model"):
        with tp.apply(model, patch[0, 0]):
            pass


def test_an_optimizer_step_inside_apply_is_refused_not_half_kept():
    """Before: a step inside ``tp.apply`` was kept by the weights it did not patch and undone on the ones
    it did (11 of 21 tensors), silently. Now one line on exit, naming what happened."""
    model, x = build("llama"), ids(1, 9)
    patch = tp.token_patch(model, x)[0, 0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tp.InputError, match=r"weights changed inside tp.apply .* keep the change"):
        with tp.apply(model, patch):
            model(x).logits.pow(2).mean().backward()
            opt.step()
    model = build("llama")  # a plain block: no error, weights back bit for bit
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with tp.apply(model, patch):
        model(x)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- one line, not a raw error
@pytest.mark.parametrize(
    "case, match",
    [
        ("empty calibration", r"calibration must hold at least one query .* got shape \(0, 3\)"),
        ("empty prompt", r"the prompt is empty"),
        ("two-row prompt", r"one prompt per thought patch .* got 2 rows"),
        ("dict calibration", r"got a dict with keys \['input_ids'\]"),
    ],
)
def test_ill_formed_thought_patch_inputs_get_one_line(case, match):
    model, prompt, cal = build("llama"), ids(1, 8)[0], ids(4, 3, seed=2)
    args = {
        "empty calibration": (prompt, torch.zeros(0, 3, dtype=torch.long)),
        "empty prompt": (torch.zeros(0, dtype=torch.long), cal),
        "two-row prompt": (ids(2, 5), cal),
        "dict calibration": (prompt, {"input_ids": cal}),
    }[case]
    with pytest.raises(tp.InputError, match=match):
        tp.thought_patch(model, *args)


def test_functional_call_on_an_empty_batch_gets_one_line():
    model, x = build("llama"), ids(1, 6)
    patch = tp.token_patch(model, x)
    with pytest.raises(tp.InputError, match=r"the inputs are empty \(shape \(0, 1\)\)"):
        tp.functional_call(model, patch, torch.zeros(0, 1, dtype=torch.long))


@pytest.mark.parametrize("path", ["", ".", "x/", "folder"])
def test_save_patch_refuses_a_path_that_names_a_folder(path, tmp_path, monkeypatch):
    """Before: ``""`` and ``"."`` raised ``OSError: [Errno 16] Device or resource busy``, ``"x/"`` wrote a
    file named ``x``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    model, x = build("llama"), ids(1, 6)
    with pytest.raises(tp.InputError, match=r"cannot write to .*(an empty path|a folder, not a file)"):
        tp.save_patch(tp.token_patch(model, x), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"] and not any((tmp_path / "folder").iterdir())
