"""Two small transformers on Markov chains: one memorises its 4 chains, one learns the 2-gen rule.

Run: python examples/markov_phases.py   (under a minute on 2 cores)

Each model is trained on sequences from K fixed chains (C = 10 states, rows ~ Dirichlet(0.25)).
At log-spaced steps its predictions are compared with the four ideal predictors, and the phase is
the nearest one: with K = 4 the labels go to M1/M2 (it recognises the chain), with K = 1024 to G2
(it counts bigrams in context). Then phi, the last layer's attention output at the final
position, is moved from a sequence of one chain into a sequence of another: the memoriser's
prediction follows the donor chain. ``tokenpatch markov report`` runs the whole sweep
(docs/markov.md).
"""

import tempfile

import torch

from tokenpatch.interp.circuits import phi_patching
from tokenpatch.tasks.markov import MarkovTask
from tokenpatch.workbench.train.markov import MarkovTrain, train_markov

torch.set_num_threads(2)
with tempfile.TemporaryDirectory() as tmp:
    for chains in (4, 1024):
        task = MarkovTask(chains=chains)  # C = 10, alpha = 0.25, N = 64
        model, history = train_markov(
            f"{tmp}/k{chains}", task, cfg=MarkovTrain(steps=700, evals=12), snapshots=False, progress=False
        )
        labels = [h["train"]["label"] for h in history]
        path = " -> ".join(x for i, x in enumerate(labels) if i == 0 or x != labels[i - 1])
        kl = history[-1]["train"]["kl"]
        print(f"K = {chains:4d}: phases {path}; KL to 2-gen {kl['2-gen']:.3f}, to 2-mem {kl['2-mem']:.3f}")
        moved = phi_patching(model, task, pairs=128)
        clean, donor = moved["clean"]["kl_donor"]["mean"], moved["donor"]["kl_donor"]["mean"]
        print(f"          phi from another chain: KL to that chain {clean:.2f} -> {donor:.2f} nats")
