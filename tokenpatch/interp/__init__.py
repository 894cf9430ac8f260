"""Circuits behind in-context learning: Markov-chain phases (``phases``, ``circuits``)."""
