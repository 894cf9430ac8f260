"""The trainers: one loop (``loop``), the linear-regression, Markov and small-LM trainers, the Markov sweeps."""
