"""Every input of every command is answered (issue 20, items 5, 6 and 9): an empty value, text that is not
UTF-8 (on Linux a byte that is not UTF-8 arrives as a surrogate escape, ``"caf\\udce9"``), a binary file, a
folder that does not exist, an output that cannot be written. A mistake is one line on stderr and exit
status 2, before torch or a model loads; no path prints a traceback. Outputs are checked before the work and
created without replacing a file that appeared meanwhile; long runs keep their finished parts and resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import tokenpatch as tp
from tokenpatch.workbench.cli import induction as cli_induction
from tokenpatch.workbench.cli import lm as cli_lm
from tokenpatch.workbench.cli.main import main

NOT_UTF8 = "caf\udce9"  # b"caf\xe9" (Latin-1) as Python hands it over from argv on Linux


class Reached(BaseException):  # not an Exception: main answers those in one line (exit status 3)
    """The command passed its checks and reached its model or its long work (stubbed here)."""


def _reached(*args, **kwargs):
    raise Reached


@pytest.fixture
def no_work(monkeypatch):
    """Real models and the long runs stubbed: reaching one means the input was accepted."""
    from tokenpatch.workbench.report import icl_sgd_page
    from tokenpatch.workbench.report import induction as report_induction
    from tokenpatch.workbench.report import markov as report_markov
    from tokenpatch.workbench.report import reproduce as report_reproduce
    from tokenpatch.workbench.zoo import pretrained

    for owner in (pretrained, cli_lm, cli_induction, icl_sgd_page):
        monkeypatch.setattr(owner, "load_pretrained", _reached)
    for owner, name in [(report_markov, "markov_section"), (report_induction, "run_lm")]:
        monkeypatch.setattr(owner, name, _reached)
    monkeypatch.setattr(report_induction, "run_model", _reached)
    monkeypatch.setattr(report_reproduce, "reproduce", _reached)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 4)  # not UTF-8, not safetensors
    tiny = tp.ICLTransformer(tp.ICLConfig(d_in=5, d_model=4, n_layers=1, n_heads=1))
    tp.save_model(tiny, d / "tiny.safetensors")
    tp.save_model(tiny, d / "lm.safetensors")  # a tokenpatch.model/1 file: what `induction --model PATH` checks
    (d / "queries.txt").write_text("Q: tree\nA:\n")
    return d


def _run(argv: list[str], capsys) -> tuple[object, str, str]:
    try:
        status = main([*argv, "--quiet"])
    except SystemExit as exc:  # argparse's own errors exit
        status = exc.code
    except Reached:
        status = "reached"
    out, err = capsys.readouterr()
    return status, out, err


def _one_line(status, out: str, err: str) -> str:
    assert status == 2, (status, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenpatch "), err
    assert "Traceback" not in out + err
    return lines[0]


# --------------------------------------------------------------------------------------------- the sweep

TINY_TRAIN = "--steps 1 --layers 1 --d-model 4 --heads 1 --dim 1 --context 2 --batch-size 2".split()
TINY_MARKOV = "--steps 2 --length 8 --d-model 8 --layers 1 --chains 1 --states 2 --batch-size 2".split()
TINY_LM = "--steps 2 --vocab 5 --length 8 --d-model 8 --layers 1".split()
TINY_COMPRESS = ["--checkpoint", "{d}/tiny.safetensors", "--calibration", "16", "--test", "0"]
LM = "smollm2-135m"
OK, REACHED = {"missing": "ok"}, {"missing": "reached"}  # a missing folder is created: the run goes on

# (argv with {v} for the value under test, what the argument is, its file name in a missing folder,
#  the kinds whose answer is not an error: "ok" (runs, exit 0) or "reached" (passes its checks))
SLOTS = [
    (["train", "--out", "{v}", *TINY_TRAIN], "out", "run.safetensors", OK),
    (["train", "--out", "{t}/run.safetensors", "--export", "{v}", *TINY_TRAIN], "out", "e.safetensors", OK),
    (["verify", "--checkpoint", "{v}", "--tasks", "2"], "in", "x.safetensors", {}),
    (["verify", "--query", "{v}"], "text", "", {}),
    (["verify", "--model", "{v}", "--prompt", "a", "--query", " b"], "in", "x", {}),
    (["verify", "--model", LM, "--prompt", "{v}", "--query", " b"], "text", "", {}),
    (["verify", "--model", LM, "--prompt", "a", "--query", "{v}"], "text", "", {}),
    (["generate", "--model", "{v}", "--prompt", "a"], "in", "x", {}),
    (["generate", "--model", LM, "--prompt", "{v}"], "text", "", {}),
    (["generate", "--model", LM, "--prompt", "a", "--patch", "{v}"], "in", "p.safetensors", {}),
    (["generate", "--model", LM, "--prompt", "a", "--plot", "{v}"], "out", "norms.png", REACHED),
    (["compress", "--out", "{v}", *TINY_COMPRESS], "out", "p.safetensors", OK),
    (["compress", "--out", "{t}/p.safetensors", "--checkpoint", "{v}"], "in", "x.safetensors", {}),
    (["compress", "--out", "{t}/p.safetensors", "--prompt", "{v}"], "in", "x.safetensors", {}),
    (["compress", "--out", "{t}/p.safetensors", "--queries", "{v}"], "in", "x.safetensors", {}),
    (["compress", "--model", "{v}", "--task", "antonym", "--out", "{t}/c"], "in", "x", {}),
    (["compress", "--model", LM, "--task", "{v}", "--out", "{t}/c"], "text", "", {}),
    (["compress", "--model", LM, "--task", "antonym", "--out", "{v}"], "out", "c", REACHED),
    (["compress", "--model", LM, "--prompt", "{v}", "--queries", "{d}/queries.txt", "--out", "{t}/p"], "text", "", {}),
    (["compress", "--model", LM, "--prompt", "Q:", "--queries", "{v}", "--out", "{t}/p"], "in", "q.txt", {}),
    (
        ["compress", "--model", LM, "--prompt", "Q:", "--queries", "{d}/queries.txt", "--out", "{v}"],
        "out",
        "p",
        REACHED,
    ),
    (
        [
            "compress",
            "--model",
            LM,
            "--prompt",
            "Q:",
            "--queries",
            "{d}/queries.txt",
            "--out",
            "{t}/p",
            "--lora",
            "{v}",
        ],
        "out",
        "adapter",
        REACHED,
    ),
    (["markov", "train", "--out", "{v}", *TINY_MARKOV], "out", "run", OK),
    (["markov", "probe", "--run", "{v}"], "in", "run", {}),
    (["markov", "report", "--out", "{v}", "--reduced"], "out", "r", REACHED),
    (["induction", "scores", "--model", "{v}"], "in", "lm.safetensors", {}),
    (["induction", "train", "--out", "{v}", *TINY_LM], "out", "lm.safetensors", OK),
    (["induction", "report", "--model", "{v}", "--out", "{t}/r"], "in", "lm.safetensors", {}),
    (["induction", "report", "--model", "{d}/lm.safetensors", "--out", "{v}"], "out", "r", REACHED),
    (["icl-sgd", "--model", LM, "--out", "{v}"], "out", "r", REACHED),
    (["reproduce", "--out", "{v}"], "out", "r", REACHED),
    (["reproduce", "--checkpoint", "{v}"], "in", "x.safetensors", {}),
]


def _cases():
    for argv, role, name, fine in SLOTS:
        flag = argv[argv.index("{v}") - 1]
        kinds = ["empty", "not-utf8"] + ([] if role == "text" else ["binary", "missing"])
        kinds += ["unwritable"] if role == "out" else []
        for kind in kinds:
            yield pytest.param(
                argv,
                role,
                name,
                kind,
                fine.get(kind, "error"),
                id=f"{' '.join(argv[: 1 + (argv[0] in ('markov', 'induction'))])} {flag} {kind}",
            )


def _value(role: str, name: str, kind: str) -> str:
    return {
        "empty": "",
        "not-utf8": NOT_UTF8 if role == "text" else "{t}/" + NOT_UTF8 + (Path(name).suffix or ""),
        "binary": "{d}/binary.bin",
        "missing": "{t}/missing/folder/" + name,
        "unwritable": "/sys/tokenpatch-test/" + name,  # even root cannot create a file there
    }[kind]


@pytest.mark.parametrize("argv,role,name,kind,expected", list(_cases()))
def test_every_input_of_every_command(inputs, tmp_path, capsys, no_work, argv, role, name, kind, expected):
    value = _value(role, name, kind).format(d=inputs, t=tmp_path)
    argv = [value if a == "{v}" else a.format(d=inputs, t=tmp_path) for a in argv]
    if kind == "unwritable" and not Path("/sys").is_dir():
        pytest.skip("needs a read-only /sys (Linux)")
    status, out, err = _run(argv, capsys)
    assert "Traceback" not in out + err
    if expected == "error":
        line = _one_line(status, out, err)
        if kind == "unwritable":  # refused before the work, naming the path given, not a temporary file
            assert "cannot be written" in line and ".tmp" not in line and "partial" not in line, line
    else:
        assert status == (0 if expected == "ok" else "reached"), (status, err)
        assert len(err.strip().splitlines()) <= 1, err


def test_the_sweep_covers_every_subcommand(capsys):
    """Every command and subcommand the parser has; ``markov predictors`` takes numbers and choices only."""
    import re

    def choices(argv):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        return re.search(r"\{([a-z,-]+)\}", capsys.readouterr().out).group(1).split(",")

    families = ("markov", "induction")
    every = {f"{c} {s}" for c in families for s in choices([c])} | set(choices([])) - set(families)
    covered = {" ".join(argv[: 1 + (argv[0] in families)]) for argv, *_ in SLOTS}
    assert every - covered == {"markov predictors"} and covered <= every


# ----------------------------------------------------------------------------------------- item 6, each case


def test_generate_refuses_an_empty_prompt_before_the_model(capsys, no_work):
    line = _one_line(*_run(["generate", "--model", LM, "--prompt", ""], capsys))
    assert "--prompt is empty" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--model", LM, "--prompt", NOT_UTF8, "--query", " b"],
        ["generate", "--model", LM, "--prompt", NOT_UTF8],
        ["generate", "--model", LM, "--prompt", "Q: a", "--max-new-tokens", "1", "--json", "--plot", NOT_UTF8 + ".png"],
    ],
    ids=["verify --model", "generate", "generate --plot"],
)
def test_text_that_is_not_utf8_is_one_line(capsys, no_work, argv):
    line = _one_line(*_run(argv, capsys))
    assert "is not UTF-8" in line and "caf\\xe9" in line


def test_compress_queries_that_are_a_binary_file(inputs, tmp_path, capsys, no_work):
    argv = ["compress", "--model", LM, "--prompt", "Q:", "--queries", f"{inputs}/binary.bin", "--out", f"{tmp_path}/p"]
    line = _one_line(*_run(argv, capsys))
    assert f"--queries {inputs}/binary.bin is not UTF-8 text" in line


def test_generate_plot_is_checked_before_the_run(tmp_path, capsys, no_work):
    argv = ["generate", "--model", LM, "--prompt", "Q: a"]
    status, _, err = _run([*argv, "--plot", str(tmp_path / "new" / "folder" / "norms.png")], capsys)
    assert status == "reached", err  # a missing folder is created when the figure is written
    for plot, words in [
        (str(tmp_path), "is a folder"),
        ("/sys/tokenpatch-test/norms.png", "cannot be written"),
    ]:
        line = _one_line(*_run([*argv, "--plot", plot], capsys))
        assert words in line, line
    line = _one_line(*_run([*argv, "--plot", str(tmp_path / "n.png"), "--patch", "p.safetensors"], capsys))
    assert "--plot" in line and "--patch" in line


# ------------------------------------------------------------------------------------------- item 9, outputs


def test_an_out_file_that_appears_during_the_run_is_not_replaced(inputs, tmp_path, capsys, monkeypatch):
    from tokenpatch.thought import front

    out = tmp_path / "p.safetensors"
    fit = front.thought_patch

    def meanwhile(*args, **kwargs):
        out.write_text("someone else's file")
        return fit(*args, **kwargs)

    monkeypatch.setattr(front, "thought_patch", meanwhile)
    line = _one_line(*_run(["compress", "--out", str(out), *(a.format(d=inputs) for a in TINY_COMPRESS)], capsys))
    assert out.read_text() == "someone else's file"
    assert f"--out {out} appeared during the run" in line
    kept = line.split("this run's result is in ")[1].split(";")[0].split()[0]
    assert tp.load_patch(kept).static  # the work is kept, under the name the line gives


@pytest.mark.parametrize("links", [True, False], ids=["hard link", "no hard links"])
def test_new_file_never_replaces_a_file(tmp_path, monkeypatch, links):
    import os

    from tokenpatch.workbench.cli.args import new_file

    if not links:  # FAT, some network folders: the name is claimed with O_EXCL, then the file moved in

        def no_link(*args):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    target = tmp_path / "new" / "out.txt"
    with new_file(target, "--out") as tmp:
        assert tmp.suffix == ".txt" and tmp.parent == target.parent  # matplotlib reads the format from it
        tmp.write_text("mine")
    assert target.read_text() == "mine" and [p.name for p in target.parent.iterdir()] == ["out.txt"]
    with pytest.raises(tp.InputError, match="appeared during the run"), new_file(target, "--out") as tmp:
        tmp.write_text("second")
    assert target.read_text() == "mine"
    assert sorted(p.read_text() for p in target.parent.iterdir()) == ["mine", "second"]  # the work is kept


# -------------------------------------------------------------------------------- item 5, several files each


def test_induction_report_refuses_outputs_that_exist(inputs, tmp_path, capsys, no_work):
    (tmp_path / "induction-lm.md").write_text("an earlier report")
    line = _one_line(
        *_run(["induction", "report", "--model", f"{inputs}/lm.safetensors", "--out", str(tmp_path)], capsys)
    )
    assert "induction-lm.md already exists" in line
    assert (tmp_path / "induction-lm.md").read_text() == "an earlier report"


def _fake_result(task: str) -> dict:
    row = dict(correct=1, n=2, accuracy=0.5, kl=0.1, extraction_s=0.0, bytes=1, overhead=1.0, gain_recovered=0.5)
    row.update(ridge=0.1, accuracy_interval={"lo": 0.1, "hi": 0.9})
    row["fits"] = [{"layer": 0, "input_residual": 0.1, "output_residual": 0.1}]
    methods = {m: dict(row, name=m) for m in ("icl", "zero_shot", "task_vector", "thought_patch")}
    tiny = tp.ICLTransformer(tp.ICLConfig(d_in=2, d_model=4, n_layers=1, n_heads=1))
    answers, patches = {"single_token": 2, "pairs": 2}, {"thought_patch": tp.token_patch(tiny, torch.randn(1, 3, 2))}
    return {"task": task, "informative": True, "methods": methods, "answers": answers, "patches": patches}


def test_compress_tasks_resumes_after_an_interrupt(tmp_path, capsys, monkeypatch):
    from tokenpatch.workbench.report import compress as report_compress
    from tokenpatch.workbench.zoo import pretrained

    calls = []

    def compare(model, tokenizer, task, **kwargs):
        calls.append(task.name)
        if task.name == "country_capital" and calls.count("country_capital") == 1:
            raise KeyboardInterrupt
        return _fake_result(task.name)

    monkeypatch.setattr(pretrained, "load_pretrained", lambda *a, **k: (None, None))
    monkeypatch.setattr(report_compress, "compare", compare)
    chosen = {"chosen": {"lead": [1], "lead_text": "<s>", "format": "qa"}, "candidates": []}
    monkeypatch.setattr(report_compress, "choose_prompting", lambda *a, **k: chosen)
    argv = ["compress", "--model", LM, "--task", "antonym,country_capital", "--out", str(tmp_path / "c")]
    status, _, err = _run(argv, capsys)
    assert status == 130, err
    assert calls == ["antonym", "country_capital"]
    status, out, err = _run(argv, capsys)
    assert status == 0, err
    assert calls == ["antonym", "country_capital", "country_capital"]  # antonym read back, not recomputed
    assert "read back 1 finished task (antonym)" in out + err
    run = json.loads((tmp_path / "c" / "compress-smollm2_135m.json").read_text())
    assert list(run["tasks"]) == ["antonym", "country_capital"]
    status, out, err = _run(argv, capsys)  # finished: nothing is overwritten
    assert "already exists" in _one_line(status, out, err)
    other = [a if a != "antonym,country_capital" else "antonym" for a in argv] + ["--shots", "5"]
    for done in (tmp_path / "c").glob("compress-smollm2_135m.*"):
        done.unlink()
    line = _one_line(*_run(other, capsys))
    assert "antonym" in line and "shots" in line  # a finished task of other settings is not mixed in


# ------------------------------------------------------------------------------------ item 9, reproduce

RUNS: list[str] = []


def test_reproduce_keeps_finished_sections_and_resumes(tmp_path, caplog):
    import logging

    from tokenpatch.workbench.report.reproduce import reproduce
    from tokenpatch.workbench.report.section import Section

    RUNS.clear()  # a module global, not a closure: what a section function closes over is part of its inputs

    def first(out, progress=None):
        RUNS.append("first")
        return Section("dynamics", "First", "body one", [], {"x": 1})

    def second(out, progress=None):
        RUNS.append("second")
        if RUNS.count("second") == 1:
            raise KeyboardInterrupt
        return Section("finetune", "Second", "body two", [], {"y": 2})

    with pytest.raises(KeyboardInterrupt):
        reproduce(tmp_path, progress=False, sections={"dynamics": first, "finetune": second})
    assert RUNS == ["first", "second"]
    with caplog.at_level(logging.INFO, logger="tokenpatch.workbench.report.reproduce"):
        reproduce(tmp_path, progress=False, sections={"dynamics": first, "finetune": second})
    assert RUNS == ["first", "second", "second"]  # the finished section is read back
    said = [r.getMessage() for r in caplog.records if "read back" in r.getMessage()]
    assert len(said) == 1 and "dynamics" in said[0], said
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["sections"]["dynamics"]["x"] == 1 and data["sections"]["finetune"]["y"] == 2
    assert "body one" in (tmp_path / "report.md").read_text()

    def changed(out, progress=None):  # other inputs: the section runs again
        RUNS.append("changed")
        return Section("dynamics", "First", "body three", [], {"x": 3})

    reproduce(tmp_path, progress=False, sections={"dynamics": changed})
    assert RUNS[-1] == "changed" and "body three" in (tmp_path / "report.md").read_text()

    def made(value):  # the same function closing over other values: told apart
        def build(out, progress=None):
            RUNS.append(f"made {value}")
            return Section("dynamics", "Made", f"made {value}", [], {})

        return build

    for value in (1, 2, 2):
        reproduce(tmp_path, progress=False, sections={"dynamics": made(value)})
    assert RUNS[-2:] == ["made 1", "made 2"]  # the third: read back
    for _ in range(2):  # a lambda has no name to be told apart by: it always runs
        reproduce(tmp_path, progress=False, sections={"dynamics": lambda out, progress: made(3)(out)})
    assert RUNS[-2:] == ["made 3", "made 3"]


def test_ctrl_c_is_not_swallowed_by_the_commands():
    """No command's module catches KeyboardInterrupt (or everything) where a long loop runs."""
    import re

    root = Path(tp.__file__).parent / "workbench"
    found = []
    for path in sorted([*(root / "cli").glob("*.py"), *(root / "report").glob("*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"except\s*(:|BaseException|KeyboardInterrupt|\(.*BaseException)", line):
                found.append(f"{path.name}:{n}: {line.strip()}")
    allowed = {"main.py"}  # main maps KeyboardInterrupt to exit status 130
    assert [f for f in found if f.split(":")[0] not in allowed] == [], found


def test_compress_lora_takes_a_new_or_empty_folder_and_goes_with_prompt(inputs, tmp_path, capsys, no_work):
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("kept")
    own = ["compress", "--model", LM, "--prompt", "Q:", "--queries", str(inputs / "queries.txt")]
    line = _one_line(*_run([*own, "--out", str(tmp_path / "p"), "--lora", str(used)], capsys))
    assert "is a folder that is not empty; give a new folder" in line
    (tmp_path / "empty").mkdir()
    assert _run([*own, "--out", str(tmp_path / "p"), "--lora", str(tmp_path / "empty")], capsys)[0] == "reached"
    line = _one_line(
        *_run(
            [
                "compress",
                "--model",
                LM,
                "--task",
                "antonym",
                "--out",
                str(tmp_path / "c"),
                "--lora",
                str(tmp_path / "a"),
            ],
            capsys,
        )
    )
    assert "--lora goes with --prompt" in line


def _pairs_file(path: Path, n: int, extra: str = "") -> Path:
    lines = ["# colour words in capitals", "", *(f"word{i}\tWORD{i}|W{i}" for i in range(n))]
    path.write_text("\n".join(lines) + "\n" + extra, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "extra,message",
    [
        ("no tab here\n", r"line 84: expected 'input<TAB>answer\[\|alternative\]', got 'no tab here'"),
        ("word3\tagain\n", r"line 84: the input 'word3' is already on line 6"),
        ("x\t\n", r"line 84: expected"),
        ("x\ta||b\n", r"line 84: expected"),
        ("x\ta\tb\n", r"line 84: expected"),
    ],
)
def test_compress_task_file_names_the_bad_line(inputs, tmp_path, capsys, no_work, extra, message):
    path = _pairs_file(tmp_path / "mine.tsv", 81, extra)
    line = _one_line(*_run(["compress", "--model", LM, "--task-file", str(path), "--out", str(tmp_path / "c")], capsys))
    assert re.search(message, line), line


def test_compress_task_file_too_small_empty_or_with_another_source(inputs, tmp_path, capsys, no_work):
    small = _pairs_file(tmp_path / "small.tsv", 80)
    argv = ["compress", "--model", LM, "--out", str(tmp_path / "c")]
    line = _one_line(*_run([*argv, "--task-file", str(small)], capsys))
    assert "holds 80 pairs; the comparison needs at least 81" in line
    line = _one_line(*_run([*argv, "--task-file", str(small), "--shots", "20"], capsys))
    assert "needs at least 91 (20 demonstrations" in line
    (tmp_path / "empty.tsv").write_text("# nothing\n\n")
    line = _one_line(*_run([*argv, "--task-file", str(tmp_path / "empty.tsv")], capsys))
    assert "holds no pairs; write one pair per line" in line
    line = _one_line(*_run([*argv, "--task-file", str(small), "--task", "antonym"], capsys))
    assert "got --task and --task-file" in line


def test_compress_task_file_runs_the_comparison_on_the_users_pairs(inputs, tmp_path, capsys, no_work, monkeypatch):
    from tokenpatch.workbench.report import compress as report_compress

    seen = {}

    def run_model(name, tasks, **kwargs):
        seen.update(name=name, tasks=tasks)
        raise Reached

    monkeypatch.setattr(report_compress, "run_model", run_model)
    path = _pairs_file(tmp_path / "my colours.tsv", 90)
    status, _, err = _run(["compress", "--model", LM, "--task-file", str(path), "--out", str(tmp_path / "c")], capsys)
    assert status == "reached", err
    (task,) = seen["tasks"]
    assert task.name == "my_colours" and task.description == "colour words in capitals"
    assert len(task.pairs) == 90 and task.pairs[3] == ("word3", ("WORD3", "W3"))


def test_compress_a_prompt_without_queries_reaches_the_model(inputs, tmp_path, capsys, no_work):
    """No query file: the prompted model will write its calibration itself (checked up to the model)."""
    argv = ["compress", "--model", LM, "--prompt", "Q: a\nA: b\n\nQ: c\nA: d", "--out", str(tmp_path / "p")]
    status, _, err = _run(argv, capsys)
    assert status == "reached", err


def test_the_demonstrations_beginning_is_found():
    from tokenpatch.thought.calibration import demonstration_start

    assert demonstration_start("Give the past tense.\n\nQ: walk\nA: walked\n\nQ: go\nA: went\n\n") == "Q:"
    assert demonstration_start("Translate.\n\nEnglish: dog\nFrench: chien\n\nEnglish: cat\nFrench: chat") == "English:"
    assert demonstration_start("In capitals.\nQ: apple -> APPLE\nQ: green -> GREEN\n") == "Q:"  # lines
    assert demonstration_start("Pairs:\n\n- dog = chien\n\n- cat = chat\n\n- sun = soleil") == "-"
    assert demonstration_start("Be concise.") is None
    assert demonstration_start("walk -> walked\n\nrun -> ran") is None


def test_the_demonstrations_separator_is_found():
    from tokenpatch.thought.calibration import demonstration_separator

    assert demonstration_separator("Give the past tense.\n\nQ: walk\nA: walked\n\nQ: go\nA: went\n\n") == "\n\n"
    assert demonstration_separator("In capitals.\nQ: apple -> APPLE\nQ: green -> GREEN\n") == "\n"
    assert demonstration_separator("walk -> walked\nrun -> ran\ngo -> went\n") == "\n"  # lines, no label
    assert demonstration_separator("Be concise.") is None
    assert demonstration_separator("walk -> walked\n\nrun -> ran") is None


# ------------------------------------------------------------------------------------ issue 41, item 4


def test_compress_task_file_refuses_an_over_long_line_before_the_model(inputs, tmp_path, capsys, no_work):
    """A 2 MB line was read into a prompt and asked the model for 250 GB; it is refused by its number."""
    path = _pairs_file(tmp_path / "long.tsv", 90, "x\t" + "y" * 2_000_000 + "\n")
    line = _one_line(*_run(["compress", "--model", LM, "--task-file", str(path), "--out", str(tmp_path / "c")], capsys))
    assert re.search(r"--task-file .*long\.tsv line 93 is 2,000,002 characters long; .* at most 2,000", line), line


def test_compress_queries_refuses_an_over_long_line_before_the_model(inputs, tmp_path, capsys, no_work):
    queries = tmp_path / "q.txt"
    queries.write_text("hot\n\n" + "a" * 5000 + "\n")
    argv = ["compress", "--model", LM, "--prompt", "Opposites.", "--queries", str(queries)]
    line = _one_line(*_run([*argv, "--out", str(tmp_path / "p")], capsys))
    assert re.search(r"--queries .*q\.txt line 3 is 5,000 characters long", line), line


def test_a_byte_order_mark_is_not_part_of_the_first_input(inputs, tmp_path, capsys, no_work, monkeypatch):
    from tokenpatch.workbench.cli.args import read_text_file
    from tokenpatch.workbench.report import compress as report_compress

    seen = {}

    def run_model(name, tasks, **kwargs):
        seen.update(tasks=tasks)
        raise Reached

    monkeypatch.setattr(report_compress, "run_model", run_model)
    path = tmp_path / "bom.tsv"
    path.write_text("\ufeff" + "".join(f"word{i}\tWORD{i}\n" for i in range(90)), encoding="utf-8")
    status, _, err = _run(["compress", "--model", LM, "--task-file", str(path), "--out", str(tmp_path / "c")], capsys)
    assert status == "reached", err
    assert seen["tasks"][0].pairs[0] == ("word0", ("WORD0",))
    (tmp_path / "q.txt").write_text("\ufeffhot\nbig\n", encoding="utf-8")
    assert read_text_file(str(tmp_path / "q.txt"), "--queries") == "hot\nbig\n"  # what --queries reads


def test_compress_lora_is_checked_against_out_and_model_before_the_work(inputs, tmp_path, capsys, no_work):
    own = ["compress", "--model", LM, "--prompt", "Q:", "--queries", str(inputs / "queries.txt")]
    same = str(tmp_path / "x")
    line = _one_line(*_run([*own, "--out", same, "--lora", same], capsys))
    assert f"--out {same} would be the --lora folder" in line
    line = _one_line(*_run([*own, "--out", f"{same}/p.safetensors", "--lora", same], capsys))
    assert "would be inside the --lora folder" in line
    line = _one_line(*_run(["compress", "--out", str(tmp_path / "p"), "--lora", str(tmp_path / "l")], capsys))
    assert "--lora is for a language model: add --model NAME" in line
    line = _one_line(*_run(["compress", "--out", str(tmp_path / "p"), "--task-file", str(tmp_path / "t")], capsys))
    assert "--task-file is for a language model" in line
    assert not any(tmp_path.iterdir())


def _lora_folder(path: Path) -> Path:
    """A folder as ``tp.save_lora`` writes it (its config, and weights with tokenpatch provenance)."""
    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "target_modules": ["up_proj"]}))
    names = (
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight",
    )
    save_file(
        {n: torch.zeros(2, 2) for n in names},
        path / "adapter_model.safetensors",
        metadata={"format": "pt", "tokenpatch": "{}"},
    )
    return path


def test_generate_patch_names_a_lora_adapter(tmp_path, capsys, no_work):
    lora = _lora_folder(tmp_path / "p-lora")
    for given, what in [(lora / "adapter_model.safetensors", "adapter's weights"), (lora, "adapter folder")]:
        line = _one_line(*_run(["generate", "--model", LM, "--prompt", "a", "--patch", str(given)], capsys))
        assert (
            f"--patch {given} is a peft LoRA {what} (written by compress --lora), not a tokenpatch patch file" in line
        )
        assert f"peft.PeftModel.from_pretrained(model, '{lora}')" in line


def test_text_that_is_not_utf8_with_line_breaks_is_one_line(capsys, no_work):
    line = _one_line(*_run(["generate", "--model", LM, "--prompt", "Q: a\nA: " + NOT_UTF8 + "\n"], capsys))
    assert "'Q: a\\nA: caf\\xe9\\n' is not UTF-8" in line


def test_an_unexpected_error_is_one_line_and_the_traceback_needs_debug(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("object of type 'int' has no len()")

    monkeypatch.setattr(cli_lm, "load_pretrained", broken)
    status, out, err = _run(["generate", "--model", LM, "--prompt", "a"], capsys)
    assert status == 3 and "Traceback" not in out + err, (status, err)
    assert err.strip().splitlines() == [
        "tokenpatch generate: internal error: TypeError: object of type 'int' has no len() (rerun with --debug "
        "for the traceback, and report it)"
    ]
    with pytest.raises(TypeError):
        main(["generate", "--model", LM, "--prompt", "a", "--debug"])


def test_markov_train_reruns_in_the_folder_of_a_run_stopped_before_its_first_checkpoint(tmp_path, capsys, no_work):
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-0000000.safetensors").write_bytes(b"")  # a run stopped in its first evaluations
    status, _, err = _run(["markov", "train", "--out", str(run), *TINY_MARKOV], capsys)
    assert status == 0, err
    assert (run / "model.safetensors").is_file()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    line = _one_line(*_run(["markov", "train", "--out", str(tmp_path / "mine"), *TINY_MARKOV], capsys))
    assert "holds files that are not a Markov run (notes.txt); give a new or empty folder" in line


def test_a_ctrl_c_during_an_evaluation_is_honoured_at_once_and_resumed(tmp_path, monkeypatch):
    """The first Ctrl-C waited for the evaluation after the step (tens of seconds early in a run); it cuts it
    short, the checkpoint is the finished step, and the rerun evaluates that step again: the same run."""
    import os
    import signal
    import time

    import tokenpatch.workbench.train.markov as mk

    task, shape = mk.MarkovTask(length=10, chains=3), mk.MarkovModel(d_model=8)
    cfg = mk.MarkovTrain(steps=10, evals=5, eval_sequences=8, checkpoint_every=4)  # evaluations 0 1 2 3 6 10
    full, hist = mk.train_markov(tmp_path / "full", task, shape, cfg, progress=False)
    real, calls = mk.evaluate, []

    def slow(model, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # the evaluation at step 6: Ctrl-C, then 20 s more of work
            os.kill(os.getpid(), signal.SIGINT)
            end = time.monotonic() + 20
            while time.monotonic() < end:
                time.sleep(0.01)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(mk, "evaluate", slow)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        mk.train_markov(tmp_path / "cut", task, shape, cfg, progress=False)
    assert time.monotonic() - start < 10
    monkeypatch.setattr(mk, "evaluate", real)
    resumed, hist2 = mk.train_markov(tmp_path / "cut", task, shape, cfg, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(full.state_dict().values(), resumed.state_dict().values()))
    assert json.dumps(hist) == json.dumps(hist2)
    assert sorted(p.name for p in (tmp_path / "cut").glob("step-*")) == [
        f"step-{s:07d}.safetensors" for s in (0, 1, 2, 3, 6, 10)
    ]
