"""Implicit learning dynamics: the patch after every context token, from one pass.

    python examples/trajectory.py

For fresh linear-regression tasks, ``tp.trajectory`` gives the token patch of every prefix
``[c_1..c_i, x]`` at every layer. The step norms ``|dW_i - dW_{i-1}|_F`` shrink as more examples are
read; at the first layer the updates are exactly online gradient descent (normalised LMS) on the
examples (``tp.replay``), deeper layers drift from it. See docs/dynamics.md.
"""

import torch

import tokenpatch as tp
from tokenpatch.dynamics import diagnostics as dg

model = tp.load_model(dtype="float64")  # float64: the identities hold to ~1e-15
batch = tp.LinRegTask(dim=4, n_context=16, noise=0.1).sample(64, torch.Generator().manual_seed(0), dtype=torch.float64)
traj = tp.trajectory(model, batch.tokens)  # 17 prefixes x 10 layers, factors only

# prefix 8 is exactly the token patch of the truncated sequence
x8 = traj.prefix_inputs(batch.tokens, 8)
print(f"prefix 8 verifies: max abs error {tp.verify(model, traj.patch(8), x8).max_abs:.1e}")

print("layer  step-norm decay exponent (median over tasks)  NLMS replay deviation at i = 16")
for layer in (0, 3, 6, 9):
    name = f"blocks.{layer}.mlp.fc_in.weight"
    exponent = dg.decay_exponent(dg.step_norms(traj, name)).median()
    deviation = tp.replay(traj, name).deviation[:, -1].median()
    print(f"{layer:>5}  {exponent:>44.2f}  {deviation:>30.2e}")
