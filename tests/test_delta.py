"""Patch objects: factors, dense(), arithmetic, and safetensors files (round trip and corruption)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_model
from safetensors.torch import save_file

import tokenpatch as tp


@pytest.fixture
def patch(small_model, small_inputs):
    return tp.token_patch(small_model, small_inputs, query="all")


def test_factors_and_dense(patch, small_inputs):
    b, t = small_inputs.shape[:2]
    assert patch.lead == (b, t)
    d = patch["blocks.0.mlp.fc_in.weight"]
    assert isinstance(d, tp.LowRank) and d.rank == 1
    assert d.u.shape == (b, t, 1, 32) and d.v.shape == (b, t, 1, 8)
    outer = d.u[..., 0, :, None] * d.v[..., 0, None, :]  # u v^T per (batch, query)
    assert torch.equal(d.dense(), outer) or torch.allclose(d.dense(), outer, rtol=0, atol=1e-15)
    assert patch["blocks.0.mlp.fc_out.bias"].shape == (b, t, 8)
    x = torch.randn(b, t, 8, dtype=torch.float64)
    torch.testing.assert_close(d.matvec(x), (d.dense() @ x[..., None])[..., 0], rtol=0, atol=1e-13)
    torch.testing.assert_close(d.norm(), torch.linalg.matrix_norm(d.dense()), rtol=1e-12, atol=1e-14)


def test_sum_stack_index(patch):
    w = "blocks.1.mlp.fc_in.weight"
    total = patch.sum("query")
    assert total.lead == (patch.lead[0], 1) and total.acts == "everywhere"
    assert total[w].rank == patch.lead[1]
    torch.testing.assert_close(total[w].dense()[:, 0], patch[w].dense().sum(1), rtol=0, atol=1e-13)
    torch.testing.assert_close(total["blocks.1.mlp.fc_out.bias"][:, 0], patch["blocks.1.mlp.fc_out.bias"].sum(1))
    both = patch[0, 1] + patch[1, 2]
    assert both[w].rank == 2
    torch.testing.assert_close(
        both[w].dense(), patch[w].dense()[0:1, 1:2] + patch[w].dense()[1:2, 2:3], rtol=0, atol=1e-14
    )
    stacked = tp.Patch.stack([patch[0], patch[2]], dim="batch")
    assert stacked.lead == (2, patch.lead[1])
    assert torch.equal(stacked[w].u[1], patch[w].u[2])
    one = patch[1, -1]
    assert one.lead == (1, 1) and torch.equal(one[w].u[0, 0], patch[w].u[1, -1])
    assert patch.to(torch.float32).dtype == torch.float32
    assert "LowRank(rank=1, 32x8)" in repr(patch)


def test_patch_rejects_inconsistent_deltas():
    with pytest.raises(tp.InputError, match="same \\[batch, query\\]"):
        tp.Patch({"a": torch.zeros(1, 2, 3), "b": torch.zeros(2, 2, 3)})
    with pytest.raises(tp.InputError, match="LowRank factors"):
        tp.LowRank(torch.zeros(1, 1, 1, 3), torch.zeros(1, 2, 1, 3))
    with pytest.raises(tp.InputError, match="positions"):
        tp.Patch({"a": torch.zeros(1, 2, 3)}, positions=[0, 0])


def test_save_load_round_trip_is_bitwise(patch, tmp_path, small_model):
    path = tmp_path / "p.safetensors"
    tp.save_patch(patch, path)
    back = tp.load_patch(path, model=small_model)
    assert list(back) == list(patch) and back.positions == patch.positions and back.lead == patch.lead
    for name in patch:
        a, b = patch[name], back[name]
        if isinstance(a, tp.LowRank):
            assert torch.equal(a.u, b.u) and torch.equal(a.v, b.v) and b.u.dtype == a.u.dtype
        else:
            assert torch.equal(a, b)
    assert back.meta == json.loads(json.dumps(patch.meta))
    assert back.plan.query == tuple(range(7)) and back.meta["model_dtype"] == "float64"


def test_chunk_patch_round_trip_keeps_positions(small_model, small_inputs, tmp_path):
    patch = tp.token_patch(small_model, small_inputs, query=[4, 6], remove=slice(1, 3))
    tp.save_patch(patch, tmp_path / "c.safetensors")
    back = tp.load_patch(tmp_path / "c.safetensors")
    assert back.positions == (2, 4)
    assert tp.verify(small_model, back, small_inputs).max_abs <= 1e-10


def test_truncated_file_raises(patch, tmp_path):
    path = tmp_path / "p.safetensors"
    tp.save_patch(patch, path)
    data = path.read_bytes()
    for cut in (4, 100, len(data) - 10):
        (tmp_path / "t.safetensors").write_bytes(data[:cut])
        with pytest.raises(tp.FileFormatError, match="truncated or corrupt"):
            tp.load_patch(tmp_path / "t.safetensors")


def test_edited_tensor_bytes_fail_the_checksum(patch, tmp_path):
    path = tmp_path / "p.safetensors"
    tp.save_patch(patch, path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # flip one bit of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(tp.FileFormatError, match="checksum mismatch"):
        tp.load_patch(path)


def test_edited_metadata_raises(patch, tmp_path):
    path = tmp_path / "p.safetensors"
    tp.save_patch(patch, path)
    data = path.read_bytes()
    edited = data.replace(b'\\"lowrank\\"', b'\\"sparse!\\"', 1)
    assert edited != data and len(edited) == len(data)
    path.write_bytes(edited)
    with pytest.raises(tp.FileFormatError, match="checksum mismatch"):
        tp.load_patch(path)


def test_foreign_files_raise(tmp_path, small_model):
    save_file({"x": torch.zeros(3)}, tmp_path / "plain.safetensors")
    with pytest.raises(tp.FileFormatError, match="not one written by tokenpatch"):
        tp.load_patch(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(tp.FileFormatError):
        tp.load_patch(tmp_path / "junk.safetensors")
    tp.save_model(small_model, tmp_path / "model.safetensors")
    with pytest.raises(tp.FileFormatError, match="tokenpatch.model/1"):
        tp.load_patch(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError):
        tp.load_patch(tmp_path / "missing.safetensors")


def test_patch_of_another_model_is_refused(patch, tmp_path, small_model, small_inputs):
    tp.save_patch(patch, tmp_path / "p.safetensors")
    other = random_model(small_model.config, seed=99)  # same architecture, other weights
    with pytest.raises(tp.FileFormatError, match="another model"):
        tp.load_patch(tmp_path / "p.safetensors", model=other)
    with pytest.raises(tp.InputError, match="another model"):
        tp.functional_call(other, patch[0, 0], small_inputs[:1, :1])
    wider = random_model(tp.ICLConfig(d_in=5, d_model=10, n_layers=3, n_heads=2), seed=1)
    with pytest.raises(tp.FileFormatError, match="shape"):
        tp.load_patch(tmp_path / "p.safetensors", model=wider)
