"""The load path of tokenpatch.workbench.zoo.pretrained and its verified cache, with a tiny fake model.

A 2-layer random Llama and a word-level tokenizer stand in for the GGUF conversion, so these tests
need ``transformers`` but no model weights: the first and cached loads, the rebuild when the source
changes, and the cache's own check: a damaged cached copy (same-size edits of the weights, the
config or the tokenizer; a truncated, missing or extra file; an edited marker) is rebuilt with one
line saying why instead of loading, and the temporary folders of killed conversions are removed on
the next load while those of live ones are kept.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tokenpatch as tp
from tokenpatch.workbench.zoo import cache as atomic
from tokenpatch.workbench.zoo import convert, pretrained
from tokenpatch.workbench.zoo.cache import MARKER
from tokenpatch.workbench.zoo.convert import hf_calls
from tokenpatch.workbench.zoo.pretrained import PRETRAINED, load_pretrained

HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "accelerate"))
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason='needs transformers, gguf, accelerate: pip install "tokenpatch[hf]"'
)

# --- the whole load path, with a tiny random Llama standing in for the GGUF conversion --------------------------------


def tiny_convert(spec, tmp: Path, progress) -> None:
    """Write what ``convert.convert`` writes, for a 2-layer random Llama and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[UNK]", "the", "cat", "sat", "on", "mat", "."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    with hf_calls(progress):  # as the real one: quiet unless progress is True
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp)
        LlamaForCausalLM(config).save_pretrained(tmp)


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A registered fake model ``tiny-llama`` whose "GGUF file" is a small file in tmp_path."""
    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"gguf")
    spec = dataclasses.replace(
        PRETRAINED["smollm2-135m"],
        name="tiny-llama",
        module="json",
        n_layers=2,
        source_files=lambda: [source],
        gguf=lambda scratch: source,
    )
    monkeypatch.setitem(PRETRAINED, "tiny-llama", spec)
    monkeypatch.setattr(convert, "convert", tiny_convert)
    return source


@needs_transformers
def test_load_path_first_and_cached(tiny, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert not pretrained.is_cached("tiny-llama", tmp_path / "cache")
    model, tokenizer = load_pretrained("tiny-llama", cache_dir=tmp_path / "cache")
    assert pretrained.is_cached("tiny-llama", tmp_path / "cache")
    err = capfd.readouterr().err
    assert err.startswith("tokenpatch: converting tiny-llama from GGUF once") and err.count("\n") == 1, err
    assert f"cached in {tmp_path / 'cache' / 'tiny-llama'}" in err
    assert not model.training and type(model).__name__ == "LlamaForCausalLM"
    assert "HF_HUB_OFFLINE" not in os.environ  # restored
    ids = tokenizer("the cat sat on the mat .", return_tensors="pt").input_ids
    assert ids.tolist() == [[1, 2, 3, 4, 1, 5, 6]]
    again, _ = load_pretrained("tiny-llama", cache_dir=tmp_path / "cache")
    assert capfd.readouterr().err == ""  # cached load: silent
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    wide, _ = load_pretrained("tiny-llama", cache_dir=tmp_path / "cache", dtype="float64")
    assert {p.dtype for p in wide.parameters()} == {torch.float64}


@needs_transformers
def test_load_path_rebuilds_when_the_package_changes(tiny, tmp_path, capfd):
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    assert capfd.readouterr().err == ""  # progress=False: silent even on the first load
    os.utime(tiny, ns=(tiny.stat().st_atime_ns, tiny.stat().st_mtime_ns + 10**9))
    assert not pretrained.is_cached("tiny-llama", tmp_path)
    load_pretrained("tiny-llama", cache_dir=tmp_path)
    assert "converting tiny-llama" in capfd.readouterr().err


@needs_transformers
def test_load_path_restores_hf_hub_offline(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    assert os.environ["HF_HUB_OFFLINE"] == "0"


@needs_transformers
def test_unreadable_cache_says_what_to_do(tiny, tmp_path, monkeypatch):
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    weights = tmp_path / "tiny-llama" / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)  # same size: passes the sizes, fails to parse
    monkeypatch.setattr(atomic, "problem", lambda *a, **k: None)  # as if its check were passed
    with pytest.raises(tp.FileFormatError, match="cached copy in .* cannot be read .*; delete that folder"):
        load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)


@needs_transformers
def test_unexpected_model_class_is_refused(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(
        PRETRAINED, "tiny-llama", dataclasses.replace(PRETRAINED["tiny-llama"], hf_class="GPT2LMHeadModel")
    )
    with pytest.raises(tp.UnsupportedModelError, match="loaded .* as LlamaForCausalLM .* expected GPT2LMHeadModel"):
        load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)


# --- the verified cache ------------------------------------------------------------------------------------------------

IDS = torch.tensor([[1, 2, 3, 4, 1, 5, 6]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def tensor_range(weights: Path, name: str) -> tuple[int, int]:
    """The absolute byte range of tensor ``name`` in the safetensors file ``weights``."""
    with weights.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    begin, end = header[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Write ``data`` into ``path`` at ``offset`` in place: same size, the way a bad disk or a stray write would."""
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def zero_half(folder: Path) -> None:
    begin, end = tensor_range(folder / "model.safetensors", "model.layers.1.mlp.down_proj.weight")
    overwrite(folder / "model.safetensors", (begin + end) // 2, b"\0" * ((end - begin) // 2))


def few_inf(folder: Path, at: tuple[int, ...] = (3, 50, 200)) -> None:
    begin, end = tensor_range(folder / "model.safetensors", "model.layers.0.self_attn.q_proj.weight")
    for k in at:
        overwrite(folder / "model.safetensors", begin + 4 * k, struct.pack("<f", float("inf")))


def same_size_edit(path: Path, old: bytes, new: bytes) -> None:
    text = path.read_bytes()
    assert len(old) == len(new) and old in text, (old, path)
    path.write_bytes(text.replace(old, new, 1))


def edit_marker(folder: Path, edit) -> None:
    marker = json.loads((folder / MARKER).read_text())
    edit(marker)
    (folder / MARKER).write_text(json.dumps(marker))


def swap_words(folder: Path) -> None:  # tokenizer.json: "cat" and "sat" swap ids (same size)
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(
        text.replace('"cat"', '"@@@"').replace('"sat"', '"cat"').replace('"@@@"', '"sat"')
    )


def first_file_digest(marker: dict) -> None:
    record = marker["digests"]["config.json"]
    record["crc32"] = "0" * len(record["crc32"])


DAMAGE = {  # name: (damage, "damaged" for a cache whose marker matches, "stale" for one without a marker)
    "weights-half-zeroed": (zero_half, "damaged"),
    "weights-few-inf": (few_inf, "damaged"),
    "config-edited": (lambda f: same_size_edit(f / "config.json", b'"silu"', b'"relu"'), "damaged"),
    "tokenizer-edited": (swap_words, "damaged"),
    "tokenizer-config-edited": (
        lambda f: same_size_edit(f / "tokenizer_config.json", b'"[UNK]"', b'"[UNC]"'),
        "damaged",
    ),
    "header-edited": (lambda f: same_size_edit(f / "model.safetensors", b"[16,32]", b"[32,16]"), "damaged"),
    "weights-truncated": (lambda f: os.truncate(f / "model.safetensors", 1000), "damaged"),
    "config-missing": (lambda f: (f / "config.json").unlink(), "damaged"),
    "extra-index-file": (
        lambda f: (f / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}'),
        "damaged",
    ),
    "marker-digest-edited": (lambda f: edit_marker(f, first_file_digest), "damaged"),
    "marker-missing": (lambda f: (f / MARKER).unlink(), "stale"),
}


@needs_transformers
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_cache_is_rebuilt_with_one_line(tiny, tmp_path, capfd, kind):
    damage, note = DAMAGE[kind]
    model, tokenizer = load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    want, want_ids = logits(model), tokenizer("the cat sat on the mat .").input_ids
    damage(tmp_path / "tiny-llama")
    assert not pretrained.is_cached("tiny-llama", tmp_path)
    capfd.readouterr()
    again, tokenizer_again = load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    err = capfd.readouterr().err
    if note == "damaged":  # one line, even with progress=False
        assert err.count("\n") == 1 and err.startswith("tokenpatch: the cached copy of tiny-llama in "), err
        assert (
            "is damaged (" in err
            and f"); rebuilding it from the GGUF (about {PRETRAINED['smollm2-135m'].first_load_s} s)" in err
        ), err
    else:  # no marker: an interrupted build, rebuilt as routine (silent with progress=False)
        assert err == "", err
    assert torch.equal(logits(again), want) and tokenizer_again("the cat sat on the mat .").input_ids == want_ids
    assert pretrained.is_cached("tiny-llama", tmp_path)


@needs_transformers
def test_the_note_names_what_is_damaged(tiny, tmp_path, capfd):
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    zero_half(tmp_path / "tiny-llama")
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    err = capfd.readouterr().err
    assert "model.safetensors: tensor model.layers.1.mlp.down_proj.weight does not match its digest" in err, err


@needs_transformers
def test_sampled_check(tiny, tmp_path, capfd, monkeypatch):
    """``verify="sample"`` (or ``TOKENPATCH_VERIFY=sample``) reads a sample of every tensor: a damaged half is caught."""
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    zero_half(tmp_path / "tiny-llama")
    assert not pretrained.is_cached("tiny-llama", tmp_path, verify="sample")
    monkeypatch.setenv("TOKENPATCH_VERIFY", "sample")
    assert not pretrained.is_cached("tiny-llama", tmp_path)
    capfd.readouterr()
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    assert "is damaged (" in capfd.readouterr().err
    assert pretrained.is_cached("tiny-llama", tmp_path)


@needs_transformers
@pytest.mark.parametrize("verify", ["fast", "", 1])
def test_bad_verify_mode(tiny, tmp_path, monkeypatch, verify):
    with pytest.raises(tp.InputError, match="verify must be 'full' or 'sample'"):
        load_pretrained("tiny-llama", cache_dir=tmp_path, verify=verify)
    monkeypatch.setenv("TOKENPATCH_VERIFY", "everything")
    with pytest.raises(tp.InputError, match="TOKENPATCH_VERIFY must be 'full' or 'sample'"):
        load_pretrained("tiny-llama", cache_dir=tmp_path)


def fake_build(tmp: Path) -> None:
    (tmp / "model.safetensors").write_bytes(b"weights")


EXPECTED = {"format": pretrained.CACHE_FORMAT, "name": "fake"}
BUILDER = """
import sys, time
from pathlib import Path
from tokenpatch.workbench.zoo import cache
def build(tmp):
    (tmp / "model.safetensors").write_bytes(b"w" * 2**20)
    print(tmp, flush=True)
    time.sleep(600)
cache.ensure(Path(sys.argv[1]), {"format": sys.argv[2], "name": "fake", "other": "source"}, build)
"""


def start_builder(folder: Path) -> tuple[subprocess.Popen, Path]:
    """A process converting into ``folder`` (another source, so it builds): returns it and its temporary folder."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(folder), pretrained.CACHE_FORMAT], stdout=subprocess.PIPE, text=True
    )
    return proc, Path(proc.stdout.readline().strip())


def test_killed_conversion_is_cleaned_on_the_next_load(tmp_path):
    folder = tmp_path / "fake"
    atomic.ensure(folder, EXPECTED, fake_build)
    killed, killed_tmp = start_builder(folder)
    live, live_tmp = start_builder(folder)
    try:
        assert killed_tmp.parent == live_tmp.parent == tmp_path and killed_tmp.is_dir() and live_tmp.is_dir()
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert not atomic.ensure(folder, EXPECTED, fake_build)  # a good cache: no rebuild, but the leftovers go
        assert not killed_tmp.exists()  # its builder is dead: removed at once, not an hour later
        assert live_tmp.is_dir()  # another process is still writing it: kept
    finally:
        live.kill()
        live.wait()
    atomic.ensure(folder, EXPECTED, fake_build)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake"]


def test_killed_install_leftover_is_cleaned(tmp_path):
    folder = tmp_path / "fake"
    atomic.ensure(folder, EXPECTED, fake_build)
    old = tmp_path / ".fake.old-1-dead"  # a replaced cache moved aside by a load killed before it deleted it
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"old")
    atomic.ensure(folder, EXPECTED, fake_build)
    assert not old.exists()


@needs_transformers
def test_damaged_cache_that_cannot_be_rebuilt_is_refused(tiny, tmp_path, monkeypatch):
    load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)
    zero_half(tmp_path / "tiny-llama")
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):  # the cache root cannot take a new folder (root ignores chmod)
        if ".tmp-" in self.name:
            raise PermissionError(13, "Permission denied")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(
        tp.InputError,
        match="^the cached copy in .* is damaged \\(model.safetensors: tensor model.layers.1.mlp.down_proj.weight "
        "does not match its digest\\) and cannot write the tokenpatch cache in .* \\(Permission denied\\); pass cache_dir=",
    ):
        load_pretrained("tiny-llama", cache_dir=tmp_path, progress=False)


@pytest.mark.slow
def test_real_model_damage_is_found(pretrained_cache_dir, tmp_path):
    """The issue's two cases on SmolLM2's real cache (a copy of it): found by the full check, the first by the sample."""
    import shutil

    from test_pretrained import require

    require("smollm2-135m")
    load_pretrained("smollm2-135m", cache_dir=pretrained_cache_dir, progress=False)  # converts if not cached
    expected = pretrained._expected_marker(PRETRAINED["smollm2-135m"])
    between_windows = (5000, 30000, 60000)  # values of q_proj (1.3 MB) outside the 16 sampled windows
    for damage, tensor, sampled in (
        (zero_half, "model.layers.1.mlp.down_proj.weight", True),
        (lambda f: few_inf(f, between_windows), "model.layers.0.self_attn.q_proj.weight", False),
    ):
        copy = tmp_path / str(sampled) / "smollm2-135m"
        shutil.copytree(pretrained_cache_dir / "smollm2-135m", copy)
        assert atomic.problem(copy, expected, "full") is None and atomic.problem(copy, expected, "sample") is None
        damage(copy)
        assert atomic.problem(copy, expected, "full") == f"model.safetensors: tensor {tensor} does not match its digest"
        assert (atomic.problem(copy, expected, "sample") is not None) == sampled
        assert not pretrained.is_cached("smollm2-135m", copy.parent)
