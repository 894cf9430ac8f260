"""The fingerprint cache (``_io.fingerprint(model, cached=True)``, behind ``check_model``,
``apply``, ``functional_call`` and ``verify``) notices weight changes with no ``cached=False``
call in between.

Each edit below keeps every parameter's float sum bitwise equal (the weights are multiples of
2^-8, so every partial sum is exact, and the edited matrix sums to exactly 0, which doubling
keeps), so the test isolates the one key entry that must notice it: the version counter for
in-place ops and ``load_state_dict``, the storage pointer for ``p.data = ...``; and for a write
through ``p.data`` (invisible to both) the full re-hash of ``cached=False``."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_model

import tokenpatch as tp

NAME = "blocks.1.mlp.fc_in.weight"  # the edited parameter


def _param_sums(model) -> dict[str, float]:
    with torch.no_grad():
        return {n: float(p.sum()) for n, p in model.named_parameters()}


@pytest.fixture
def setup():
    """(model with dyadic weights and ``NAME`` summing to exactly 0, inputs [2, 5, 4], its patch)."""
    model = random_model(tp.ICLConfig(d_in=4, d_model=6, n_layers=2, n_heads=2, norm="pre"), seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.round(p * 256) / 256)  # multiples of 2^-8, |p| < 4: float sums are exact
        w = model.get_parameter(NAME).view(-1)
        w[-1] = -w[:-1].sum()
    assert _param_sums(model)[NAME] == 0.0
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    patch = tp.token_patch(model, x)  # caches the fingerprint
    tp.functional_call(model, patch, tp.strip_context(model, x))  # unedited: accepted
    return model, x, patch


def _assert_rejected(model, x, patch):
    """Every checked entry point refuses the patch (cached fingerprint path only)."""
    with pytest.raises(tp.InputError, match="another model"):
        tp.functional_call(model, patch, tp.strip_context(model, x))
    with pytest.raises(tp.InputError, match="another model"):
        with tp.apply(model, patch[0, 0]):
            pass
    with pytest.raises(tp.InputError, match="another model"):
        tp.verify(model, patch, x)
    with pytest.raises(tp.InputError, match="another model"):
        patch.check_model(model)


def test_in_place_op_under_no_grad(setup):
    """``p.add_`` bumps the version counter; id, storage and sum stay the same."""
    model, x, patch = setup
    p = model.get_parameter(NAME)
    sums, ptr = _param_sums(model), p.data_ptr()
    step = torch.zeros_like(p)
    step[0, 0], step[1, 1] = 0.5, -0.5  # sum 0: the sum cannot see it
    with torch.no_grad():
        p.add_(step)
    assert _param_sums(model) == sums and p.data_ptr() == ptr
    _assert_rejected(model, x, patch)


def test_replaced_data(setup):
    """``p.data = ...`` keeps id and version counter; only the storage changes (sum 0 * 2 = 0)."""
    model, x, patch = setup
    p = model.get_parameter(NAME)
    sums, version = _param_sums(model), p._version
    p.data = p.data.clone() * 2
    assert _param_sums(model) == sums and p._version == version
    _assert_rejected(model, x, patch)


def test_load_state_dict(setup):
    """``load_state_dict`` copies in place: same ids and storages, versions bumped."""
    model, x, patch = setup
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_parameter(NAME).mul_(2)
    sums, ptr = _param_sums(model), model.get_parameter(NAME).data_ptr()
    model.load_state_dict(other.state_dict())
    assert _param_sums(model) == sums and model.get_parameter(NAME).data_ptr() == ptr
    _assert_rejected(model, x, patch)


def test_write_through_data_needs_full_rehash(setup, tmp_path):
    """``p.data.mul_(2)`` moves neither the version counter nor the storage (nor here the sum);
    ``check_model(cached=False)`` and ``load(path, model)`` re-hash and refuse the patch. (Whether
    the cached path sees it is deliberately not tested: it may rely on the sum alone.)"""
    model, x, patch = setup
    tp.save_patch(patch, tmp_path / "p.safetensors")
    p = model.get_parameter(NAME)
    version, ptr = p._version, p.data_ptr()
    p.data.mul_(2)
    assert p._version == version and p.data_ptr() == ptr
    with pytest.raises(tp.InputError, match="another model"):
        patch.check_model(model, cached=False)
    with pytest.raises(tp.FileFormatError, match="another model"):
        tp.load_patch(tmp_path / "p.safetensors", model=model)
    p.data.div_(2)  # back to the patch's weights: accepted again
    patch.check_model(model, cached=False)
    tp.load_patch(tmp_path / "p.safetensors", model=model)
