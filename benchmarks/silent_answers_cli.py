"""Issue 41's cases 4 (the command line, through the installed ``tokenpatch``) and 5 (``verify``'s note on
float32 norms), for ``silent_answers.py``, which runs and prints them."""

from __future__ import annotations

import copy
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from silent_answers_tools import LM, NOT_FIXED, folder, gap, ids, quiet_thought

import tokenpatch as tp
from tokenpatch.testing import float64_norms, tiny_hf_model
from tokenpatch.workbench.cli.args import read_text_file

__all__ = ["case_4a", "case_4bcd", "case_4efg", "case_5"]


# ------------------------------------------------------------------------------------- 4. command line
def cli(argv: str | list, cwd: Path, interrupt_on: str | None = None) -> dict:
    """The installed ``tokenpatch`` run in ``cwd`` (``interrupt_on``: Ctrl-C once that path exists there)."""
    command = shutil.which("tokenpatch", path=str(Path(sys.executable).parent)) or "tokenpatch"
    start, argv = time.perf_counter(), argv.split() if isinstance(argv, str) else argv
    proc = subprocess.Popen([command, *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while interrupt_on and proc.poll() is None and not (cwd / interrupt_on).exists():
        time.sleep(0.01)
    if interrupt_on and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, err = (s.decode(errors="replace") for s in proc.communicate())
    lines, took = err.strip().splitlines() or [""], time.perf_counter() - start
    return dict(rc=proc.returncode, tb="Traceback" in out + err, last=lines[-1], n=len(lines), s=took)


def said(run: dict, rc: int, match: str = "") -> str:
    """``rc N, traceback or not, seconds, the last stderr line``: NOT FIXED unless exit status ``rc`` without
    a traceback, and for an error one stderr line with ``match``."""
    good = run["rc"] == rc and not run["tb"] and (rc == 0 or (run["n"] == 1 and re.search(match, run["last"])))
    tb, line = "traceback" if run["tb"] else "no traceback", f"`{run['last']}`" if run["last"] else "stderr empty"
    return f"{'' if good else NOT_FIXED + ' '}rc {run['rc']}, {tb}, {run['s']:.0f} s, {line}"


PROMPTS = {  # the issue's prompts, as tests/test_cli_compress_prompts.py writes them
    "greeting": "Hello",
    "instruction": "Translate the English word into French.",
    "persona": "You are a pirate. Answer every question like one.",
    "plain text": "The river ran cold through the valley, past the mill and the old stone bridge.",
    "arrow pairs": "hot -> cold\nbig -> small\n",
    "one line Q A": "Q: hot A: cold",
}


def case_4a(all_prompts: bool):
    for kind, prompt in PROMPTS.items():
        for n in (1, 8) if all_prompts or kind == "greeting" else (1,):
            where, argv = folder("compress-"), f"--model {LM} --calibration {n} --out p.safetensors --quiet"
            run = cli(["compress", "--prompt", prompt, *argv.split()], where)
            out = {"": said(run, 0)}
            if run["rc"] == 0:
                out["tp.load_patch reads"] = f"{len(list(tp.load_patch(where / 'p.safetensors').keys()))} tensors"
            yield f"4a/{kind}, --calibration {n}", out
    run = cli(["compress", "--model", LM, "--prompt", " \t\n ", "--out", "p.safetensors"], folder("compress-"))
    yield "4a whitespace", {"": said(run, 2, "only whitespace")}


def pairs(path: Path, n: int, head: str = "", tail: str = "") -> str:
    path.write_text(head + "".join(f"word{i}\tWORD{i}\n" for i in range(n)) + tail, encoding="utf-8")
    return path.name


def case_4bcd():
    where, compress = folder("cli-"), f"compress --model {LM} "
    long = pairs(where / "long.tsv", 90, tail="x\t" + "y" * 2_000_000 + "\n")
    yield "4b", {"": said(cli(compress + f"--task-file {long} --out c", where), 2, "characters long")}
    (where / "q.txt").write_text("\ufeffhot\nbig\n", encoding="utf-8")
    pairs(where / "bom.tsv", 90, head="\ufeff")
    firsts = [read_text_file(str(where / f), "--queries").splitlines()[0] for f in ("bom.tsv", "q.txt")]
    out = {"first lines read": " and ".join(map(repr, firsts)) + NOT_FIXED * ("\ufeff" in "".join(firsts))}
    run = cli(compress + "--prompt Opposites. --queries q.txt --ridge 1 --out p.safetensors --quiet", where)
    yield "4c", {**out, "compress --queries (the BOM file)": said(run, 0)}
    own = compress + "--prompt Q: --calibration 1 "
    out = {"--out X --lora X": said(cli(own + "--out X --lora X", where), 2, "would be the --lora folder")}
    out["X written"] = str((where / "X").exists())
    yield "4d", {**out, "--lora without --model": said(cli("compress --out p --lora l", where), 2, "add --model")}


@torch.no_grad()
def case_4efg():
    from peft import PeftModel

    model, where = tiny_hf_model("qwen3_moe", mlp_only_layers=[0, 1, 2]), folder("cli-")
    fit, x = quiet_thought(model, ids(1, 6, 3)[0], ids(16, 4, 4)), ids(3, 9, 5)
    tp.save_lora(model, fit, where / "dense")
    with tp.apply(model, fit.patch):
        want = model(x).logits
    yield "4e", {"": gap(PeftModel.from_pretrained(copy.deepcopy(model), where / "dense").eval()(x).logits, want)}
    markov = "markov train --steps 100 --length 8 --d-model 8 --layers 1 --chains 1 --states 2 --batch-size 2 --quiet"
    cut = cli(f"{markov} --out run", where, interrupt_on="run/step-0000000.safetensors")  # at its first file
    out = {"Ctrl-C": f"rc {cut['rc']}, left [{', '.join(p.name for p in (where / 'run').iterdir())}]"}
    (where / "early").mkdir()  # stopped in its first evaluation (as tests/test_cli_inputs.py leaves it)
    (where / "early" / "step-0000000.safetensors").write_bytes(b"")
    out["rerun"] = said(cli(f"{markov} --out run", where), 0)
    yield "4f", {**out, "rerun on an empty first snapshot": said(cli(f"{markov} --out early", where), 0)}
    llama = tiny_hf_model("llama")
    tp.save_lora(llama, quiet_thought(llama, ids(1, 6)[0], ids(6, 3, 2)), where / "p-lora")
    run = cli(f"generate --model {LM} --prompt a --patch p-lora/adapter_model.safetensors", where)
    yield "4g lora", {"": said(run, 2, "is a peft LoRA adapter's weights")}
    run = cli(["generate", "--model", LM, "--prompt", b"Q: a\nA: caf\xe9\n"], where)  # a Latin-1 byte
    yield "4g utf8", {"": said(run, 2, "not UTF-8")}


# ------------------------------------------------------------------------------------ 5. verify's note
@torch.no_grad()
def case_5():
    for name in ("olmo2", "exaone4"):
        model, x = tiny_hf_model(name), ids(2, 9)
        result = tp.verify(model, tp.token_patch(model, x), x)
        with float64_norms():
            exact = tp.verify(model, tp.token_patch(model, x), x).max_abs
        hint = "tokenpatch.testing.float64_norms" in result.why and result.float32_sites
        note = result.why if hint else f"{NOT_FIXED} {result.why!r}"
        ok = f"{result.ok()}, max abs {result.max_abs:.1e}"
        yield f"5 {name}", {"ok()": ok, "note": note, "under float64_norms": exact}
