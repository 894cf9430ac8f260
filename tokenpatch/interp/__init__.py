"""Circuits behind in-context learning (``docs/markov.md``, ``docs/induction.md``).

* ``phases``, ``circuits``, ``bridge``: Markov-chain phases, their probes, and the bridge to token patches;
* ``induction``: induction-head scores (diagonal, TransformerLens' detector, previous- and duplicate-token);
* ``ablation``: head ablation as a context manager, head selection and the random control;
* ``temporal``: the lag curve, serial recall and their dose-response to ablation;
* ``head_patches``: each head's exact part of every layer's token patch.
"""
