"""Every user mistake on the command line: one line on stderr naming what is wrong and what to
do, exit status 2, no traceback (``--debug`` shows it)."""

from __future__ import annotations

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
    (["verify", "--checkpoint", "{d}/patch.safetensors"], "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1' (a patch file"),
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
    (["train", "--layer", "mamba"], "argument --layer: invalid choice: 'mamba' (choose from 'gru', 'linear', 'lstm', 'rnn', 'softmax')"),
    (["train", "--norm", "middle"], "argument --norm: invalid choice: 'middle'"),
    (["train", "--steps", "0"], "argument --steps: 0 is too small"),
    (["train", "--context", "-1"], "argument --context: -1 is too small"),
    (["train", "--lr", "-0.1"], "argument --lr: -0.1 must be a finite number > 0"),
    (["train", "--noise", "nan"], "argument --noise: nan must be a finite number >= 0"),
    (["train", "--out", "{d}/new.safetensors", "--d-model", "10", "--heads", "4"], "d_model=10 is not divisible by n_heads=4"),
    (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
    (["markov", "predictors", "--alpha", "0"], "argument --alpha: 0 must be a finite number > 0"),
    (["markov", "predictors", "--states", "1"], "argument --states: 1 is too small: it must be at least 2"),
    (["markov", "predictors", "--length", "200", "--sequences", "0"], "argument --sequences: 0 is too small"),
    (["markov", "probe", "--run", "{d}/folder"], "--run {d}/folder holds no Markov run"),
    (["markov", "train", "--out", "{d}/notes.txt"], "--out {d}/notes.txt is a file; give a folder for the run"),
    (["markov", "train", "--out", "{d}"], "--out {d} is a folder with other files in it"),
    (["markov", "report", "--out", "{d}/notes.txt"], "--out {d}/notes.txt is a file; give a folder for the report"),
    (["markov", "sweep"], "argument markov_command: invalid choice: 'sweep'"),
    (["markov", "train", "--out", "{d}/run", "--seed", "-1"], "argument --seed: -1 is too small: it must be at least 0"),
    (["induction", "scores", "--model", "gpt-17"], "--model 'gpt-17' is neither a known model"),
    (["induction", "scores", "--model", "{d}/patch.safetensors"], "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1'"),
    (["induction", "scores", "--model", "{d}/notes.txt"], "is not a readable safetensors file"),
    (["induction", "scores", "--model", "x", "--length", "1"], "argument --length: 1 is too small"),
    (["induction", "train", "--out", "{d}/lm.pt"], "--out {d}/lm.pt: give a file path ending in .safetensors"),
    (["induction", "train", "--out", "{d}/lm.safetensors", "--follow", "1.5"], "--follow 1.5: a probability, in [0, 1]"),
    (["induction", "train", "--out", "{d}/lm.safetensors", "--heads", "3"], "--d-model 64 is not divisible by --heads 3"),
    (["induction", "train", "--out", "{d}/patch.safetensors"], "holds a 'tokenpatch.patch/1', not a 'tokenpatch.model/1'"),
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


@pytest.mark.parametrize("command", ["train", "verify", "generate", "reproduce", "markov predictors", "markov train",
                                     "markov report"])
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


@pytest.mark.parametrize("argv, message", [
    (["verify", "--model", "gpt-17"], "not a known model"),
    (["verify", "--prompt", "hello"], "add --model"),
    (["verify", "--query", "hello"], "'last' or 'all'"),
    (["verify", "--model", "smollm2-135m", "--prompt", "hello"], "--query TEXT"),
    (["verify", "--model", "smollm2-135m", "--checkpoint", "x.safetensors", "--prompt", "a", "--query", "b"], "exclude"),
    (["generate", "--model", "gpt-17", "--prompt", "hello"], "not a known model"),
    (["compress", "--out", "d", "--model", "gpt-17", "--task", "antonym"], "not a known model"),
    (["compress", "--out", "d", "--task", "antonym"], "--task is for a language model: add --model NAME"),
    (["compress", "--out", "d", "--model", "smollm2-135m"], "either --task TASK"),
    (["compress", "--out", "d", "--model", "smollm2-135m", "--task", "capitals"], "unknown task ['capitals']"),
    (["compress", "--out", "p.safetensors", "--model", "smollm2-135m", "--prompt", "Q: a"], "needs --queries FILE"),
])
def test_language_model_options_are_checked(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
