"""Misuse of the Python API gets a clear error, never a silent wrong answer."""

from __future__ import annotations

import json

import pytest
import torch

import tokenpatch as tp

TASK = tp.LinRegTask(dim=4, n_context=16, noise=0.1)


@pytest.fixture(scope="module")
def shipped():
    model = tp.load_model()
    batch = TASK.sample(8, torch.Generator().manual_seed(0))
    return model, batch, tp.token_patch(model, batch.tokens)


def test_with_context_inputs_are_refused(shipped):
    """The patch was made for the query alone; run on the with-context tokens it would silently
    add the context a second time and return a wrong prediction."""
    model, batch, patch = shipped
    with pytest.raises(tp.InputError, match="made for no-context sequences of length 1, got length 17"):
        tp.functional_call(model, patch, batch.tokens)
    right = tp.functional_call(model, patch, tp.strip_context(model, batch.tokens))[:, 0]  # [8, 1]
    with torch.no_grad():
        torch.testing.assert_close(right, model(batch.tokens)[:, -1], rtol=1e-4, atol=1e-5)
    # the legitimate use, on purpose: the query followed by more tokens, patched everywhere
    longer = torch.cat([batch.tokens[:, -1:], batch.tokens[:, :2]], 1)  # [8, 3, 5]
    out = tp.functional_call(model, patch, longer, any_length=True)
    torch.testing.assert_close(out[:, 0], right, rtol=0, atol=1e-6)  # causal: position 0 unchanged


def test_one_row_of_patches_does_not_broadcast_silently(shipped):
    """``patch[0]`` holds the patches of sequence 0 only; 8 sequences' inputs need an opt-in."""
    model, batch, _ = shipped
    several = tp.token_patch(model, batch.tokens, query=[-1, -2])  # [8, 2]
    stripped = tp.strip_context(model, batch.tokens, query=[-1, -2])  # [16, 1, 5]
    with pytest.raises(tp.InputError, match=r"\[1, 2\] patches.*input batch is 16.*broadcast=True"):
        tp.functional_call(model, several[0], stripped)
    out = tp.functional_call(model, several[0], stripped[:2])  # its own two sequences: fine
    assert out.shape == (2, 1, 1)
    with pytest.raises(tp.InputError, match=r"\[8, 2\] patches.*input batch is 8"):
        tp.functional_call(model, several, stripped[:8])


@pytest.mark.parametrize("scale", [1e-21, 1e-22, 1e-30])
def test_tiny_float32_anchors_do_not_underflow(scale):
    """|s_0|^2 of a tiny float32 anchor underflows (1e-42 is denormal, 1e-44 rounds to 0); the
    scaled norm keeps the patch exact and raises ZeroAnchorError only for a zero vector."""
    torch.manual_seed(0)
    block = tp.Block(tp.ICLConfig(d_in=8, d_model=8, n_layers=1, n_heads=2, norm="none", residual=False, bias=False))
    x = torch.randn(4, 6, 8) * scale  # [B, T, d]: the MLP input scales with x
    result = tp.verify(block, tp.token_patch(block, x), x)
    assert result.max_rel <= 1e-5 and result.ok(), result.table()
    x[1, -1] = 0.0  # a really zero query
    with pytest.raises(tp.ZeroAnchorError, match=r"\(1, 5\)"):
        tp.token_patch(block, x)


def test_a_thousand_additions_keep_flat_metadata(shipped, tmp_path):
    model, _, patch = shipped
    one = patch[0, 0]
    total, sizes = one, []
    for k in range(1, 1000):
        total = total + patch[k % 8, 0]
        if k in (1, 10, 100, 999):
            sizes.append(len(json.dumps(total.meta)))
    assert total.terms == 1000 and total["blocks.0.mlp.fc_in.weight"].rank == 1000
    # metadata does not grow with the number of additions (only the digits of the count do)
    assert max(sizes) - min(sizes) <= 3 and sizes[-1] < 400, sizes
    tp.save_patch(total, tmp_path / "sum.safetensors")
    back = tp.load_patch(tmp_path / "sum.safetensors", model=model)
    assert back.meta == total.meta and torch.equal(
        back["blocks.9.mlp.fc_in.weight"].u, total["blocks.9.mlp.fc_in.weight"].u
    )


def test_load_model_dtype_and_device_names():
    assert tp.load_model(dtype="float16").read_in.weight.dtype == torch.float16
    assert tp.load_model(dtype="torch.float64", device="cpu").read_in.weight.dtype == torch.float64
    with pytest.raises(tp.InputError, match="'float17' is not a floating dtype; use one of"):
        tp.load_model(dtype="float17")
    with pytest.raises(tp.InputError, match="not a floating dtype"):
        tp.load_model(dtype=torch.int64)
    with pytest.raises(tp.InputError, match="'gpu0' is not a device name"):
        tp.load_model(device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(tp.InputError, match="'cuda:0' is not available here"):
            tp.load_model(device="cuda:0")


def test_files_that_are_not_checkpoints(tmp_path, shipped):
    _, _, patch = shipped
    with pytest.raises(tp.FileFormatError, match="is a directory"):
        tp.load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        tp.load_model(tmp_path / "nope.safetensors")
    tp.save_patch(patch, tmp_path / "p.safetensors")
    with pytest.raises(tp.FileFormatError, match="a patch file: load it with tp.load_patch"):
        tp.load_model(tmp_path / "p.safetensors")
    tp.save_model(tp.load_model(), tmp_path / "m.safetensors")
    with pytest.raises(tp.FileFormatError, match="a model checkpoint: load it with tp.load_model"):
        tp.load_patch(tmp_path / "m.safetensors")


def test_writing_files_leaves_the_process_umask_alone(tmp_path, shipped):
    import os

    before = os.umask(0o027)
    try:
        tp.save_patch(shipped[2], tmp_path / "p.safetensors")
        assert os.umask(0o027) == 0o027  # still ours
        assert (tmp_path / "p.safetensors").stat().st_mode & 0o777 == 0o640  # the umask applied to 0o666
    finally:
        os.umask(before)


def test_verify_needs_no_matplotlib():
    import subprocess
    import sys

    code = "import sys, tokenpatch.workbench.cli.main as c; c.main(['verify', '--tasks', '2', '--quiet']); print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False", out


def test_one_tolerance_rule_by_dtype():
    err = lambda a, r: tp.Verification([tp.SiteError("output", a, r, r)], "float32")  # noqa: E731
    assert err(1.0, 5e-5).ok() and not err(0.0, 2e-4).ok()
    f64 = tp.Verification([tp.SiteError("output", 5e-11, 1.0, 1.0)], "float64")
    assert f64.ok() and f64.target == "max abs <= 1e-10"
    assert not tp.Verification([tp.SiteError("output", 2e-10, 0.0, 0.0)], "float64").ok()
    with pytest.warns(DeprecationWarning, match="use tokenpatch.SiteError"):
        assert tp.LayerError is tp.SiteError  # the old name of the record
    with pytest.warns(DeprecationWarning, match="use tokenpatch.save_patch"):
        assert tp.save is tp.save_patch
    with pytest.warns(DeprecationWarning, match="use tokenpatch.load_patch"):
        assert tp.load is tp.load_patch


def test_progress_bars_only_where_they_help(small_model, small_inputs, capsys):
    """A library call off a terminal shows no bar; ``progress=True`` (what the CLI passes) does."""
    tp.token_patch(small_model, small_inputs)
    assert capsys.readouterr().err == ""
    tp.token_patch(small_model, small_inputs, progress=True)
    assert "token_patch" in capsys.readouterr().err


def test_verify_takes_the_patch_second_and_the_old_order_warns(small_model, small_inputs):
    patch = tp.token_patch(small_model, small_inputs)
    new = tp.verify(small_model, patch, small_inputs)
    with pytest.warns(DeprecationWarning, match=r"tp.verify\(model, patch, inputs\)") as caught:
        old = tp.verify(small_model, small_inputs, patch)
    assert caught[0].filename == __file__  # the warning names the caller's line, not torch.no_grad's wrapper
    assert old.max_abs == new.max_abs <= 1e-10
    with pytest.raises(tp.InputError, match="the second argument must be a tp.Patch"):
        tp.verify(small_model, small_inputs, small_inputs)
