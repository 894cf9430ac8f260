"""Generation without the prompt: ``tp.generate`` decodes greedily from token patches.

At every decoding step ``t`` the newest token ``x_t`` (the last prompt token at step 0) is run
twice:

* with everything before it (the prompt and the tokens generated so far), incrementally, on the
  model's own KV cache, with hooks recording every layer's states at ``x_t``;
* alone, at its original position id, with the token patch of all that context applied
  (``tp.token_patch`` in its default mode: all context before the query removed).

The next token is the argmax of the *patched, context-free* pass; by the patch theorem its
logits equal the with-context ones, so the continuation is the one ordinary greedy generation
gives (up to rounding where the top two logits tie). Each step also yields the Frobenius norm of
every layer's implicit update (the paper's "meta-gradient" signal of model health): ``[B, n, L]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch import offload
from tokenpatch.arch import adapter_for
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank, norm_of
from tokenpatch.patch import INPUT_SUFFIX, Patch
from tokenpatch.patching import assemble, recorded_deltas
from tokenpatch.plans import make_plan
from tokenpatch.progress import progress_bar
from tokenpatch.run import functional_call

__all__ = ["Generation", "generate"]


@dataclass
class Generation:
    """What ``generate`` decoded, per row ``b`` and step ``t``.

    ``tokens [B, n]``: the tokens chosen from the patched, context-free logits.
    ``agree [B, n]``: whether the with-context argmax is the same token.
    ``margin [B, n]``: the with-context logits' top-1 minus top-2 (a small margin is where rounding
    may flip the choice). ``logit_error [B, n]``: ``max |patched - with-context|`` over the vocabulary.
    ``update_norms [B, n, L]``: per layer, ``sqrt(sum |dW|_F^2)`` over the layer's deltas.
    """

    tokens: Tensor
    agree: Tensor
    margin: Tensor
    logit_error: Tensor
    update_norms: Tensor
    meta: dict = field(default_factory=dict)

    def text(self, tokenizer) -> list[str]:
        """The generated tokens decoded, one string per row: ``tp.generate(...).text(tokenizer)``."""
        return tokenizer.batch_decode(self.tokens, skip_special_tokens=False)

    def __repr__(self) -> str:
        rows, steps = self.tokens.shape
        agree = float(self.agree.double().mean()) if self.agree.numel() else float("nan")
        err = float(self.logit_error.max()) if self.logit_error.numel() else float("nan")
        return (
            f"Generation({rows} row{'s' * (rows != 1)} x {steps} tokens, {agree:.0%} agree with the prompted "
            f"model, max logit error {err:.2e}; .tokens, .text(tokenizer), .update_norms [B, n, L])"
        )


def _layer_norms(model: nn.Module, adapter, patch: Patch) -> Tensor:
    """``[B, L]``: per layer, the Frobenius norm of its whole weight update, ``sqrt(sum |dW|_F^2)``.
    An input change ``D = sum_k d_k v_k^T`` counts as ``W D = sum_k (W d_k) v_k^T`` on every matrix
    reading it; every norm from the factors as ``Patch.norms`` takes them (``lowrank.norm_of``: a huge
    ``v`` of a tiny anchor does not overflow), summed in float64."""
    params = dict(offload.named_values(model))  # an accelerate-offloaded weight: its data
    readers = patch.readers
    terms: list[tuple[int, Any]] = []  # (layer, a delta [B, 1, ...] whose |.|_F^2 adds to the layer's)
    for i in range(adapter.n_layers(model)):
        sites = adapter.sites(model, i)
        if sites.input_site is not None:
            key = f"{sites.input_site}{INPUT_SUFFIX}"
            d = patch[key]  # LowRank [B, 1, 1, H]: u = d, v
            for reader, layout in readers.get(key, []):
                w = params[reader].detach().to(d.u.device, d.u.dtype)
                wd = (
                    torch.einsum("...oi,bqri->bqr...o", w, d.u)
                    if layout == "out_in"
                    else torch.einsum("...io,bqri->bqr...o", w, d.u)
                )
                terms.append((i, LowRank(wd.flatten(3), d.v)))
        terms += [(i, patch[n]) for n in (sites.output.names if sites.output is not None else ()) if n in patch]
    squares = _squared_norms([d for _, d in terms])  # [B] each
    per_layer = [torch.zeros((), dtype=torch.float64) for _ in range(adapter.n_layers(model))]
    for (i, _), s in zip(terms, squares):
        per_layer[i] = per_layer[i] + s
    per_layer = [s.sqrt() for s in per_layer]
    # a layer that changes nothing (a block that mixes no tokens, Nemotron-H's MLPs): zero in every row
    return torch.stack(torch.broadcast_tensors(*per_layer), -1)


def _squared_norms(deltas: list) -> list[Tensor]:
    """``|d|_F^2`` ``[B]`` (float64, on the CPU) of each delta ``[B, 1, ...]``, those of one shape, rank,
    dtype and device taken in one ``norm_of`` (joined along the batch: the same numbers as one by one,
    each row's norm its own, in far fewer calls)."""
    groups: dict[tuple, list[int]] = {}
    for k, d in enumerate(deltas):
        tensors = dl.tensors(d)
        groups.setdefault((dl.kind(d), *((t.shape, t.dtype, t.device) for t in tensors)), []).append(k)
    out: list[Tensor] = [torch.zeros(())] * len(deltas)
    for members in groups.values():
        joined = dl.cat([deltas[k] for k in members], 0)  # [n * B, 1, ...]
        for k, s in zip(members, norm_of(joined)[:, 0].double().square().cpu().unflatten(0, (len(members), -1))):
            out[k] = s
    return out


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Any,
    max_new_tokens: int = 20,
    *,
    eos_token_id: int | None = None,
    progress: bool | None = None,
) -> Generation:
    """Greedy decoding of ``max_new_tokens`` tokens with the prompt removed and replaced, at every
    step, by the token patch of the context (see the module docstring).

    ``prompt``: token ids ``[B, T]`` or a tokenizer's output (``input_ids``, ``attention_mask``;
    pad on the left). ``eos_token_id``: stop once every row has produced it. Models whose adapter
    implements ``recording`` and ``anchors`` (Hugging Face models; ``tokenpatch.arch.Adapter``).
    """
    adapter = adapter_for(model)
    with adapter.fixed(model):  # the module map looked up once for every step
        return _decode(model, adapter, prompt, max_new_tokens, eos_token_id, progress)


def _decode(
    model: nn.Module, adapter, prompt: Any, max_new_tokens: int, eos_token_id: int | None, progress
) -> Generation:
    """``generate``'s steps, with the model's ``adapter``."""
    adapter.require("recording", "anchors", "check_inputs", "strip", "sites", by="tp.generate")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    inputs = adapter.check_inputs(model, prompt)
    ids, pos, mask = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    batch = ids.shape[0]
    limit = adapter.position_limit(model)  # step t runs the token at position max(pos) + t
    if limit is not None and int(pos.max()) + max_new_tokens - 1 >= limit:
        raise InputError(
            f"a prompt of {int(pos.max()) + 1} positions and max_new_tokens={max_new_tokens} run past the "
            f"model's {limit} positions: pass max_new_tokens <= {limit - int(pos.max())}"
        )
    if mask is None:
        mask = torch.ones_like(ids)
    adapter.strip(inputs, torch.tensor([ids.shape[1] - 1]), separate=True)  # the last position must be a token
    plan = make_plan(1, -1, None)  # each step's patch: one lone token
    cache, step_ids, step_pos, seen, cached = None, ids, pos, ids, True
    rows: dict[str, list[Tensor]] = {k: [] for k in ("tokens", "agree", "margin", "logit_error", "update_norms")}
    for _ in progress_bar(range(max_new_tokens), progress, desc="generate", unit="token"):
        last = torch.tensor([step_ids.shape[1] - 1], device=ids.device)
        with adapter.recording(model, last) as rec:
            out = model(
                input_ids=step_ids,
                position_ids=step_pos,
                attention_mask=_step_mask(model, seen, mask, cache),
                cache=cache,
                use_cache=cached,
                logits_to_keep=1,
            )
        # a model without a cache object (RecurrentGemma keeps its state in its modules) runs every step whole
        cache, ref = getattr(out, "cache", None), out.logits[:, -1]  # [B, vocab]
        cached = cache is not None
        lone = {"input_ids": step_ids[:, -1:], "position_ids": step_pos[:, -1:], "attention_mask": None}
        anchors = adapter.anchors(model, lone, [0], rec)
        patch = assemble(
            model,
            adapter,
            recorded_deltas(model, adapter, rec, anchors, [0]),
            plan,
            batch,
            rec[0].out.dtype,
        )
        got = functional_call(
            model, patch, input_ids=lone["input_ids"], position_ids=lone["position_ids"], logits_to_keep=1
        ).logits[:, -1]  # [B, vocab]
        nxt = got.argmax(-1)  # [B]
        top2 = ref.double().topk(2, -1).values
        rows["tokens"].append(nxt)
        rows["agree"].append(nxt == ref.argmax(-1))
        rows["margin"].append(top2[:, 0] - top2[:, 1])
        rows["logit_error"].append((got.double() - ref.double()).abs().amax(-1))
        rows["update_norms"].append(_layer_norms(model, adapter, patch))
        seen, pos = torch.cat([seen, nxt[:, None]], 1), torch.cat([pos, pos[:, -1:] + 1], 1)
        step_ids, step_pos = (nxt[:, None], pos[:, -1:]) if cached else (seen, pos)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if eos_token_id is not None and bool(torch.stack(rows["tokens"], 1).eq(eos_token_id).any(1).all()):
            break
    return Generation(
        **{k: torch.stack(v, 1) for k, v in rows.items()},
        meta={"model": adapter.describe(model), "prompt_len": int(ids.shape[1]), "batch": batch},
    )


def _step_mask(model: nn.Module, seen: Tensor, mask: Tensor, cache: Any) -> Tensor | None:
    """The attention mask of a decoding step as the model's own ``generate`` passes it
    (``prepare_inputs_for_generation``): the mask of every token so far for attention, none after the
    first step for a model whose recurrent state already holds the prompt (Mamba: a mask longer than the
    step's one token would broadcast its states)."""
    prepared = model.prepare_inputs_for_generation(
        seen, cache=cache, attention_mask=mask, use_cache=True, is_first_iteration=cache is None
    )
    return prepared.get("attention_mask", mask) if isinstance(prepared, dict) else mask
