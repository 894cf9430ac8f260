"""A compared method and how it answers (``docs/prompt-compression.md``): ``Method`` (a patch or a steering
vector, and whether it reads the prompt), the four ways a row is built (``unprompted``, ``prompted``,
``steered``, ``patched``: a registry entry's ``answers``, ``registry.py``), the encoded word-pair
prompts (``Encoded``), and the two ways a method is scored: the answer's log-probabilities and
greedy decoding."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenpatch.baselines.steering import Steering, steer
from tokenpatch.baselines.vectors import pad_left
from tokenpatch.errors import InputError
from tokenpatch.patch import Patch
from tokenpatch.run import apply
from tokenpatch.tasks.wordpairs import Format, WordPairs

__all__ = [
    "Method",
    "unprompted",
    "prompted",
    "steered",
    "patched",
    "Encoded",
    "leading_tokens",
    "single_token_answers",
    "on_device",
    "answer_logits",
    "greedy",
]


@dataclass
class Method:
    """How one method runs a batch of queries: with the prompt in front (ICL) or not, inside
    ``prefill`` for the queries' forward and ``decode`` while generating."""

    name: str
    prompted: bool = False
    prefill: Callable[[dict], AbstractContextManager] = lambda batch: contextlib.nullcontext()
    decode: Callable[[], AbstractContextManager] = contextlib.nullcontext
    extraction_s: float = 0.0
    nbytes: int = 0
    info: dict | None = None


# How a row answers, one function each, all called ``(model, name, what, seconds, info, skip)``: ``what``
# is what the extraction produced (nothing, a ``Steering``, a ``Patch``), ``seconds`` its extraction
# time, ``info`` what the results report beside the scores, ``skip`` the leading tokens (a BOS) a
# steering vector leaves alone.


def unprompted(model: nn.Module, name: str, what=None, seconds: float = 0.0, info=None, skip: int = 0) -> Method:
    """The query alone, the model unchanged (zero-shot, the floor)."""
    return Method(name, False, extraction_s=seconds, info=info)


def prompted(model: nn.Module, name: str, what=None, seconds: float = 0.0, info=None, skip: int = 0) -> Method:
    """The prompt in front of the query (ICL, the ceiling)."""
    return Method(name, True, extraction_s=seconds, info=info)


def steered(model: nn.Module, name: str, s: Steering, seconds: float = 0.0, info=None, skip: int = 0) -> Method:
    """Steering in the queries' forward (every position but the ``skip`` leading tokens, or the last
    one) and, for every-position steering, in each generated token's (a last-position edit lives on
    in the KV cache)."""

    def prefill(batch: dict):
        return steer(model, s, (batch["position_ids"] >= skip) & (batch["attention_mask"] > 0))

    every = s.position == "all"
    return Method(
        name, False, prefill, (lambda: steer(model, s)) if every else contextlib.nullcontext, seconds, s.nbytes, info
    )


def patched(model: nn.Module, name: str, patch: Patch, seconds: float = 0.0, info=None, skip: int = 0) -> Method:
    """The patch written into the weights for the queries' forward and every generated token's; its
    bytes are its factors' (``u``, ``v`` of a low-rank delta, else the dense delta)."""
    nbytes = sum(
        t.numel() * t.element_size() for d in patch.values() for t in ((d.u, d.v) if hasattr(d, "u") else (d,))
    )
    return Method(name, False, lambda batch: apply(model, patch), lambda: apply(model, patch), seconds, nbytes, info)


class Encoded:
    """A task's splits as token ids: ``prefix`` (``lead``, else the tokenizer's BOS, possibly none), the k-shot
    ``demos`` block, per split the queries and the answers' token ids."""

    def __init__(self, tokenizer, splits: dict, shots: int, fmt: Format, lead: list[int] | None = None):
        self.tokenizer, self.fmt, self.splits = tokenizer, fmt, splits
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.prefix = leading_tokens(tokenizer) if lead is None else [int(t) for t in lead]
        if len(self.prefix) > 1:
            raise InputError(
                f"the tokenizer starts every sequence with {len(self.prefix)} tokens; the comparison keeps "
                "one leading token (a BOS) in both passes"
            )
        if len(splits["demos"]) < shots:
            raise InputError(f"{shots} shots asked, the split has {len(splits['demos'])} demonstrations")
        self.demo_pairs = splits["demos"][:shots]
        self.demos = ids(fmt.demos(self.demo_pairs))
        self.query = {k: [ids(fmt.query.format(x=x)) for x, _ in v] for k, v in splits.items()}
        self.answer = {k: [ids(fmt.answer.format(y=ys[0])) for _, ys in v] for k, v in splits.items()}
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def batch(self, split: str, prompted: bool, answers: bool = False, demos: list[int] | None = None) -> dict:
        head = self.prefix + ((self.demos if demos is None else demos) if prompted else [])
        rows = [head + q + (a if answers else []) for q, a in zip(self.query[split], self.answer[split])]
        return pad_left(rows, self.pad)

    def demo_batch(self, answers: bool) -> dict:
        """The prompt's demonstrations one per row, each after the leading token: the query alone, or
        with its answer (the in-context vector's pairs)."""
        ids = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        rows = [
            self.prefix + ids(self.fmt.query.format(x=x)) + (ids(self.fmt.answer.format(y=ys[0])) if answers else [])
            for x, ys in self.demo_pairs
        ]
        return pad_left(rows, self.pad)

    def word_batch(self, answers: bool) -> dict:
        """The prompt's demonstrations one per row, each after the leading token: the input word alone,
        or the answer alone, both as an answer is written (``" walk"``, ``" walked"``): the pairs of
        the in-context vector's authors, who difference a text and its rewrite each read alone."""
        ids = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        rows = [self.prefix + ids(self.fmt.answer.format(y=ys[0] if answers else x)) for x, ys in self.demo_pairs]
        return pad_left(rows, self.pad)

    def n_query(self, split: str, answers: bool = False) -> Tensor:
        return torch.tensor(
            [len(q) + (len(a) if answers else 0) for q, a in zip(self.query[split], self.answer[split])]
        )

    def first(self, split: str) -> Tensor:
        return torch.tensor([a[0] for a in self.answer[split]])

    def shuffled_demos(self, seed: int) -> list[int]:
        """The demonstrations with their answers shuffled among them (function-vector corruption)."""
        xs = [x for x, _ in self.demo_pairs]
        ys = [ys for _, ys in self.demo_pairs]
        order = list(range(len(ys)))
        rng = random.Random(seed)
        while len(ys) > 1 and order == sorted(order):
            rng.shuffle(order)
        pairs = [(x, ys[o]) for x, o in zip(xs, order)]
        return self.tokenizer(self.fmt.demos(pairs), add_special_tokens=False)["input_ids"]


def leading_tokens(tokenizer) -> list[int]:
    """What every sequence starts with, prompt or not: the tokenizer's own prefix (Gemma's BOS), else
    its BOS or end-of-text token. A model's first position is an attention sink with outsized states;
    without a fixed first token the query's own first token would become that sink without the
    prompt and an ordinary token with it, and no small update maps the one onto the other."""
    own = tokenizer("", add_special_tokens=True)["input_ids"]
    if own:
        return own
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return [int(tid)]
    return []


def single_token_answers(tokenizer, task: WordPairs, fmt: Format = Format()) -> dict:
    """How many of the task's answers are one token under ``tokenizer`` (as they follow the query)."""
    ones = sum(
        len(tokenizer(fmt.answer.format(y=ys[0]), add_special_tokens=False)["input_ids"]) == 1 for _, ys in task.pairs
    )
    return {"single_token": int(ones), "pairs": len(task.pairs)}


def on_device(model: nn.Module, batch: dict) -> dict:
    """The batch's tensors on the device of the model's input embeddings."""
    device = model.get_input_embeddings().weight.device
    return {k: v.to(device) for k, v in batch.items()}


def answer_logits(model: nn.Module, batch: dict, method: Method) -> Tensor:
    """The next-token log-probabilities at the last position ``[B, vocab]`` (float64)."""
    batch = on_device(model, batch)
    with torch.no_grad(), method.prefill(batch):
        return model(**batch, use_cache=False, logits_to_keep=1).logits[:, -1].double().log_softmax(-1)


def greedy(model: nn.Module, batch: dict, method: Method, steps: int) -> tuple[Tensor, Tensor]:
    """Greedy decoding of ``steps`` tokens on a KV cache: ``(tokens [B, steps], log-probabilities of
    the first step [B, vocab])``."""
    batch = on_device(model, batch)
    with torch.no_grad():
        with method.prefill(batch):
            out = model(**batch, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].double().log_softmax(-1)
        tokens = [first.argmax(-1)]
        mask, pos = batch["attention_mask"], batch["position_ids"][:, -1:]
        with method.decode():
            for _ in range(steps - 1):
                mask, pos = torch.cat([mask, mask.new_ones(len(mask), 1)], 1), pos + 1
                out = model(
                    input_ids=tokens[-1][:, None],
                    attention_mask=mask,
                    position_ids=pos,
                    cache=out.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, 1), first
