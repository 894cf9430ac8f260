"""In-context learning against explicit gradients on a language model (``docs/dynamics.md`` section 7).

Word-pair prompts: run ``r`` is a ``k``-shot prompt of one task, ``lead + d_1 .. d_k + q`` (a
demonstration ``d_j`` is its query tokens, its answer tokens and the separator, each tokenised alone
so that every prefix is a prefix of the same ids), read at the last query token. Three measurements,
each on the matrices the token patch changes (``matrix_deltas``: the MLP's input readers and its
output matrix, every layer):

* step by step (``steps``): the token patches of the prefixes ``lead + d_1 .. d_i + q`` are the
  implicit weights ``dW_i`` (``dW_0``: the query's own tokens), and ``tp.online_alignment`` sets
  each step ``dW_i - dW_(i-1)`` beside the gradient of demonstration ``i``'s loss (the answer tokens'
  summed negative log-likelihood, read without the prompt: ``lead + d_i``) and beside online SGD;
* whole updates (``whole``): after all ``k`` demonstrations, the token patch ``dW_k - dW_0`` and the
  thought patch of the prompt against ``steps`` full-batch steps of SGD and of Adam on the same
  demonstrations: cosine per layer with its rank ceiling, SimAOU on each layer's output at the query,
  and the test accuracy each reaches;
* the greedy accuracy of every method on the run's test queries (``accuracy``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.baselines.vectors import pad_left
from tokenpatch.dynamics.diagnostics import cosine, rank1_ceiling
from tokenpatch.dynamics.finetuning import finetuned, simaou
from tokenpatch.dynamics.online_sgd import gradient_at, matrix_deltas, online_alignment
from tokenpatch.lowrank import LowRank
from tokenpatch.patching import token_patch
from tokenpatch.tasks.wordpairs import Format, WordPairs, is_correct
from tokenpatch.thought.calibration import batched
from tokenpatch.thought.front import thought_patch
from tokenpatch.workbench.methods import Method, greedy

__all__ = ["Runs", "encode_runs", "step_by_step", "whole_updates", "train", "layer_of"]


@dataclass
class Runs:
    """``R`` prompts as token ids. ``demos[r][j] = (query, answer, separator)`` ids of demonstration
    ``j``; ``query[r]``: the query the token patches are anchored at; ``tests[r]``: held-out
    ``(query ids, answer ids, answers)``; ``calibration[r]``: queries with answers for the thought patch."""

    lead: list[int]
    tasks: list[str]
    demos: list[list[tuple[list[int], list[int], list[int]]]]
    query: list[list[int]]
    tests: list[list[tuple[list[int], list[int], tuple[str, ...]]]]
    calibration: list[list[list[int]]]
    pad: int

    @property
    def shots(self) -> int:
        return len(self.demos[0])

    def prefix(self, i: int) -> dict:
        """``lead + d_1 .. d_i + q`` of every run, left-padded."""
        return pad_left([self.lead + _flat(d[:i]) + q for d, q in zip(self.demos, self.query)], self.pad)

    def prompt(self, r: int) -> list[int]:
        return self.lead + _flat(self.demos[r])

    def example(self, j: int | None) -> tuple[dict, Tensor]:
        """Demonstration ``j`` of every run without the prompt, ``lead + query + answer`` (``j=None``: all of
        them, run-major): the batch and each row's answer length."""
        rows = [d[j] for d in self.demos] if j is not None else [x for d in self.demos for x in d]
        batch = pad_left([self.lead + q + a for q, a, _ in rows], self.pad)
        return batch, torch.tensor([len(a) for _, a, _ in rows])

    def heldout(self, per_run: int) -> tuple[dict, Tensor]:
        """The first ``per_run`` test queries of every run with their answers, run-major."""
        rows = [t for ts in self.tests for t in ts[:per_run]]
        return pad_left([self.lead + q + a for q, a, _ in rows], self.pad), torch.tensor([len(a) for _, a, _ in rows])


def _flat(demos) -> list[int]:
    return [t for q, a, s in demos for t in q + a + s]


def encode_runs(
    tokenizer, tasks: list[WordPairs], lead: list[int], fmt: Format, shots: int, tests: int, seed: int
) -> Runs:
    """One run per task: the first ``shots`` demonstrations of its seeded split, its first test query as
    the anchor, the next ``tests`` as held-out queries, the calibration split for the thought patch."""
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    out = Runs(lead, [], [], [], [], [], tokenizer.pad_token_id or tokenizer.eos_token_id)
    for task in tasks:
        split = task.split(seed=seed, demos=shots)
        out.tasks.append(task.name)
        out.demos.append(
            [
                (ids(fmt.query.format(x=x)), ids(fmt.answer.format(y=ys[0])), ids(fmt.separator))
                for x, ys in split["demos"]
            ]
        )
        anchor, *rest = split["test"]
        out.query.append(ids(fmt.query.format(x=anchor[0])))
        out.tests.append([(ids(fmt.query.format(x=x)), ids(fmt.answer.format(y=ys[0])), ys) for x, ys in rest[:tests]])
        out.calibration.append(
            [ids(fmt.query.format(x=x) + fmt.answer.format(y=ys[0])) for x, ys in split["calibration"]]
        )
    return out


def answer_nll(model: nn.Module, batch: dict, answer: Tensor) -> Tensor:
    """Each row's summed negative log-likelihood of its last ``answer[b]`` tokens -> ``[rows]``.

    The vocabulary's logits only at the ``sum(answer)`` positions that predict an answer token: the model
    keeps its last ``max(answer) + 1`` positions and a pre-hook on its output embedding passes on only
    those rows of the head's input (on a 262k-token vocabulary the head costs more than the body)."""
    keep = int(answer.max()) + 1
    mine = torch.arange(keep - 1)[None] >= keep - 1 - answer[:, None]  # [B, keep - 1]: each row's answer predictors
    rows = torch.arange(len(answer))[:, None].expand_as(mine)[mine]  # [N]: the row of each predictor
    target = batch["input_ids"][:, -(keep - 1) :][mine]  # [N]

    def predictors(module, args):
        return (args[0][:, :-1][mine],)  # [B, keep, d] -> [N, d]

    with registered_hooks([(model.get_output_embeddings().register_forward_pre_hook, predictors)]):
        logits = model(**batch, use_cache=False, logits_to_keep=keep).logits  # [N, vocab]
    logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    nll = -logp.gather(-1, target[:, None])[:, 0]  # [N]
    return nll.new_zeros(len(answer)).index_add(0, rows, nll)


def layer_of(name: str) -> int:
    return int(name.split("layers.")[1].split(".")[0])


HELDOUT = 10  # test queries per run whose answer NLL is read after every online-SGD step


def losses(model: nn.Module, runs: Runs) -> tuple[Callable[[int], Tensor], Callable[[], Tensor]]:
    """``loss(j)``: demonstration ``j``'s answer NLL read without the prompt, per run; ``heldout()``: the
    mean answer NLL of the first ``HELDOUT`` test queries of each run."""
    examples = [runs.example(j) for j in range(runs.shots)]
    held, held_len = runs.heldout(HELDOUT)
    r = len(runs.tasks)

    def loss(j: int) -> Tensor:
        return answer_nll(model, *examples[j])

    def heldout() -> Tensor:
        return answer_nll(model, held, held_len).reshape(r, -1).mean(1)

    return loss, heldout


@torch.no_grad()
def icl_heldout(model: nn.Module, runs: Runs) -> Tensor:
    """The mean answer NLL of each run's first ``HELDOUT`` test queries read after ``lead + d_1 .. d_i``,
    ``i = 0..k`` -> ``[R, k + 1]``: in-context learning's held-out loss along the prompt."""
    out = []
    for i in range(runs.shots + 1):
        rows, lens = [], []
        for d, tests in zip(runs.demos, runs.tests):
            for q, a, _ in tests[:HELDOUT]:
                rows.append(runs.lead + _flat(d[:i]) + q + a)
                lens.append(len(a))
        out.append(answer_nll(model, pad_left(rows, runs.pad), torch.tensor(lens)).reshape(len(runs.tasks), -1).mean(1))
    return torch.stack(out, 1)


def step_by_step(model: nn.Module, runs: Runs, lrs, *, heldout: bool = True, generator=None, progress=None):
    """``tp.online_alignment`` on the runs' prompts (module docstring) and the implicit patches ``dW_0 .. dW_k``;
    ``heldout=False``: no held-out loss along the way (the random-init control)."""
    patches = [token_patch(model, runs.prefix(i), progress=False) for i in range(runs.shots + 1)]
    loss, held = losses(model, runs)
    al = online_alignment(
        model,
        patches,
        loss,
        lrs=lrs,
        heldout=held if heldout else None,
        ceiling_steps=(),
        generator=generator,
        progress=progress,
    )
    return al, patches


def train(model: nn.Module, runs: Runs, names: list[str], optimizer: str, lr: float, steps: int) -> dict:
    """``steps`` full-batch steps of ``torch.optim.SGD`` or ``Adam`` (``optimizer``: ``"sgd"`` / ``"adam"``)
    on every run's ``k`` demonstrations (the mean answer NLL), each run its own copy of the matrices
    ``names`` -> ``name -> D [R, *W.shape]``. Dense: a full batch has a gradient term per position of every
    demonstration, more terms after a few steps than a factored form saves."""
    batch, answer = runs.example(None)
    r, params = len(runs.tasks), dict(model.named_parameters())

    def loss(_: int) -> Tensor:
        return answer_nll(model, batch, answer).reshape(r, -1).mean(1)

    d = {n: torch.zeros(r, *params[n].shape, dtype=params[n].dtype) for n in names}
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(list(d.values()), lr=lr)
    for _ in range(steps):
        g = gradient_at(model, loss, 0, names, deltas=d)
        for n, t in d.items():
            t.grad = g[n].dense()
        del g
        opt.step()
    return {n: t.detach() for n, t in d.items()}


@torch.no_grad()
def _hidden(model: nn.Module, rows: list[list[int]], pad: int) -> list[Tensor]:
    """Each layer's output at the last position, ``[rows, d]`` per layer."""
    out = model(**pad_left(rows, pad), use_cache=False, output_hidden_states=True)
    return [h[:, -1].double() for h in out.hidden_states[1:]]


def whole_updates(
    model: nn.Module, runs: Runs, patches, updates: dict[str, dict[str, Tensor]], thought: list | None
) -> dict:
    """Per method of ``updates`` (name -> ``D [R, *W]``): per matrix ``cos(dW_k - dW_0, D)`` and its
    ceiling ``s_1(D) / |D|_F``, the thought patch's cosine with ``D`` (``thought``: one patch per run),
    and SimAOU per layer at the query -> ``[R, M]`` / ``[R, L]`` tensors, keyed."""
    implicit = matrix_deltas(model, patches[-1])
    start = matrix_deltas(model, patches[0])
    names = sorted(implicit)
    moved = {n: implicit[n].index((slice(None), 0)) + _neg(start[n].index((slice(None), 0))) for n in names}
    thought_d = None
    if thought is not None:
        per_run = [matrix_deltas(model, t) for t in thought]
        thought_d = {n: [p.get(n) for p in per_run] for n in names}
    prompted = [runs.prompt(r) + q for r, q in enumerate(runs.query)]
    alone = [runs.lead + q for q in runs.query]
    h_c, h_0 = _hidden(model, prompted, runs.pad), _hidden(model, alone, runs.pad)
    out = {}
    for key, d in updates.items():
        rec = {
            "token_patch": torch.stack([cosine(moved[n], d[n]) for n in names], -1),
            "ceiling": torch.stack([rank1_ceiling(d[n]) for n in names], -1),
        }
        if thought_d is not None:
            rec["thought_patch"] = torch.stack(
                [
                    torch.stack(
                        [
                            cosine(t.index((0, 0)), _run(d[n], r)) if t is not None else torch.tensor(0.0)
                            for r, t in enumerate(ts)
                        ]
                    )
                    for n, ts in thought_d.items()
                ],
                -1,
            )
        with finetuned(model, d):
            h_ft = _hidden(model, alone, runs.pad)
        rec["simaou"] = torch.stack([simaou(a, b, c) for a, b, c in zip(h_c, h_0, h_ft)], -1)  # [R, L]
        out[key] = rec
    return {"names": names, "methods": out}


def _neg(d: LowRank) -> LowRank:
    return LowRank(-d.u, d.v)


def fit_thought(model: nn.Module, runs: Runs, r: int, ridge: float | str, progress=None):
    """The thought patch of run ``r``'s prompt on its calibration queries (the lead kept), at ``ridge``."""
    cal = batched(runs.calibration[r])
    return thought_patch(
        model, torch.tensor(runs.prompt(r)), cal, ridge=ridge, keep_bos=bool(runs.lead), progress=progress
    ).patch


def accuracy(
    model: nn.Module,
    tokenizer,
    runs: Runs,
    contexts: dict[str, Callable[[int], contextlib.AbstractContextManager]],
    steps: int = 4,
) -> dict[str, Tensor]:
    """Greedy accuracy on each run's test queries per method: ``contexts[name](r)`` is the context manager
    run ``r``'s queries are decoded under (``"icl"``: the prompt in front too) -> name -> ``[R]``."""
    out = {}
    for name, ctx in contexts.items():
        hits = []
        for r, tests in enumerate(runs.tests):
            head = runs.prompt(r) if name == "icl" else runs.lead
            with ctx(r):
                tokens, _ = greedy(model, pad_left([head + q for q, _, _ in tests], runs.pad), Method(name), steps)
            text = tokenizer.batch_decode(tokens, skip_special_tokens=True)
            hits.append(sum(is_correct(t, ys) for t, (_, _, ys) in zip(text, tests)) / len(tests))
        out[name] = torch.tensor(hits)
    return out


def one_run(deltas: dict, r: int) -> dict:
    """Run ``r``'s share of ``[R, *W]`` (or lead-``[R]`` low-rank) deltas, for ``finetuned`` on its queries alone."""
    return {n: dl.index(d, slice(r, r + 1)) for n, d in deltas.items()}


def _run(d, r: int):
    return dl.index(d, r)
