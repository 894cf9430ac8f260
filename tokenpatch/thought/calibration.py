"""Self-generated calibration: the prompted model writes the queries its thought patch is fitted on.

A thought patch is fitted on calibration queries read after the prompt (``front.py``). A user has a
prompt, not a dataset; the prompted model supplies one. ``sample_calibration`` draws ``n``
continuations of ``length`` tokens from ``p(. | prompt)``:

    q_i ~ p_model(x_1 .. x_length | prompt),  x_t ~ softmax(logits_t / temperature)

For a few-shot prompt the model goes on with new demonstrations, for an instruction with queries and
answers: text distributed as what the prompt makes the model produce, which is where the patch has
to stand in for the prompt. Every position of every continuation is a calibration position, so a
prompt yields as many as wanted (``n * length``). Draws come from a seeded ``torch.Generator``: the
same seed gives the same queries, batch size and thread count aside.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch.arch import adapter_for
from tokenpatch.errors import InputError
from tokenpatch.progress import progress_bar

__all__ = [
    "sample_calibration",
    "demonstrations",
    "batched",
    "demonstration_start",
    "demonstration_separator",
    "DEFAULTS",
]

# What is sampled unless told otherwise (also what ``thought_patch`` samples when calibration is left out).
DEFAULTS = {"n": 64, "length": 32, "temperature": 0.7, "seed": 0}


@torch.no_grad()
def sample_calibration(
    model: nn.Module,
    prompt: Any,
    n: int = DEFAULTS["n"],
    length: int = DEFAULTS["length"],
    *,
    temperature: float = DEFAULTS["temperature"],
    start: Any = None,
    seed: int = DEFAULTS["seed"],
    batch_size: int = 32,
    progress: bool | None = None,
) -> Tensor:
    """``n`` continuations ``[n, length]`` of ``prompt`` (token ids ``[P]`` or ``[1, P]``), sampled from
    the model itself at ``temperature`` (module docstring), ``batch_size`` at a time on the model's KV
    cache. ``start``: token ids ``[S]`` every continuation begins with (the first ``S`` of its
    ``length``), e.g. a few-shot prompt's ``"Q:"``, so that the model writes a new demonstration
    rather than whatever text it would put after the prompt. Pass them to ``tp.thought_patch(model, prompt, calibration)``; ``thought_patch`` does so
    itself when ``calibration`` is left out."""
    for name, value, low in (("n", n, 1), ("length", length, 1), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InputError(f"sample_calibration: {name} must be an int >= {low}, got {value!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise InputError(f"sample_calibration: temperature must be a number > 0, got {temperature!r}")
    adapter = adapter_for(model)
    adapter.require("check_inputs", by="tp.thought.sample_calibration")
    if isinstance(prompt, Tensor) and prompt.ndim == 1:
        prompt = prompt[None]
    ids = adapter.check_inputs(model, prompt)["input_ids"]  # [1, P]
    if ids.shape[0] != 1:
        raise InputError(f"sample_calibration: one prompt [P] or [1, P], got {ids.shape[0]} rows")
    limit = adapter.position_limit(model)
    if limit is not None and ids.shape[1] + length > limit:
        raise InputError(
            f"sample_calibration: a {ids.shape[1]}-token prompt and length={length} run past the model's "
            f"{limit} positions: pass length <= {limit - ids.shape[1]}"
        )
    start = torch.zeros(0, dtype=ids.dtype) if start is None else torch.as_tensor(start).reshape(-1).to(ids.dtype)
    if start.numel() >= length:
        raise InputError(
            f"sample_calibration: start has {start.numel()} tokens, length={length}: leave tokens to sample"
        )
    head = start.to(ids.device)[None]  # [1, S]
    adapter.check_inputs(model, torch.cat([ids, head], 1))  # the start's ids too
    gen = torch.Generator(device=ids.device).manual_seed(seed)
    rows = []
    sizes = [min(batch_size, n - first) for first in range(0, n, batch_size)]
    for b in progress_bar(sizes, progress, desc="calibration", unit="batch"):
        step, cache, drawn = torch.cat([ids, head], 1).expand(b, -1), None, [head.expand(b, -1)]
        for _ in range(length - head.shape[1]):
            out = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            probs = torch.softmax(out.logits[:, -1].double() / temperature, -1)  # [b, vocab]
            step = torch.multinomial(probs, 1, generator=gen)  # [b, 1]
            drawn.append(step)
        rows.append(torch.cat(drawn, 1))
    return torch.cat(rows).cpu()


def demonstrations(tokenizer, continuations: Tensor, separator: str) -> list[list[int]]:
    """The whole demonstrations in sampled ``continuations [n, L]``, each a calibration query of its own.

    A continuation of a few-shot prompt holds several new demonstrations; read whole, its later ones
    follow the earlier ones, which are in-context examples themselves, so the prompt's own effect
    there is small, and a query a user asks comes alone. Each continuation is decoded and cut at the
    prompt's ``separator`` (``"\n\n"`` between ``"Q: x\nA: y"`` blocks, ``"\n"`` between lines); its last
    piece is dropped (the length cut it off), blank and repeated ones too, and each is tokenized
    again (no special tokens) as a query is. Returns token-id lists in the order first written."""
    if not separator:
        raise InputError("demonstrations: the separator between demonstrations must be a non-empty string")
    pieces = [p for row in continuations for p in tokenizer.decode(row.tolist()).split(separator)[:-1] if p.strip()]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in dict.fromkeys(pieces)]


def batched(rows: list[list[int]]) -> list[Tensor]:
    """Token-id rows of any lengths as calibration batches ``[b, T]``, one per length (shortest first)."""
    by_len: dict[int, list[list[int]]] = {}
    for r in rows:
        if r:
            by_len.setdefault(len(r), []).append(list(r))
    return [torch.tensor(v) for _, v in sorted(by_len.items())]


def _layouts(prompt: str):
    """``(separator, blocks)``: the prompt cut into blank-line separated blocks, then into lines."""
    for sep, blocks in (("\n\n", prompt.split("\n\n")), ("\n", prompt.splitlines())):
        yield sep, [b.strip() for b in blocks if b.strip()]


def _shared_start(blocks: list[str]) -> str | None:
    heads = [b[: b.index(":") + 1] for b in blocks if ":" in b[:24]]
    best = max(sorted(set(heads)), key=heads.count, default=None)
    if best is not None and heads.count(best) >= 2:
        return best
    common = os.path.commonprefix(blocks[1:]) if len(blocks) > 2 else ""
    return re.sub(r"\w+$", "", common).rstrip() or None


def demonstration_start(prompt: str) -> str | None:
    """How the prompt's demonstrations begin, where at least two of its blank-line separated blocks (else
    lines) begin alike: the label before a block's first ``:`` (``"Q:"`` for ``"Q: walk\nA: walked"``), else
    their longest common prefix cut at a word's end. ``None`` when no two blocks share a beginning
    (an instruction alone). Self-generated calibration starts there, so that the model writes new
    demonstrations rather than whatever text it would put after the prompt."""
    for _, blocks in _layouts(prompt):
        start = _shared_start(blocks)
        if start:
            return start
    return None


def demonstration_separator(prompt: str) -> str | None:
    """What separates the prompt's demonstrations: ``"\n\n"`` where at least two blank-line separated
    blocks begin alike (``demonstration_start``), else ``"\n"`` where lines do, or where the prompt
    is at least three lines none of them blank (``"walk -> walked"`` lines); ``None`` otherwise (an
    instruction alone). ``demonstrations`` cuts sampled continuations there."""
    for sep, blocks in _layouts(prompt):
        if _shared_start(blocks):
            return sep
    lines = prompt.strip().split("\n")
    return "\n" if len(lines) >= 3 and all(line.strip() for line in lines) else None
