"""Do the implicit updates tell right answers from wrong ones? (``docs/dynamics.md`` section 7)

*Learning without training* suggests that the exact per-token updates could monitor a model. Here it
is measured: ``tp.generate`` decodes each test query of a few-shot word-pair prompt without the
prompt, from token patches, and returns every layer's update norm ``|dW|_F`` at every step. The
first step's norms (the update that produces the answer's first token) score each answer; the label
is whether the greedy answer is right (``is_correct``). Per layer and pooled (the norm over all
layers, ``sqrt(sum_l |dW_l|^2)``), the AUROC for telling wrong answers, with a bootstrap interval
(``stats.auroc``), beside two plain baselines from the same pass: the answer's first-token
probability and the logit margin between the top two tokens (low values flag a wrong answer).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenpatch.baselines.vectors import pad_left
from tokenpatch.generate import generate
from tokenpatch.progress import progress_bar
from tokenpatch.stats import auroc
from tokenpatch.tasks.wordpairs import Format, WordPairs, is_correct

__all__ = ["monitor_answers", "separation"]


@torch.no_grad()
def monitor_answers(
    model: nn.Module,
    tokenizer,
    tasks: list[WordPairs],
    lead: list[int],
    fmt: Format,
    *,
    shots: int,
    queries: int,
    seed: int = 0,
    steps: int = 4,
    batch: int = 16,
    progress: bool | None = None,
) -> dict:
    """For each task, its ``shots``-shot prompt (seeded split) and up to ``queries`` test queries decoded by
    ``tp.generate``: per answer its task, whether it is right, the first step's update norm per layer
    ``[L]``, the first token's probability and logit margin (JSON-able lists)."""
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    out = {"task": [], "right": [], "norms": [], "probability": [], "margin": []}
    jobs = []
    for task in tasks:
        split = task.split(seed=seed, demos=shots)
        prompt = lead + ids(fmt.demos(split["demos"][:shots]))
        jobs += [(task.name, prompt + ids(fmt.query.format(x=x)), ys) for x, ys in split["test"][:queries]]
    for a in progress_bar(range(0, len(jobs), batch), progress, desc="monitor", unit="batch"):
        part = jobs[a : a + batch]
        inputs = pad_left([row for _, row, _ in part], tokenizer.pad_token_id or tokenizer.eos_token_id)
        gen = generate(model, {k: inputs[k] for k in ("input_ids", "attention_mask")}, steps, progress=False)
        first = model(**inputs, use_cache=False, logits_to_keep=1).logits[:, -1].double().softmax(-1)  # [b, V]
        text = tokenizer.batch_decode(gen.tokens, skip_special_tokens=True)
        out["task"] += [name for name, _, _ in part]
        out["right"] += [bool(is_correct(t, ys)) for t, (_, _, ys) in zip(text, part)]
        out["norms"] += gen.update_norms[:, 0].double().tolist()
        out["probability"] += first.gather(-1, gen.tokens[:, :1])[:, 0].tolist()
        out["margin"] += gen.margin[:, 0].double().tolist()
    return out


def separation(answers: dict) -> dict:
    """AUROC for flagging wrong answers (the positives): per layer by a large update norm, pooled by the
    norm over all layers, and the baselines by a low first-token probability and a low margin. With
    only right or only wrong answers there is nothing to separate: the AUROCs are ``None``."""
    wrong = [not r for r in answers["right"]]
    out = {"answers": len(wrong), "wrong": sum(wrong)}
    if not 0 < out["wrong"] < out["answers"]:
        return {**out, "per_layer": None, "pooled": None, "probability": None, "margin": None}
    norms = torch.tensor(answers["norms"], dtype=torch.float64)  # [n, L]
    return {
        **out,
        "per_layer": [auroc(norms[:, j].numpy(), wrong) for j in range(norms.shape[1])],
        "pooled": auroc(norms.norm(dim=1).numpy(), wrong),
        "probability": auroc([-p for p in answers["probability"]], wrong),
        "margin": auroc([-m for m in answers["margin"]], wrong),
    }
