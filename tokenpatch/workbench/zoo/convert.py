"""The transformers side of ``pretrained``: the GGUF conversion and the reading of the cached copy.

``convert`` loads a model's GGUF file with transformers (dequantised to float32) and saves it as
safetensors; ``read_cache`` loads that copy; ``check_loaded`` makes sure transformers built the
model the spec names. ``hf_calls`` wraps every call into transformers (offline, quiet). Imported
by ``pretrained`` only; it imports nothing from it (a spec is passed in).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.metadata
import io
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenpatch.errors import FileFormatError, UnsupportedModelError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["PROBE_TEXT", "dist_version", "hf_calls", "check_loaded", "convert", "read_cache"]

PROBE_TEXT = "The capital of France is Paris. 12,345 naïve cafés, 東京!\n    indented code()  "


def dist_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def hf_calls(progress: bool | None):
    """Around calls into transformers: offline, and quiet unless ``progress`` is True.

    transformers and huggingface_hub are imported first: huggingface_hub reads ``HF_HUB_OFFLINE``
    once at import, and importing it inside this block would leave the whole process offline. The
    variable is still set for the duration (code that reads it later sees it), every call also
    passes ``local_files_only=True``, and the environment is restored afterwards. The progress
    bars of transformers and gguf go to ``sys.stderr``, which is redirected here unless ``progress``
    is True (their loggers keep their own handlers, so real warnings still show).
    """
    importlib.import_module("transformers")

    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside the block, gguf builds each of its parsed objects once. transformers makes a new
    ``gguf.GGUFReader`` for the config, the tokenizer and the weights alike (three parses of the whole
    header; Gemma 3's 262k-token vocabulary takes about 9 s each on 2 cores), and a new
    ``gguf.get_tensor_name_map(arch, n_blocks)`` (every tensor name of every block) for each of the
    model's submodules it maps (397 for SmolLM2, about 10 s). Both are replaced by memos keyed on their
    arguments, put back on exit; what they return is only read once built (memory-mapped fields and
    tensors; a name lookup)."""
    gguf = importlib.import_module("gguf")
    reader, name_map, seen = gguf.GGUFReader, gguf.get_tensor_name_map, {}

    def read_once(path, mode="r"):
        key = ("reader", os.fspath(path), mode)
        if key not in seen:
            seen[key] = reader(path, mode)
        return seen[key]

    def map_once(arch, n_blocks):
        key = ("names", arch, n_blocks)
        if key not in seen:
            seen[key] = name_map(arch, n_blocks)
        return seen[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, map_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        seen.clear()


def check_loaded(spec: Any, model: Any, where: Path) -> None:
    cls, config = type(model).__name__, model.config
    got = (cls, getattr(config, "model_type", None), getattr(config, "num_hidden_layers", None))
    if got != (spec.hf_class, spec.model_type, spec.n_layers):
        raise UnsupportedModelError(
            f"{spec.name}: transformers {dist_version('transformers')} loaded {where} as {got[0]} "
            f"(model_type {got[1]!r}, {got[2]} layers), expected {spec.hf_class} ({spec.model_type!r}, "
            f"{spec.n_layers} layers); use a transformers 5.x release tokenpatch supports"
        )


def convert(spec: Any, tmp: Path, progress: bool | None) -> None:
    """Load ``spec``'s GGUF with transformers (dequantised to float32) and save it as safetensors into ``tmp``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scratch = tmp / "gguf-source"
    gguf = spec.gguf(scratch)
    with hf_calls(progress), gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        check_loaded(spec, model, gguf)
        # save_pretrained refuses GGUF-loaded models ("quantized with gguf and is not serializable"),
        # although the weights are plain float32 by now: drop the quantisation record, then save.
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # The saved tokenizer is what every later load uses: it must split text as the GGUF one does.
        saved = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        if saved(PROBE_TEXT).input_ids != tokenizer(PROBE_TEXT).input_ids:
            raise UnsupportedModelError(
                f"{spec.name}: transformers {dist_version('transformers')} saves a tokenizer that splits text "
                "differently from the GGUF one; use a transformers 5.x release tokenpatch supports"
            )
    del model, tokenizer, saved
    shutil.rmtree(scratch, ignore_errors=True)  # the assembled GGUF (Gemma: 253 MB) is not kept
    gc.collect()


def read_cache(spec: Any, folder: Path, dtype: torch.dtype, progress: bool | None):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with hf_calls(progress):
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # a damaged file, not a bug or lack of memory
        raise FileFormatError(
            f"{spec.name}: the cached copy in {folder} cannot be read ({type(exc).__name__}: {exc}); "
            "delete that folder and call load_pretrained again to rebuild it"
        ) from exc
    check_loaded(spec, model, folder)
    return model, tokenizer
