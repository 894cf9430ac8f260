"""Running a model with a patch: ``apply`` (write and restore) and ``functional_call`` (hooks, ``delta_hooks``).

``functional_call`` never touches the weights: forward hooks on the patched modules add
``u (v . x) + db`` to their outputs, the factors never multiplied out. The inputs must be the
no-context inputs the patch was made for (``tp.strip_context`` gives them); anything else is an
``InputError`` unless the call opts in: ``broadcast=True`` to run one row of patches over more
sequences, ``any_length=True`` to run sequences of another length (e.g. tokens after the query). A static
patch (``patch.static``, e.g. a thought patch: one update for any input) runs on any
no-context inputs as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch import files, offload
from tokenpatch.arch import ADAPTERS
from tokenpatch.delta_hooks import DeltaHook, hooked
from tokenpatch.errors import InputError
from tokenpatch.patch import INPUT_SUFFIX, Patch
from tokenpatch.plans import token_digests, token_ids

# hooked and DeltaHook are defined in delta_hooks.py and handed on from here, where their users import them
__all__ = ["apply", "functional_call", "patched_run", "hooked", "DeltaHook"]


def patched_run(
    run, model: nn.Module, patch: Patch, *args, broadcast: bool = False, any_length: bool = False, **kwargs
):
    """``run(*args, **kwargs)`` with ``patch``'s hooks on ``model`` (checked against it, and finite, first)."""
    patch.check_model(model)
    patch.check_finite()
    with hooked(model, patch, broadcast, any_length):
        return run(*args, **kwargs)


def functional_call(model: nn.Module, patch: Patch, *args, broadcast: bool = False, any_length: bool = False, **kwargs):
    """``model(*args, **kwargs)`` with ``patch`` applied in the forward, nothing mutated.

    Each patched linear computes ``W x + b + u (v . x) + db`` (factors never multiplied out).
    Inputs as ``strip_context`` gives them: for a patch acting everywhere, input sequence
    ``b * Q + q`` uses patch ``[b, q]`` at every position; for one acting at positions, patch
    ``[b, q]`` acts at position ``positions[q]`` of sequence ``b``. Inputs that cannot be what the
    patch was made for raise ``InputError``: another number of sequences (``broadcast=True`` runs
    a patch holding one batch row over every sequence), or another sequence length
    (``any_length=True`` allows it, e.g. to run tokens after the query under the patch).
    Differentiable with respect to the model's parameters and the patch factors.

    The deltas ride on forward hooks registered for this call and removed afterwards (also on
    error): weights are never touched, but another thread running the same model meanwhile
    would see the patch. (``torch.func.functional_call`` substitutes whole parameters, which
    would mean materialising ``W + u v^T`` per patch, and cannot vary them along the batch.)

    Positions: where the model's adapter can tell (``Adapter.check_positions``), a forward that leaves
    out the position ids a patch needs is refused (a Hugging Face model then counts them from 0). The
    adapter's ``forward_defaults`` are passed unless given (RecurrentGemma, which keeps its decoding
    state in its modules, runs with ``use_cache=False``).
    Tokens: a token patch records a fingerprint of the no-context token ids of each ``[b, q]``
    (``Patch.tokens``) and other token ids are refused: it is exact for those only. ``broadcast=True``
    or ``any_length=True`` runs it on other tokens on purpose, and a static patch (a thought patch,
    fitted for any query) has none; but a thought patch fitted with ``keep_bos=True`` needs its prompt's
    first token in front of every sequence (``Patch.prefix``), and refuses inputs without it.
    """
    adapter = next((a for a in ADAPTERS if a.matches(model)), None)  # a model of no family runs unchecked
    if adapter is not None:
        adapter.check_positions(model, patch, args, kwargs)
        kwargs = {**adapter.forward_defaults(model), **kwargs}
    _check_tokens(patch, args, kwargs, broadcast or any_length)
    return patched_run(model, model, patch, *args, broadcast=broadcast, any_length=any_length, **kwargs)


def _check_tokens(patch: Patch, args: tuple, kwargs: dict, elsewhere: bool) -> None:
    """Refuse empty inputs, inputs without the patch's ``prefix``, and (unless ``elsewhere``: broadcast or
    any length asked for) token ids other than the ones each ``[b, q]`` patch was made for (``Patch.tokens``).
    A forward continuing a cache runs later tokens: only emptiness is checked."""
    first = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
    if isinstance(first, Tensor) and first.numel() == 0:
        raise InputError(f"functional_call: the inputs are empty (shape {tuple(first.shape)}): pass at least one token")
    ids = token_ids(first)
    if ids is None or any(kwargs.get(k) is not None for k in ("cache", "past_key_values")):
        return
    if patch.prefix:
        head = torch.tensor(patch.prefix, device=ids.device, dtype=ids.dtype)
        short = ids.shape[1] < len(head)
        bad = list(range(ids.shape[0])) if short else (ids[:, : len(head)] != head).any(1).nonzero()[:, 0].tolist()
        if bad:
            raise InputError(
                f"this patch needs every sequence to begin with the token ids {list(patch.prefix)} (a thought patch "
                f"fitted with keep_bos=True: its prompt's first token), rows {bad[:5]} do not: put them in front"
            )
    if patch.tokens is None or patch.static or elsewhere:
        return
    (rows, queries), at = patch.lead, patch.acts == "at_positions"
    if ids.shape[0] != (rows if at else rows * queries):
        return  # another number of sequences: the hooks say so
    want = patch.tokens if at else patch.tokens.reshape(-1, 1)  # per sequence, its patches' fingerprints
    got = token_digests(ids)[:, None]
    bad = ((want != got) & (want != 0)).any(1).nonzero()[:, 0].tolist()
    if bad:
        raise InputError(
            f"input sequences {bad[:5]} hold other tokens than the ones this token patch was made for (it is exact "
            "for those only): pass tp.strip_context(model, inputs) of its own inputs, or broadcast=True / "
            "any_length=True to run it on other tokens on purpose"
        )


@contextlib.contextmanager
def apply(model: nn.Module, patch: Patch) -> Iterator[nn.Module]:
    """Context manager: write ``W + delta`` into the model's weights; restore them bit-exactly
    on exit, also when the body raises.

    Only a single patch (``patch.lead == (1, 1)``, e.g. ``patch[b, q]``) acting everywhere can be
    written into weights; position-specific patches (a chunk removed from the middle of a deep
    model) need ``functional_call``. The delta is materialised here, cast to the weight's dtype.
    Inside the block nothing sees the inputs: run the query at the position id it was made for
    (``position_ids=`` on a Hugging Face model with absolute positions, GPT-2; ``tp.strip_context``), on
    the tokens it was made for, after its ``prefix`` (a ``keep_bos`` thought patch's BOS): the checks
    ``functional_call`` makes of them cannot be made here.
    Weights changed inside the block (an optimizer step) raise ``InputError`` on exit: the patched ones
    are restored whatever happened, so the others would keep a change the patched ones lost.
    """
    if patch.lead != (1, 1):
        raise InputError(
            f"apply() writes one set of weights but the patch holds {patch.lead[0]} x {patch.lead[1]} "
            "(batch x query) patches; pick one with patch[b, q], or use functional_call"
        )
    if patch.acts == "at_positions":
        raise InputError(
            f"this patch acts only at position {patch.positions[0]} of the no-context sequence (a chunk "
            "was removed mid-sequence); written into weights it would change the context tokens too. "
            "Use functional_call"
        )
    patch.check_model(model)
    patch.check_finite()
    params = dict(model.named_parameters())
    targets = [r for name in patch for r, _ in patch.readers.get(name, [])] + [n for n in patch if n in params]
    gone = next((n for n in targets if offload.offloaded(params[n])), None)
    if gone is not None:
        raise InputError(
            f"apply() cannot write into weights accelerate offloaded ({gone} is on the meta device, its data "
            "on disk or in CPU memory): use tp.functional_call(model, patch, ...), which runs the patch as hooks"
        )
    state = files.cached_state(model)  # unchanged by the round trip below, so kept valid after it
    saved: dict[str, Tensor] = {}
    changed: list[str] = []
    try:
        with torch.no_grad():
            for name, delta in patch.items():
                if name.endswith(INPUT_SUFFIX):  # W + W D on every matrix reading that input
                    d = delta.dense()[0, 0]  # [d, d]
                    for reader, layout in patch.readers[name]:
                        p = params[reader]
                        saved.setdefault(reader, p.detach().clone())
                        dd = d.to(device=p.device, dtype=torch.promote_types(p.dtype, torch.float32))
                        w = p.detach().to(dd.dtype)
                        p.copy_(w + (w @ dd if layout == "out_in" else dd.T @ w))
                    continue
                p = params[name]
                saved.setdefault(name, p.detach().clone())
                dense = dl.as_weight(delta, p.shape)[0, 0]
                p.add_(dense.to(device=p.device, dtype=p.dtype))
        written = files.versions(params.values())
        yield model
        changed = [n for n, v, w in zip(params, files.versions(params.values()), written) if v != w]
    finally:
        with torch.no_grad():
            for name, original in saved.items():
                params[name].copy_(original)
        files.restored(model, state, {id(params[name]) for name in saved})
    kept = [n for n in changed if n not in saved]
    if kept:  # the patched ones were just restored, the others keep the change: say so, once
        raise InputError(
            f"{len(changed)} weights changed inside tp.apply (an optimizer step or an in-place edit?); it restored "
            f"the {len(saved)} it patched, so {len(kept)} (e.g. {kept[0]}) keep the change and the others do not: "
            "change weights outside the block (tp.functional_call is differentiable), then reload them"
        )
