"""Compress an instruction with examples into a thought patch file, then answer without the prompt.

Run: python examples/compress_instruction.py   (needs the real-model extra: see the README)

SmolLM2-135M-Instruct reads a prompt that teaches a task (a verb -> its past tense). The prompt is all
the user brings: the prompted model writes its own calibration queries (new demonstrations, each
begun with the prompt's "Q:"), a thought patch is fitted on them, saved, loaded back and written into
the MLP weights; the model then answers new verbs with no prompt in its context. The same from the
command line: ``tokenpatch compress --model smollm2-135m --prompt TEXT --out patch.safetensors`` and
``tokenpatch generate --model smollm2-135m --patch patch.safetensors --prompt "Q: eat\\nA:"``.
"""

import tempfile
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.thought.calibration import sample_calibration
from tokenpatch.workbench.zoo.pretrained import load_pretrained

torch.set_num_threads(2)
model, tok = load_pretrained("smollm2-135m")
DEMOS = [("walk", "walked"), ("go", "went"), ("see", "saw"), ("play", "played"), ("take", "took"), ("write", "wrote")]
PROMPT = "Give the past tense of each verb.\n\n" + "".join(f"Q: {x}\nA: {y}\n\n" for x, y in DEMOS)
TEST = [("eat", "ate"), ("run", "ran"), ("sing", "sang"), ("drink", "drank"), ("swim", "swam")]

ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
# A fixed first token in both passes (the model's attention sink): SmolLM2's <|endoftext|>.
lead = [tok.convert_tokens_to_ids("<|endoftext|>")]
prompt = torch.tensor(lead + ids(PROMPT))
calibration = sample_calibration(model, prompt, n=64, length=24, start=ids("Q:"), seed=0)  # [64, 24]
print("the model's own calibration, e.g.:", repr(tok.decode(calibration[0])))

patch = tp.thought_patch(model, prompt, calibration, ridge=0.01, keep_bos=True, progress=False).patch
path = Path(tempfile.mkdtemp()) / "past_tense.safetensors"
tp.save_patch(patch, path)
patch = tp.load_patch(path, model)
print(f"thought patch of a {len(prompt)}-token prompt: {path.stat().st_size / 1e6:.1f} MB")


def answer(query: str, with_patch: bool) -> str:
    x = torch.tensor([lead + ids(f"Q: {query}\nA:")])
    with torch.no_grad(), tp.apply(model, patch) if with_patch else torch.enable_grad():
        out = model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, x.shape[1] :]).split("\n")[0].strip()


right = 0
for x, y in TEST:
    plain, patched = answer(x, False), answer(x, True)
    right += patched.lower() == y
    print(f"{x:>6}: no prompt {plain!r:28} thought patch {patched!r:10} (past tense: {y})")
print(f"with the thought patch and no prompt: {right}/{len(TEST)} right")
