"""Issue 41's silent wrong answers and raw errors, measured again on the current code.

The audit of issue 41 listed 29 cases where tokenpatch answered wrong without a word, or failed with a raw
error. This script reruns each, on tiny random float64 Hugging Face models (``tokenpatch.testing``) and,
for the command line, on SmolLM2 through the installed ``tokenpatch``, and prints a Markdown table: the
issue's figure (``ISSUE``), then the max abs error (float64) against the reference the issue names, or the
refusal now given (class, first 120 characters), or a command's exit status, traceback or not, wall time and
last stderr line. An "after" that is neither an error <= 1e-12 nor the expected one-line refusal or outcome
is marked NOT FIXED. The guarding tests: tests/test_offload.py, test_rotary_scaling.py,
test_no_silent_patches.py, test_cli_compress_prompts.py, test_cli_inputs.py, test_lora_dense_moe.py,
test_verify_why.py. Cases 4 and 5 are in ``silent_answers_cli.py``, what the cases share in
``silent_answers_tools.py``.

    python benchmarks/silent_answers.py                 # every case (about 5 minutes on 2 cores; SmolLM2's
                                                        # first load converts it, a minute more)
    python benchmarks/silent_answers.py --only 1b 3 4c  # these cases' groups (a number: all its letters)
    python benchmarks/silent_answers.py --all-prompts   # 4a: every prompt also from 8 continuations (+7 min)
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.testing import MOE, float64_norms, tiny_hf_model

sys.path.insert(0, str(Path(__file__).parent))
from silent_answers_cli import case_4a, case_4bcd, case_4efg, case_5  # noqa: E402
from silent_answers_tools import NOT_FIXED, cell, folder, gap, ids, quiet_thought, refused, use_scratch  # noqa: E402

# row: what is measured | before (issue 41's figure)
ISSUE = """
1a llama: offloaded Llama, LoRA from save_lora loaded by peft vs functional_call | off 0.064; LoraExport said ok
1a gpt2: offloaded GPT-2, the same | off 2.2e-4, once 4.9e252; LoraExport said ok
1b qwen3_moe: offloaded Qwen3-MoE, whole model's patch in functional_call; token_patch, verify vs whole | 0.11-0.21 or NaN; token_patch NaN / zero-anchor errors
1b mixtral: offloaded Mixtral, the same | 0.11-0.21 or NaN; once a patch 1.54 off while verify said ok
1c tied: GPT-2, tied embeddings and head on disk: token_patch, verify, generate | `Tensor.item() cannot be called on meta tensors`
1c gemma3: offloaded Gemma 3: save_lora (and its token_patch, functional_call) | `not on the expected device meta`
1c thought qwen3_moe: offloaded Qwen3-MoE: thought_patch, its logits, generate vs whole | `_LinAlgError`; generate: a NaN message
1c thought mixtral: offloaded Mixtral, the same | `_LinAlgError`; generate: a NaN message
2 phi3_longrope: Phi-3 longrope, traj.patch(i) vs tp.token_patch of the prefix (i = 0..8) | 3.0e-3
2 llama_longrope: Llama longrope, the same | 1.2e-3
2 llama_dynamic: Llama dynamic, the same | 6.0e-5
2 thought: one-query thought patches vs the prompted forward (the 3 models, prompts of 4 and 8) | 1.6e-3
2 chunk: chunk patch run with compacted position ids (the 3 models and plain Llama) | 1e-3 to 1.2e-2, unchecked
3a gpt2: GPT-2, Patch.stack([A, B]) and A + B (queries 9, 4) in functional_call | no position ids accepted, off 1.4e-2
3a opt: OPT, the same | no position ids accepted, off 1.5e-2
3b: keep_bos=True thought patch run without its BOS | accepted, off 0.197
3c: functional_call(M, p, **strip_context(M, other_prompt)) | accepted, off 0.25
3d data: p.data edited after a patch was checked (functional_call, apply) | off 0.13, no error
3d step: optimizer step inside tp.apply | half kept (11 of 21 tensors)
3e calibration: tp.thought_patch, empty calibration [0, 3] | raw error
3e prompt: tp.thought_patch, empty prompt | raw error
3e rows: tp.thought_patch, 2-row prompt | raw error
3e dict: tp.thought_patch, dict calibration | raw error
3e batch: functional_call on an empty batch | raw error
3e empty: save_patch(p, "") | OSError Errno 16
3e dot: save_patch(p, ".") | OSError Errno 16
3e slash: save_patch(p, "x/") | silently wrote a file named x
4a: compress --model smollm2-135m --prompt | TypeError traceback after minutes, rc 1
4a whitespace: compress --prompt with whitespace only | TypeError traceback after minutes, rc 1
4b: compress --task-file with one 2 MB line | tried to allocate 250 GB after a minute (traceback)
4c: UTF-8 BOM at the start of a task / queries file | kept silently as part of the first input
4d: compress --out X --lora X; --lora without --model | wrote the patch, failed 50 s later; --lora ignored
4e: save_lora of a Qwen3-MoE whose layers are all dense, loaded by peft, vs tp.apply | peft NoMatchingPeftModuleError
4f: markov train interrupted early, then the same command again | the folder refused, no resume or hint
4g lora: a LoRA folder's weights file as generate --patch | `holds a None, not a 'tokenpatch.patch/1'`
4g utf8: generate --prompt not UTF-8, with line breaks | error on two lines
5 olmo2: tp.verify on tiny OLMo 2 (float64) | ok() False (max abs ~1e-6, float32 norms), no hint
5 exaone4: tp.verify on tiny EXAONE 4 (float64) | ok() False (max abs ~1e-6, float32 norms), no hint
"""
ROWS = {k: tuple(v.split(" | ")) for k, _, v in (r.partition(": ") for r in ISSUE.strip().splitlines())}


# ----------------------------------------------------------------------------------------- 1. offload
@functools.cache
def split(name: str, tied: bool = False):
    """``(model held whole, its weights with layers 1-2 on disk)`` as tests/test_offload.py splits them;
    ``tied``: the tied embedding table and head on disk too. Loaded inside ``float64_norms``, as the tests
    do: accelerate's hooks keep the norms' forward of the load, whatever is patched later."""
    from transformers import AutoModelForCausalLM

    whole, where = tiny_hf_model(name), folder(f"offload-{name}-")
    whole.save_pretrained(where / "model")
    base, layers = whole.base_model_prefix, "h" if name == "gpt2" else "layers"
    device_map = {f"{base}.{layers}.{i}": "disk" if i else "cpu" for i in range(3)}
    device_map.update({f"{base}.{m}": "cpu" for m, _ in whole.base_model.named_children() if m != layers})
    device_map["lm_head"] = "disk" if tied else "cpu"
    if tied:
        device_map[f"{base}.{'wte' if name == 'gpt2' else 'embed_tokens'}"] = "disk"
    extra = {"experts_implementation": "eager"} if name in MOE else {}
    with float64_norms():
        model = AutoModelForCausalLM.from_pretrained(
            where / "model", device_map=device_map, offload_folder=where / "offload", dtype=torch.float64, **extra
        ).eval()
    model.generation_config.eos_token_id = None
    assert any(p.device.type == "meta" for p in model.parameters()), "nothing offloaded"
    return whole, model


@functools.cache
def thoughts(name: str):
    """The thought patch of the offloaded model and of the model held whole (one prompt, 6 queries)."""
    with float64_norms():
        return tuple(quiet_thought(m, ids(1, 8, 4)[0], ids(6, 3, 5)) for m in reversed(split(name)))


@torch.no_grad()
def offload_paths(name: str) -> dict:
    """token_patch, verify, functional_call on the offloaded model against the whole one; the LoRA written
    from the offloaded model, loaded by peft onto the whole one, against functional_call (experts: refused)."""
    from peft import PeftModel

    (whole, model), x = split(name), ids(2, 10)
    with float64_norms():
        patch = tp.token_patch(model, x, query=[-1, 4])
        out = {"token_patch": gap(patch, tp.token_patch(whole, x, query=[-1, 4]))}
        out["verify"] = tp.verify(model, patch, x).max_abs
        got = tp.functional_call(model, tp.token_patch(whole, x[:, :5]), **tp.strip_context(model, x[:, :5]))
        out["functional_call"] = gap(got.logits[:, -1], whole(x[:, :5]).logits[:, -1])
        fit, where, q = thoughts(name)[0], folder(f"lora-{name}-") / "lora", ids(3, 5, seed=7)
        if name in MOE:
            out["save_lora"] = refused(lambda: tp.save_lora(model, fit, where), r"a LoRA cannot target")
            return out
        tp.save_lora(model, fit, where)
        lora = PeftModel.from_pretrained(copy.deepcopy(whole), where).eval()
        out["save_lora→peft"] = gap(lora(q).logits, tp.functional_call(whole, fit.patch, q).logits)
    return out


@torch.no_grad()
def generated(name: str, tied: bool = False) -> float | str:
    """``tp.generate``'s worst logit error on the offloaded model; NOT FIXED if its tokens are not the whole's."""
    (whole, model), x = split(name, tied), ids(2, 9)
    with float64_norms():
        gen = tp.generate(model, x, max_new_tokens=3, progress=False)
    same = torch.equal(gen.tokens, whole.generate(x, max_new_tokens=3, do_sample=False)[:, 9:])
    return float(gen.logit_error.max()) if same else f"{NOT_FIXED} tokens differ from the whole model's"


@torch.no_grad()
def case_1():
    for name in ("llama", "gpt2"):
        yield f"1a {name}", offload_paths(name)
    for name in ("qwen3_moe", "mixtral"):
        yield f"1b {name}", offload_paths(name)
    (whole, model), x = split("gpt2", tied=True), ids(2, 9)
    with float64_norms():
        patch = tp.token_patch(model, x, query=[-1, 4])
        tied = {"token_patch": gap(patch, tp.token_patch(whole, x, query=[-1, 4]))}
        tied["verify"] = tp.verify(model, patch, x).max_abs
    yield "1c tied", {**tied, "generate": generated("gpt2", tied=True)}
    yield "1c gemma3", offload_paths("gemma3")
    for name in ("qwen3_moe", "mixtral"):
        (fit, want), (whole, model), q = thoughts(name), split(name), ids(3, 5, seed=7)
        with float64_norms():
            logits = gap(tp.functional_call(model, fit.patch, q).logits, tp.functional_call(whole, fit.patch, q).logits)
        out = {"thought_patch": gap(fit.patch, want.patch), "its logits": logits}
        yield f"1c thought {name}", {**out, "generate": generated(name)}


# ----------------------------------------------------------------------------------- 2. rotary scaling
def rope_model(key: str):
    """tests/test_rotary_scaling.py's models: longrope (Phi-3, Llama) or dynamic scaling past 6 positions."""
    g = torch.Generator().manual_seed(1)
    short, long = ((a + b * torch.rand(8, generator=g, dtype=torch.float64)).tolist() for a, b in ((1, 1), (2, 4)))
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short, "long_factor": long}
    rope = {"longrope": {**rope, "original_max_position_embeddings": 6}}
    rope.update(dynamic={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}, plain=None)
    name, scaling = key.split("_")
    lengths = {"longrope": dict(original_max_position_embeddings=6, max_position_embeddings=24)}
    config = {"rope_parameters": rope[scaling], **lengths.get(scaling, {"max_position_embeddings": 6})}
    with warnings.catch_warnings():  # transformers' advice on the longrope factor
        warnings.simplefilter("ignore")
        return tiny_hf_model(name, **(config if rope[scaling] else {}))


def fresh(model) -> None:
    model(torch.ones(1, 1, dtype=torch.long))  # shorter than 6: transformers' dynamic rotation back to a fresh one's


@torch.no_grad()
def rope_trajectory(key: str) -> float:
    model, x = rope_model(key), ids(1, 9, seed=3)
    model(ids(1, 16))  # a longer forward first: transformers' dynamic rotation keeps its frequencies
    traj, worst = tp.trajectory(model, x, progress=False), 0.0
    for i in range(traj.query + 1):
        fresh(model)
        worst = max(worst, gap(traj.patch(i), tp.token_patch(model, traj.prefix_inputs(x, i))))
    return worst


@torch.no_grad()
def rope_thought(key: str, prompt_len: int) -> float:
    model, prompt, query = rope_model(key), ids(1, prompt_len, seed=5)[0], ids(1, 3, seed=6)
    model(ids(1, 16))
    fit = quiet_thought(model, prompt, query)
    fresh(model)
    want = model(torch.cat([prompt[None], query], 1)).logits[:, prompt_len:]
    fresh(model)
    return gap(tp.functional_call(model, fit.patch, query).logits, want)


@torch.no_grad()
def case_2():
    keys = ("phi3_longrope", "llama_longrope", "llama_dynamic")
    for key in keys:
        yield f"2 {key}", {"": rope_trajectory(key)}
    yield "2 thought", {"": max(rope_thought(key, n) for key in keys for n in (4, 8))}
    out, refusals = {}, []
    for key in (*keys, "llama_plain"):
        model, x = rope_model(key), ids(1, 12, seed=4)
        patch, kept = tp.token_patch(model, x, remove=slice(2, 5)), tp.strip_context(model, x, remove=slice(2, 5))
        out[f"{key}, its own ids"] = gap(tp.functional_call(model, patch, **kept).logits[:, -1], model(x).logits[:, -1])
        compact = {**kept, "position_ids": torch.arange(9)[None]}
        refusals.append(refused(lambda: tp.functional_call(model, patch, **compact), r"kept positions .* distances"))
    yield "2 chunk", {**out, "compacted ids, all 4": " / ".join(dict.fromkeys(refusals))}  # each text once


# ------------------------------------------------------------------------------- 3. patches and inputs
@torch.no_grad()
def case_3abc():
    for family in ("gpt2", "opt"):
        model, x = tiny_hf_model(family), ids(1, 12)
        a, b = tp.token_patch(model, x, query=9), tp.token_patch(model, x, query=4)
        stack, tokens = tp.Patch.stack([a, b]), torch.cat([x[:, 9:10], x[:, 4:5]])
        out = {"stack": refused(lambda: tp.functional_call(model, stack, tokens), "no position_ids were given")}
        out["A + B"] = refused(lambda: tp.functional_call(model, a + b, x[:, 9:10]), "no position_ids were given")
        out["A + B"] = "refused the same way" if out["A + B"] == out["stack"] else out["A + B"]
        got = tp.functional_call(model, stack, input_ids=tokens, position_ids=torch.tensor([[9], [4]]))
        yield f"3a {family}", {**out, "stack with position ids": gap(got.logits[:, -1], model(x).logits[0, [9, 4]])}
    model, prompt, query = tiny_hf_model("llama"), ids(1, 10, seed=3)[0], ids(1, 4, seed=7)
    patch = quiet_thought(model, prompt, ids(6, 4, seed=4), keep_bos=True).patch
    yield "3b", {"": refused(lambda: tp.functional_call(model, patch, query), r"keep_bos")}
    x, other = ids(2, 9), ids(2, 9, seed=5)
    patch, theirs = tp.token_patch(model, x, query=[6, 8]), tp.strip_context(model, other, query=[6, 8])
    own = tp.functional_call(model, patch, **tp.strip_context(model, x, query=[6, 8])).logits[:, 0]
    out = {"other prompt": refused(lambda: tp.functional_call(model, patch, **theirs), "other tokens")}
    yield "3c", {**out, "its own prompt": gap(own, model(x).logits[:, [6, 8]].reshape(own.shape))}


def in_apply(model, patch, step=None) -> None:
    with tp.apply(model, patch):
        if step:
            step()


def case_3d():
    model, x = tiny_hf_model("llama"), ids(1, 9)
    patch = tp.token_patch(model, x)
    with torch.no_grad():
        tp.functional_call(model, patch, **tp.strip_context(model, x))  # checked: the digest is cached
        model.model.layers[1].mlp.down_proj.weight.data.mul_(1.01)
    call = refused(lambda: tp.functional_call(model, patch, **tp.strip_context(model, x)), "another model")
    yield "3d data", {"functional_call": call, "apply": refused(lambda: in_apply(model, patch[0, 0]), "another model")}
    model = tiny_hf_model("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = lambda: (model(x).logits.pow(2).mean().backward(), opt.step())
    yield "3d step", {"": refused(lambda: in_apply(model, patch[0, 0], step), "weights changed inside tp.apply")}


def case_3e():
    model, prompt, cal, empty = tiny_hf_model("llama"), ids(1, 8)[0], ids(4, 3, seed=2), torch.zeros(0, 3).long()
    bad = {"calibration": (prompt, empty), "prompt": (empty[:, 0], cal), "rows": (ids(2, 5), cal)}
    for row, args in {**bad, "dict": (prompt, {"input_ids": cal})}.items():
        yield f"3e {row}", {"": refused(lambda: tp.thought_patch(model, *args), "")}
    patch = tp.token_patch(model, ids(1, 6))
    yield "3e batch", {"": refused(lambda: tp.functional_call(model, patch, empty[:, :1]), "empty")}
    here, cwd = folder("save-"), os.getcwd()
    os.chdir(here)
    try:
        for row, path in (("empty", ""), ("dot", "."), ("slash", "x/")):
            text = refused(lambda: tp.save_patch(patch, path), "cannot write")
            yield f"3e {row}", {"": text, "files written": ", ".join(p.name for p in here.iterdir()) or "none"}
    finally:
        os.chdir(cwd)


CASES = {"1": case_1, "2": case_2, "3abc": case_3abc, "3d": case_3d, "3e": case_3e, "4a": case_4a}
CASES.update({"4bcd": case_4bcd, "4efg": case_4efg, "5": case_5})


def wanted(key: str, only: list[str] | None) -> bool:
    """``--only 1 3d 4c`` runs the groups 1, 3d and 4bcd (a group is measured whole)."""
    return not only or any(key.startswith(o) or o.startswith(key) or o[0] == key[0] and o[1:] in key for o in only)


def run(key: str, rows) -> None:
    """Print each row as it is measured; an error raised on the way is a NOT FIXED row."""
    start = time.perf_counter()
    try:
        for row, after in rows:
            name, _, extra = row.partition("/")  # "4a/greeting": row 4a, about the greeting
            (what, before), extra = ROWS[name], f" ({extra})" if extra else ""
            print(f"| {name.split()[0]} {what}{extra} | {before} | {cell(after)} |".replace("\n", "\\n"), flush=True)
    except Exception as exc:  # a raw error is the finding
        print(f"| {key} (the rest) | | {NOT_FIXED}: raised {type(exc).__name__}: {str(exc)[:120]!r} |", flush=True)
    print(f"[silent_answers] {key}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="CASE", help="these cases: 1, 1b, 3d, 4c, ... (default: all)")
    ap.add_argument("--all-prompts", action="store_true", help="4a: every prompt also from 8 continuations")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    import transformers

    transformers.logging.set_verbosity_error()  # tiny configs' token ids, offload notes, progress bars
    transformers.logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "Some parameters are on the meta device ..."
    scratch = Path(tempfile.mkdtemp(prefix="silent_answers-"))
    use_scratch(scratch)
    print("| case | before (audit) | after (measured now) |\n|---|---|---|", flush=True)
    try:
        for key, case in CASES.items():
            if wanted(key, args.only):
                run(key, case(args.all_prompts) if key == "4a" else case())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
