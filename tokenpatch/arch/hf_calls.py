"""What a thought-patch fit needs of a Hugging Face model's own forward: the calibration queries read
after a prompt (its keys and values cached once), and each decoder layer's call (``HFAdapter.prompted``,
``HFAdapter.layer_calls``; ``Adapter`` declares both).

* ``prompted``: the prompt runs once with a cache; every batch of queries reads a copy of it (rows at a
  time, so that the copies stay under ``TARGET_CACHE_BYTES``): the same numbers as running ``[prompt; q]``
  whole, which is what runs where the prompt alone is rotated otherwise than prompt and queries together
  (a rotary scaling that changes with the length, ``arch.rotary``) or where a layer is recurrent (its
  cached step is not the full forward's arithmetic in transformers: Falcon-H1's differs by ~1e-9 in
  float64; some such caches cannot be copied per query);
* ``layer_calls``: the first layer's input and the other arguments the model passes each layer (masks,
  rotary embeddings: whatever this model's forward builds), captured in one forward that stops once the
  last layer's call begins; a layer then runs alone as ``layer(stream, *args, **kwargs)``.
  An argument that is the previous layer's own output beside its hidden states (ZAYA's router state) is
  ``Carried``: ``call_layer`` passes the previous layer's output of the same run in its place.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.arch.record import LayerRecord
from tokenpatch.arch.rotary import forget_longest
from tokenpatch.errors import UnsupportedModelError

__all__ = ["prompted", "layer_calls", "call_layer", "Carried", "TARGET_CACHE_BYTES"]

TARGET_CACHE_BYTES = 2**28  # the prompt's keys and values copied per query batch, at most (about)


@dataclass(frozen=True)
class Carried:
    """In a captured layer call: the previous layer's output ``index`` (beyond its hidden states, index 0)."""

    index: int


def call_layer(layer: nn.Module, h: Tensor, call: tuple[tuple, dict], previous: Any = None) -> Any:
    """``layer`` run alone on ``h`` with its captured ``call`` (``layer_calls``), a ``Carried`` argument
    taken from ``previous``, the previous layer's whole output in this run; the layer's whole output."""
    args, kwargs = call

    def pick(v):
        return previous[v.index] if isinstance(v, Carried) else v

    return layer(h, *map(pick, args), **{k: pick(v) for k, v in kwargs.items()})


def carries(call: tuple[tuple, dict]) -> bool:
    """Whether a captured call reads the previous layer's output (a ``Carried`` argument)."""
    return any(isinstance(v, Carried) for v in (*call[0], *call[1].values()))


class _Stop(Exception):
    """Raised by a hook to end a forward once what it needs has been seen."""


def prompted(adapter, model: nn.Module, prompt: Tensor, keys: tuple[str, ...]) -> Callable[[Tensor], list[LayerRecord]]:
    """``q [b, T_q] -> `` per layer the record (``keys``) of the queries read after ``prompt [1, P]`` at
    every query position, ``[b, T_q, .]`` (module docstring)."""
    prompt = adapter.check_inputs(model, prompt)["input_ids"]  # [1, P], on the embedding's device
    p, scaling = prompt.shape[1], adapter.length_scaling(model)
    forget_longest(model, scaling, prompt.device)
    # a recurrent layer's cached step is not its full forward's arithmetic in transformers (Falcon-H1's
    # differs by ~1e-9 in float64), and some of their caches cannot be copied per query; a model may keep
    # no cache at all (GPT-1): the prompt runs with each batch of queries there, and no cache is made
    cache = (
        None
        if adapter.family(model).mixers
        else getattr(model.base_model(input_ids=prompt, use_cache=True), "cache", None)
    )
    repeatable = cache is not None
    row_bytes = sum(t.numel() * t.element_size() for t in _cache_tensors(cache)) or 1

    def run(q: Tensor) -> list[LayerRecord]:
        q = adapter.check_inputs(model, q)["input_ids"]  # [b, T_q]
        whole = not repeatable or scaling is not None and scaling.regime(p) != scaling.regime(p + q.shape[1])
        parts = []
        for rows in q.split(max(1, TARGET_CACHE_BYTES // row_bytes)):
            at = torch.arange(p if whole else 0, p + rows.shape[1] if whole else rows.shape[1], device=q.device)
            if whole:
                forget_longest(model, scaling, q.device)  # a "dynamic" rotation as a fresh model's
            with adapter.recording(model, at, every=not whole) as rec:
                if whole:
                    model.base_model(input_ids=torch.cat([prompt.expand(len(rows), -1), rows], 1))
                else:
                    kv = copy.deepcopy(cache)
                    kv.batch_repeat_interleave(rows.shape[0])
                    model.base_model(input_ids=rows, cache=kv, use_cache=True)
            parts.append([r.only(keys) for r in rec])
        return [LayerRecord.cat([part[i] for part in parts]) for i in range(len(parts[0]))]

    return run


def layer_calls(adapter, model: nn.Module, inputs: Tensor) -> tuple[Tensor, list[tuple[tuple, dict]]]:
    """The first layer's input for the token ids ``inputs [b, T]`` and each layer's other arguments
    (module docstring; a ``"dynamic"`` rotation as a fresh model's: ``arch.rotary``)."""
    ids = adapter.check_inputs(model, inputs)["input_ids"]
    layers = adapter.layers(model)
    forget_longest(model, adapter.length_scaling(model), ids.device)
    calls: list[tuple] = []
    first: list[Tensor] = []
    outs: list = []  # each layer's output but the last's

    def grab(module, args, kwargs):
        if not first:
            first.append(args[0] if args else kwargs["hidden_states"])
        calls.append((args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        if len(calls) == len(layers):
            raise _Stop

    with (
        registered_hooks(
            [(lambda h, m=m: m.register_forward_pre_hook(h, with_kwargs=True), grab) for m in layers]
            + [(m.register_forward_hook, lambda mod, a, out: outs.append(out)) for m in layers]
        ),
        contextlib.suppress(_Stop),
    ):
        model.base_model(input_ids=ids, use_cache=False)
    if len(calls) != len(layers) or not first:
        raise UnsupportedModelError(f"{type(model).__name__}: its forward did not call every decoder layer once")
    return first[0], [_carried(call, outs[j - 1] if j else None) for j, call in enumerate(calls)]


def _carried(call: tuple[tuple, dict], previous: Any) -> tuple[tuple, dict]:
    """``call`` with each argument that is one of ``previous``'s outputs beyond the first made ``Carried``."""
    if not isinstance(previous, tuple):
        return call
    ids = {id(t): k for k, t in enumerate(previous) if k and isinstance(t, Tensor)}

    def mark(v):
        return Carried(ids[id(v)]) if isinstance(v, Tensor) and id(v) in ids else v

    return tuple(map(mark, call[0])), {k: mark(v) for k, v in call[1].items()}


def _cache_tensors(cache) -> list[Tensor]:
    """The key and value tensors a Hugging Face cache holds (for its size)."""
    return [t for layer in getattr(cache, "layers", []) for t in (layer.keys, layer.values) if isinstance(t, Tensor)]
