"""Quickstart: patch the shipped 10-layer model, check the patch, run the query alone with it.

python examples/quickstart.py
"""

import tempfile
from pathlib import Path

import torch

import tokenpatch as tp

model = tp.load_model()  # 10-layer Pre-LN transformer trained on in-context linear regression
task = tp.LinRegTask(dim=4, n_context=16, noise=0.1)
batch = task.sample(8, torch.Generator().manual_seed(0))

# One with-context pass -> a rank-1 patch of every layer's MLP input matrix (+ output bias shift).
patch = tp.token_patch(model, batch.tokens)  # query = last token, all context removed
print(patch)
print(tp.verify(model, patch, batch.tokens).table())

# The query token alone, with task 3's patch written into the weights, predicts what the
# model predicts after reading all 16 examples; the weights are restored on exit.
with torch.no_grad():
    with_context = model(batch.tokens)[3, -1, 0]
    bare = model(batch.tokens[3:4, -1:])[0, 0, 0]  # the query alone, no patch: no idea of the task
    with tp.apply(model, patch[3, 0]):
        patched = model(batch.tokens[3:4, -1:])[0, 0, 0]
print(
    f"target {batch.target[3]:.6f}   with context {with_context:.6f}   "
    f"query alone {bare:.6f}   query alone + patch {patched:.6f}"
)

# Patches are small (factors, never dense matrices) and save to safetensors.
path = Path(tempfile.mkdtemp()) / "patch.safetensors"
tp.save_patch(patch, path)
again = tp.load_patch(path, model=model)
norms = again.norms()["blocks.9.mlp.fc_in.weight"]
print("Frobenius norm of the last layer's patch per task:", norms[:, 0].tolist())
