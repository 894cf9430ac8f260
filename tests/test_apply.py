"""apply() restores every parameter bit-exactly (also on error); functional_call mutates nothing
and agrees with apply to 1e-12 in float64."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _bitwise_equal(model, snap):
    return all(torch.equal(p, snap[n]) and p.dtype == snap[n].dtype for n, p in model.named_parameters())


def test_apply_changes_then_restores_bitwise(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs, query="all")[1, 4]
    before = _snapshot(small_model)
    with tp.apply(small_model, patch) as m:
        assert m is small_model
        assert not _bitwise_equal(small_model, before)
        out = small_model(small_inputs[1:2, 4:5])
    assert _bitwise_equal(small_model, before)
    ref = small_model(small_inputs[1:2, :5])[:, -1]
    torch.testing.assert_close(out[:, 0], ref, rtol=0, atol=1e-12)


def test_apply_restores_when_the_body_raises(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs)[0, 0]
    before = _snapshot(small_model)
    with pytest.raises(RuntimeError, match="boom"):
        with tp.apply(small_model, patch):
            assert not _bitwise_equal(small_model, before)
            raise RuntimeError("boom")
    assert _bitwise_equal(small_model, before)


def test_apply_restores_float32_bitwise(small_model, small_inputs):
    model = small_model.float()
    x = small_inputs.float()
    patch = tp.token_patch(model, x)[2, 0]
    assert patch.dtype == torch.float32
    before = _snapshot(model)
    with tp.apply(model, patch):
        pass
    assert _bitwise_equal(model, before)


@pytest.mark.parametrize(
    "query,remove", [(-1, None), ("all", None), ([2, 5, 6], None), ([4, 6], slice(1, 3)), ("all", slice(2, 5))]
)
def test_functional_call_matches_apply_and_mutates_nothing(small_model, small_inputs, query, remove):
    patch = tp.token_patch(small_model, small_inputs, query=query, remove=remove)
    stripped = tp.strip_context(small_model, small_inputs, query, remove)
    before = _snapshot(small_model)
    out = tp.functional_call(small_model, patch, stripped)
    assert _bitwise_equal(small_model, before)
    assert all(not m._forward_hooks for m in small_model.modules())
    b, q = patch.lead
    for bi in range(b):
        for qi in range(q):
            if patch.acts == "everywhere":
                one = patch[bi, qi]
                with tp.apply(small_model, one):
                    ref = small_model(stripped[bi * q + qi : bi * q + qi + 1])
                torch.testing.assert_close(out[bi * q + qi], ref[0], rtol=0, atol=1e-12)
            else:  # the queries' patches act together (a later query's anchor sees earlier ones patched)
                ref = small_model(small_inputs)[bi, patch.plan.query[qi]]
                torch.testing.assert_close(out[bi, patch.positions[qi]], ref, rtol=0, atol=1e-12)


def test_single_patch_broadcasts_over_a_batch(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs)[0, 0]
    x = small_inputs[:1, -1:].expand(4, 1, 5)
    with pytest.raises(tp.InputError, match="broadcast=True"):  # one patch, four sequences: opt in
        tp.functional_call(small_model, patch, x)
    out = tp.functional_call(small_model, patch, x, broadcast=True)
    with tp.apply(small_model, patch):
        ref = small_model(x[:1])
    torch.testing.assert_close(out, ref.expand_as(out), rtol=0, atol=1e-13)  # batched GEMM rounding only


def test_functional_call_is_differentiable(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs)
    u = patch["blocks.0.mlp.fc_in.weight"].u.clone().requires_grad_(True)
    deltas = dict(patch)
    deltas["blocks.0.mlp.fc_in.weight"] = tp.LowRank(u, patch["blocks.0.mlp.fc_in.weight"].v)
    p = tp.Patch(deltas, patch.positions, patch.meta)
    out = tp.functional_call(small_model, p, tp.strip_context(small_model, small_inputs))
    out.sum().backward()
    assert u.grad is not None and u.grad.abs().max() > 0


def test_apply_refuses_batched_and_positional_patches(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs, query="all")
    with pytest.raises(tp.InputError, match="pick one with patch\\[b, q\\]"):
        with tp.apply(small_model, patch):
            pass
    chunk = tp.token_patch(small_model, small_inputs, query=-1, remove=slice(1, 3))
    with pytest.raises(tp.InputError, match="functional_call"):
        with tp.apply(small_model, chunk[0]):
            pass


def test_functional_call_batch_mismatch(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs, query=[1, 2])  # 3 x 2 patches
    with pytest.raises(tp.InputError, match="input batch is 5"):
        tp.functional_call(small_model, patch, torch.randn(5, 1, 5, dtype=torch.float64))
    assert all(not m._forward_hooks for m in small_model.modules())  # hooks removed after the error
