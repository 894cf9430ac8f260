"""Every user mistake on the command line: one line on stderr naming what is wrong and what to
do, exit status 2, no traceback (``--debug`` shows it)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import tokenpatch as tp
from tokenpatch.workbench.cli.main import main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    (d / "notes.txt").write_text("hello\n")
    save_file({"x": torch.zeros(3)}, d / "other.safetensors")  # another tool's file
    tiny = tp.ICLTransformer(tp.ICLConfig(d_in=3, d_model=4, n_layers=1, n_heads=1))
    patch = tp.token_patch(tiny, torch.randn(1, 3, 3))
    tp.save_patch(patch, d / "patch.safetensors")
    (d / "folder").mkdir()
    return d


CASES = [  # (argv, what the one line must say); {d} is the fixture folder
    (["verify", "--checkpoint", "{d}/missing.safetensors"], "no such file: {d}/missing.safetensors"),
    (["verify", "--checkpoint", "{d}/folder"], "{d}/folder is a directory; give the path of a tokenpatch.model/1 file"),
    (["verify", "--checkpoint", "{d}/notes.txt"], "is not a readable safetensors file"),
    (
        ["verify", "--checkpoint", "{d}/patch.safetensors"],
        "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1' (a patch file",
    ),
    (["verify", "--checkpoint", "{d}/other.safetensors"], "is a safetensors file but not one written by tokenpatch"),
    (["verify", "--tasks", "0"], "argument --tasks: 0 is too small: it must be at least 1"),
    (["verify", "--tasks", "-5"], "argument --tasks: -5 is too small"),
    (["verify", "--tasks", "many"], "argument --tasks: 'many' is not an integer"),
    (["verify", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["verify", "--threads", "-1"], "argument --threads: -1 is too small: it must be at least 0"),
    (["reproduce", "--out", "{d}/notes.txt"], "--out {d}/notes.txt is a file; give a folder"),
    (["reproduce", "--tasks", "0"], "argument --tasks: 0 is too small"),
    (["reproduce", "--checkpoint", "{d}/folder"], "is a directory"),
    (["train", "--out", "{d}/notes.txt"], "--out {d}/notes.txt exists and is not a tokenpatch training checkpoint"),
    (["train", "--out", "{d}/folder"], "--out {d}/folder is a folder; give a file path"),
    (["train", "--out", "{d}/notes.txt/run.safetensors"], "{d}/notes.txt is a file, not a folder"),
    (["train", "--out", "{d}/new.safetensors", "--export", "{d}/notes.txt"], "--export {d}/notes.txt already exists"),
    (
        ["train", "--layer", "mamba"],
        "argument --layer: invalid choice: 'mamba' (choose from 'gru', 'linear', 'lstm', 'rnn', 'softmax', "
        "'gated_deltanet', 'llama', 'mamba2', 'rg_lru', 'short_conv')",
    ),
    (["train", "--norm", "middle"], "argument --norm: invalid choice: 'middle'"),
    (["train", "--steps", "0"], "argument --steps: 0 is too small"),
    (["train", "--context", "-1"], "argument --context: -1 is too small"),
    (["train", "--lr", "-0.1"], "argument --lr: -0.1 must be a finite number > 0"),
    (["train", "--noise", "nan"], "argument --noise: nan must be a finite number >= 0"),
    (
        ["train", "--out", "{d}/new.safetensors", "--d-model", "10", "--heads", "4"],
        "d_model=10 is not divisible by n_heads=4",
    ),
    (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
    (["markov", "predictors", "--alpha", "0"], "argument --alpha: 0 must be a finite number > 0"),
    (["markov", "predictors", "--states", "1"], "argument --states: 1 is too small: it must be at least 2"),
    (["markov", "predictors", "--length", "200", "--sequences", "0"], "argument --sequences: 0 is too small"),
    (["markov", "probe", "--run", "{d}/folder"], "--run {d}/folder holds no Markov run"),
    (["markov", "train", "--out", "{d}/notes.txt"], "--out {d}/notes.txt is a file; give a folder for the run"),
    (
        ["markov", "train", "--out", "{d}"],
        "--out {d} holds files that are not a Markov run (folder, notes.txt, other.safetensors ...); give a new or empty folder",
    ),
    (["markov", "report", "--out", "{d}/notes.txt"], "--out {d}/notes.txt is a file; give a folder for the report"),
    (["markov", "sweep"], "argument markov_command: invalid choice: 'sweep'"),
    (
        ["markov", "train", "--out", "{d}/run", "--seed", "-1"],
        "argument --seed: -1 is too small: it must be at least 0",
    ),
    (["induction", "scores", "--model", "gpt-17"], "--model 'gpt-17' is neither a known model"),
    (
        ["induction", "scores", "--model", "{d}/patch.safetensors"],
        "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1'",
    ),
    (["induction", "scores", "--model", "{d}/notes.txt"], "is not a readable safetensors file"),
    (["induction", "scores", "--model", "x", "--length", "1"], "argument --length: 1 is too small"),
    (["induction", "train", "--out", "{d}/lm.pt"], "--out {d}/lm.pt: give a file path ending in .safetensors"),
    (
        ["induction", "train", "--out", "{d}/lm.safetensors", "--follow", "1.5"],
        "--follow 1.5: a probability, in [0, 1]",
    ),
    (
        ["induction", "train", "--out", "{d}/lm.safetensors", "--heads", "3"],
        "--d-model 64 is not divisible by --heads 3",
    ),
    (
        ["induction", "train", "--out", "{d}/patch.safetensors"],
        "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1'",
    ),
    (["induction", "report", "--model", "{d}/notes.txt", "--out", "{d}/r"], "is not a readable safetensors file"),
    (["induction", "report", "--model", "gpt-17"], "--model 'gpt-17' is neither a known model"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a)[:40] for a, _ in CASES])
def test_one_line_and_exit_status_2(files, capsys, argv, message):
    argv = [a.format(d=files) for a in argv] + ["--quiet"] * (argv[0] != "frobnicate")
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own errors exit
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenpatch"), err
    assert message.format(d=files) in lines[0], lines[0]


def test_no_traceback_unless_debug(files):
    argv = [sys.executable, "-m", "tokenpatch", "verify", "--checkpoint", str(files / "folder"), "--quiet"]
    plain = subprocess.run(argv, capture_output=True, text=True)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and len(plain.stderr.splitlines()) == 1
    debug = subprocess.run(argv + ["--debug"], capture_output=True, text=True)
    assert "Traceback" in debug.stderr and "FileFormatError" in debug.stderr
    env = {**os.environ, "TOKENPATCH_DEBUG": "1"}
    assert "Traceback" in subprocess.run(argv, capture_output=True, text=True, env=env).stderr


@pytest.mark.parametrize(
    "command", ["train", "verify", "generate", "reproduce", "markov predictors", "markov train", "markov report"]
)
def test_help_shows_every_default(command, capsys):
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    out = capsys.readouterr().out.split("options:", 1)[1]
    switches = {"--help", "--quiet", "--debug", "--json", "--no-resume", "--no-residual", "--minimal", "--reduced"}
    entries = re.split(r"\n  (?=-)", out)[1:]  # one entry per option: "--name METAVAR  help (default: x)"
    assert len(entries) >= 7
    for entry in entries:
        name = entry.split()[-1 if entry.startswith("-h") else 0].rstrip(",")
        name = "--help" if entry.startswith("-h") else name
        if name not in switches and "(required)" not in " ".join(entry.split()):
            assert "default:" in " ".join(entry.split()), (name, entry)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["verify", "--model", "gpt-17"], "not a known model"),
        (["verify", "--prompt", "hello"], "add --model"),
        (["verify", "--query", "hello"], "'last' or 'all'"),
        (["verify", "--model", "smollm2-135m", "--prompt", "hello"], "--query TEXT"),
        (
            ["verify", "--model", "smollm2-135m", "--checkpoint", "x.safetensors", "--prompt", "a", "--query", "b"],
            "exclude",
        ),
        (["generate", "--model", "gpt-17", "--prompt", "hello"], "not a known model"),
        (["compress", "--out", "d", "--model", "gpt-17", "--task", "antonym"], "not a known model"),
        (["compress", "--out", "d", "--task", "antonym"], "--task is for a language model: add --model NAME"),
        (["compress", "--out", "d", "--model", "smollm2-135m"], "one of --task TASK"),
        (["compress", "--out", "d", "--model", "smollm2-135m", "--task", "capitals"], "unknown task ['capitals']"),
        (
            ["compress", "--out", "p.safetensors", "--model", "smollm2-135m", "--prompt", "Q: a", "--queries", "q.txt"]
            + ["--calibration", "8"],
            "--calibration N samples calibration queries; --queries FILE gives them: pass one",
        ),
    ],
)
def test_language_model_options_are_checked(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- checked before torch loads

_NO_TORCH = """import sys
from tokenpatch.workbench.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:  # argparse's own errors exit
    rc = exc.code
print('torch' in sys.modules, rc)
"""


@pytest.mark.parametrize(
    "argv,message",
    [
        (["verify", "--model", "smollm2-135mm"], "--model 'smollm2-135mm' is not a known model"),
        (["generate", "--model", "gemma3-270", "--prompt", "hi"], "--model 'gemma3-270' is not a known model"),
        (["induction", "scores", "--model", "gpt-17"], "--model 'gpt-17' is neither a known model"),
        (["verify", "--tasks", "0"], "argument --tasks: 0 is too small"),
        (["markov", "predictors", "--alpha", "0"], "argument --alpha: 0 must be a finite number > 0"),
        (
            ["train", "--out", "{d}/new.safetensors", "--d-model", "10", "--heads", "4"],
            "d_model=10 is not divisible by n_heads=4",
        ),
        (["verify", "--checkpoint", "{d}/missing.safetensors"], "no such file: {d}/missing.safetensors"),
        (
            ["verify", "--checkpoint", "{d}/patch.safetensors"],
            "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1'",
        ),
        (
            ["generate", "--model", "smollm2-135m", "--prompt", "hi", "--patch", "{d}/missing.safetensors"],
            "no such file",
        ),
        (
            ["generate", "--model", "smollm2-135m", "--prompt", "hi", "--patch", "{d}/patch.safetensors"],
            "--patch {d}/patch.safetensors is not a patch of smollm2-135m: it was made on a model with class 'ICLTransformer'",
        ),
        (
            ["compress", "--out", "{d}/p.safetensors", "--prompt", "{d}/notes.txt"],
            "--prompt {d}/notes.txt is not a safetensors file",
        ),
        (
            ["compress", "--out", "d", "--model", "smollm2-135m", "--prompt", "Q:", "--queries", "{d}/none.txt"],
            "No such file",
        ),
        (
            ["reproduce", "--checkpoint", "{d}/other.safetensors"],
            "is a safetensors file but not one written by tokenpatch",
        ),
        (
            ["induction", "train", "--out", "{d}/patch.safetensors"],
            "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1'",
        ),
    ],
    ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else None,
)
def test_mistakes_are_reported_before_torch_loads(files, argv, message):
    argv = [a.format(d=files) for a in argv] + ["--quiet"]
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "2"], (done.stdout, done.stderr)  # exit status 2, torch never imported
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenpatch"), done.stderr
    assert message.format(d=files) in lines[0], lines[0]


@pytest.mark.parametrize(
    "code",
    [
        "import tokenpatch",
        "import tokenpatch as tp; tp.__version__; tp.TokenpatchError",
        "import tokenpatch.workbench.zoo.pretrained as p; p.pretrained_names(); p.check_requirements",
        "import tokenpatch.workbench.cli.main, tokenpatch.workbench.cli.lm, tokenpatch.workbench.cli.markov, "
        "tokenpatch.workbench.cli.induction",
        "import runpy, sys; sys.argv = ['tokenpatch', '--version']\n"
        "try:\n    runpy.run_module('tokenpatch', run_name='__main__')\nexcept SystemExit:\n    pass",
    ],
)
def test_imports_load_no_torch(code):
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print('torch' in sys.modules, 'transformers' in sys.modules)"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["False", "False"], done.stdout


def test_the_lazy_face_resolves_every_name():
    import importlib

    assert tp.token_patch is importlib.import_module("tokenpatch.patching").token_patch
    assert tp.verify is importlib.import_module("tokenpatch.verify").verify  # the function, not the module
    assert tp.generate is importlib.import_module("tokenpatch.generate").generate
    assert tp.register_adapter is importlib.import_module("tokenpatch.arch").register
    assert tp.diagnostics is importlib.import_module("tokenpatch.dynamics.diagnostics")
    assert tp.__version__ == importlib.import_module("tokenpatch.version").__version__
    for name in tp.__all__:
        assert getattr(tp, name) is not None and name in dir(tp), name
    from tokenpatch import Patch, save_patch  # noqa: F401

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        tp.nothing  # noqa: B018
    with pytest.warns(DeprecationWarning, match="use tokenpatch.save_patch"):
        assert tp.save is tp.save_patch


def test_the_lazy_face_in_a_fresh_process():
    code = (
        "import sys, tokenpatch as tp\n"
        "import tokenpatch.verify\n"  # binds the submodule on the package: the function keeps the name
        "assert tp.verify is sys.modules['tokenpatch.verify'].verify, tp.verify\n"
        "from tokenpatch import Patch\n"
        "assert Patch is sys.modules['tokenpatch.patch'].Patch\n"
        "assert tp.diagnostics.__name__ == 'tokenpatch.dynamics.diagnostics'\n"
        "assert tp.tasks.linreg.LinRegTask is tp.LinRegTask and tp.models.SHIPPED\n"  # submodules, as before
        "assert set(tp.__all__) <= set(dir(tp))\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("first", ["from tokenpatch.tasks import wordpairs", "import tokenpatch.interp.phases"])
def test_a_subpackage_imported_first_another_way_still_reaches_its_modules(first):
    """``tp.tasks.linreg`` after ``tokenpatch.tasks`` was imported by another route (which binds the package
    without the face's help): the subpackage imports its modules on first use."""
    code = (
        f"import tokenpatch as tp\n{first}\n"
        "assert tp.tasks.linreg.task_of and tp.interp.circuits.phi and tp.interp.induction.head_scores\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


def test_the_lazy_table_is_the_type_checking_block():
    """``tokenpatch/__init__.py`` names every public name twice: in the imports for readers and type
    checkers, and in the table the lazy imports read. They must agree."""
    import ast
    from pathlib import Path

    source = Path(tp.__file__).read_text(encoding="utf-8")
    block = next(
        n for n in ast.parse(source).body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
    )
    declared = {}
    for node in block.body:
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            declared[alias.asname or alias.name] = (
                (full, None) if full == "tokenpatch.dynamics.diagnostics" else (node.module, alias.name)
            )
    assert declared == tp._WHERE
    assert sorted(declared) == sorted(tp.__all__)


def test_cli_defaults_are_the_library_values():
    from tokenpatch.lora import CONFIG_FILE
    from tokenpatch.models.hf_layers import HF_LAYERS
    from tokenpatch.models.icl import MODEL_FORMAT, NORMS
    from tokenpatch.models.layers import LAYERS
    from tokenpatch.models.markov import MarkovModel
    from tokenpatch.patch_files import PATCH_FORMAT
    from tokenpatch.tasks.markov import MarkovTask
    from tokenpatch.workbench.cli import defaults as d
    from tokenpatch.workbench.train.linreg import DEFAULT_MODEL, DEFAULT_TASK, DEFAULT_TRAIN
    from tokenpatch.workbench.train.markov import MarkovTrain

    assert d.LAYERS == tuple(sorted(LAYERS)) and d.HF_LAYERS == tuple(sorted(HF_LAYERS)) and d.NORMS == NORMS
    assert (d.MODEL_FORMAT, d.PATCH_FORMAT) == (MODEL_FORMAT, PATCH_FORMAT)
    assert d.LORA_CONFIG == CONFIG_FILE
    for values, obj in (
        (d.LINREG_TASK, DEFAULT_TASK),
        (d.LINREG_MODEL, DEFAULT_MODEL),
        (d.LINREG_TRAIN, DEFAULT_TRAIN),
        (d.MARKOV_TASK, MarkovTask()),
        (d.MARKOV_MODEL, MarkovModel()),
        (d.MARKOV_TRAIN, MarkovTrain()),
    ):
        assert values == {k: getattr(obj, k) for k in values}, type(obj).__name__
    for layer in d.LAYERS + d.HF_LAYERS:  # the layers ICLConfig holds to d_model % n_heads == 0
        with (
            pytest.raises(tp.InputError, match="not divisible")
            if layer in d.HEADED_LAYERS
            else contextlib.nullcontext()
        ):
            tp.ICLConfig(d_in=3, d_model=10, n_heads=4, layer=layer)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("missing.safetensors", "tokenpatch.model/1"),
        ("folder", "tokenpatch.model/1"),
        ("notes.txt", "tokenpatch.model/1"),
        ("other.safetensors", "tokenpatch.patch/1"),
        ("patch.safetensors", "tokenpatch.model/1"),
        ("truncated", "tokenpatch.patch/1"),
    ],
)
def test_the_header_check_says_what_the_full_reader_says(files, name, kind):
    from tokenpatch import files as full
    from tokenpatch.workbench.cli.args import read_header

    if name == "truncated":
        data = (files / "patch.safetensors").read_bytes()
        (files / name).write_bytes(data[: 8 + int.from_bytes(data[:8], "little") // 2])
    errors = []
    for read in (read_header, full.read_file):
        with pytest.raises((tp.FileFormatError, FileNotFoundError)) as caught:
            read(str(files / name), kind)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


def test_the_header_check_passes_what_the_full_reader_reads(files):
    from tokenpatch import files as full
    from tokenpatch.workbench.cli.args import read_header

    names, doc = read_header(str(files / "patch.safetensors"), "tokenpatch.patch/1")
    tensors, want = full.read_file(files / "patch.safetensors", "tokenpatch.patch/1")
    assert doc == want and sorted(names) == sorted(tensors)
    assert read_header(str(files / "other.safetensors")) == (["x"], {})


def test_a_patch_record_is_matched_against_the_registry():
    from tokenpatch.workbench.zoo.pretrained import PRETRAINED, record_mismatch

    smol = PRETRAINED["smollm2-135m"]
    own = {
        "class": smol.hf_class,
        "adapter": "hf",
        "model_type": smol.model_type,
        "n_layers": smol.n_layers,
        "hidden_size": 576,
        "fingerprint": "x",
    }
    assert record_mismatch("smollm2-135m", own) is None
    assert record_mismatch("smollm2-135m", None) is None  # no record: the full check after loading decides
    assert "n_layers 18" in record_mismatch("smollm2-135m", {**own, "n_layers": 18})
    gemma = record_mismatch("gemma3-270m", own)
    assert "class 'LlamaForCausalLM'" in gemma and "gemma3-270m is a Gemma3ForCausalLM" in gemma
