"""Hugging Face causal language models: one ``Family`` record per block design.

Both passes are the model's own forward, on unmodified ``transformers`` models:

* the **with-context pass** is one call of the base model on the token ids, with the attention
  mask and position ids (``model.base_model(input_ids, attention_mask, position_ids)``), so
  masks, padding, rotary or absolute positions and sliding windows are whatever the model does.
  Hooks record, at the query positions only, each layer's input ``h``, the residual value ``m``
  the MLP output is added to, the MLP input ``s``, the input of the output matrix (``hidden``)
  and the layer output;
* the **no-context pass** runs every query token alone (or, with a chunk removed, the kept
  tokens), at its original position id, through the same forward, with each layer's input at the
  queries (after the first layer) replaced by their with-context state ``h``: the patched layers
  below reproduce it exactly (``docs/deep-models.md``). Its ``(m, s)`` are the anchors. The first
  layer's input is the real no-context embedding, which keeps absolute position embeddings (GPT-2)
  right. A token alone needs neither its MLPs nor its query and key projections (``_lone_pass``).

The input side of every layer is one change of the MLP input (``Sites.input_site``), which
covers every parameter reading it, so the adapter needs to know only where ``m``, ``s`` and
``hidden`` are read and where the output side goes: the ``Family`` records of ``arch.families``,
read by ``arch.hf_modules`` (the layers, sites, heads and attention outputs: ``HFModules``, the
part of ``HFAdapter`` that names modules); ``arch.hf_inputs`` adds the inputs and positions
(``HFInputs``), this module the passes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch.arch import hf_calls
from tokenpatch.arch.family import Family
from tokenpatch.arch.hf_inputs import CONFIG_IGNORED, HFInputs
from tokenpatch.arch.hf_modules import text_config
from tokenpatch.arch.hooks import output_tensor, registered_hooks
from tokenpatch.arch.record import LayerRecord, NamedSite
from tokenpatch.arch.recording import read, register
from tokenpatch.arch.recording import recording as record_sites
from tokenpatch.errors import InputError

__all__ = ["HFAdapter", "EAGER_NAN", "output_tensor", "registered_hooks"]

# Why a left-padded batch can come out NaN: transformers' eager attention (Gemma 2's, Bloom's) turns a
# padding row whose keys are all masked into NaN, which then reaches every later position of that row.
EAGER_NAN = (
    " (with padding, attn_implementation='eager' gives NaN in transformers' own forward: use 'sdpa', or, "
    "where the model has no sdpa attention (Gemma 2, Bloom), rows without padding)"
)


def check_finite(rec: list[LayerRecord], padded: bool, first: int = 0) -> None:
    """Raise if the recorded states of layers ``first, first + 1, ...`` hold NaN or inf, naming the
    first such layer (a non-finite value anywhere reaches the last layer's output through the
    residual stream: one check suffices)."""
    out = rec[-1].out
    if bool(torch.isfinite(out.sum())) or bool(torch.isfinite(out).all()):  # one cheap reduction first
        return
    for i, r in enumerate(rec, first):
        if not all(bool(torch.isfinite(t).all()) for t in r.tensors().values()):
            hint = EAGER_NAN if padded else ""
            raise InputError(f"the model's own forward gives non-finite states at the queries at layer {i}{hint}")


class _Zero(nn.Module):
    """Stands in for a module whose output nobody needs: zeros of ``width`` features (the input's
    own width by default), no work."""

    def __init__(self, width: int | None = None):
        super().__init__()
        self.width = width

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        return x.new_zeros(*x.shape[:-1], self.width or x.shape[-1])


@contextlib.contextmanager
def _lone_pass(layers: list[tuple[Family, nn.Module]]) -> Iterator[None]:
    """For the no-context pass of each query token alone: in every layer, the MLP and the query and
    key projections replaced by ``_Zero``, put back on exit (errors included).

    Every layer's input after the first is replaced by the with-context state, so the MLP outputs
    are never read; and a token alone attends to itself only, so its attention weight is 1 whatever
    its query and key are (``softmax`` of one score): zero queries and keys (and their norms and
    rotations: still zero) leave the attention output ``W_o v`` exactly as it is. Where the MLP reads
    the residual stream itself (``Family.mlp_norm`` is ``None``) it stays: its input is ``m_0``. Of a
    mixture of stacked experts only the experts go (the block's router is cheap, and the block's own
    output may be more than a tensor: gpt-oss's is ``(y, router scores)``)."""
    skipped = [((fam.down if fam.experts else fam.mlp) if fam.mlp_norm is not None else None) for fam, _ in layers]
    named = [((*([s] if s is not None else []), *fam.lone_zero), layer) for s, (fam, layer) in zip(skipped, layers)]
    saved = [[layer.get_submodule(n) for n in names] for names, layer in named]
    try:
        for names, layer in named:
            for n in names:
                parent, _, attr = n.rpartition(".")
                module = layer.get_submodule(n)
                width = getattr(module, "out_features", None)  # a Linear's; an MLP module keeps its input's
                setattr(layer.get_submodule(parent) if parent else layer, attr, _Zero(width))
        yield
    finally:
        for (names, layer), modules in zip(named, saved):
            for n, module in zip(names, modules):
                parent, _, attr = n.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr, module)


class HFAdapter(HFInputs):
    """Hugging Face causal LMs of the ``FAMILIES`` block designs (see the module docstring): the
    module map (``HFModules``), the inputs and positions (``HFInputs``) and the two passes."""

    name = "hf"
    config_ignored = CONFIG_IGNORED

    # ------------------------------------------------------------------------- the two passes
    def recording(
        self, model: nn.Module, query: Tensor, every: bool = False, on_layer: Callable | None = None
    ) -> contextlib.AbstractContextManager[list[LayerRecord]]:
        """Hooks that record each layer's named sites (``Family.sites``: ``h, m, s, hidden, out``, and ``p``,
        ``gate``, ``v``, ``sum`` where the design has them) at positions ``query`` (``arch.recording``)."""
        parallel = self.family(model).parallel(text_config(model))
        layers = [self._layer(model, i) for i in range(self.n_layers(model))]
        return record_sites([(layer, fam.sites(parallel)) for fam, layer in layers], query, every, on_layer)

    def trace(
        self, model: nn.Module, inputs: dict, query: list[int], on_layer: Callable | None = None
    ) -> list[LayerRecord]:
        """The with-context pass: per layer ``h, m, s, hidden, out`` at the query positions ``[B, Q, .]``
        and ``first`` ``[B, Q]``, whether a query has no token before it (the first real one of its row);
        with ``on_layer``, given to it layer by layer instead (``recording``), each checked finite first."""
        every, padded = query == list(range(self.seq_len(inputs))), inputs["attention_mask"] is not None
        at = torch.tensor(query, device=inputs["input_ids"].device)
        mask = inputs["attention_mask"]
        # [B, Q]  queries with nothing before them: the first real token of their row
        first = (at == 0).expand(self.batch_size(inputs), -1) if mask is None else mask.cumsum(1)[:, at] == 1

        def checked(i, states):
            check_finite([states], padded, first=i)
            on_layer(i, states.replace(first=first))

        with self.recording(model, at, every, None if on_layer is None else checked) as rec:
            model.base_model(**self._forward_kwargs(inputs))
        if on_layer is None:
            check_finite(rec, padded)
            for r in rec:
                r.first = first
        return rec

    def anchors(
        self,
        model: nn.Module,
        inputs: dict,
        query: list[int],
        rec: list[LayerRecord],
        kept: list[int] | None = None,
    ):
        """The no-context pass: per layer ``(m_0, s_0)`` at the queries ``[B, Q, .]``. Each query alone
        (``kept=None``), or the kept tokens as one sequence (a chunk removed). The input of layer
        ``i > 0`` at a query is the with-context state ``rec[i].h`` (the patched layers below
        reproduce it); other kept tokens run unpatched, as ``functional_call`` runs them. The sites
        read are the recording's (``Family.sites``) of ``m`` and ``s`` (and ``h``, which a parallel
        block's ``m`` adds to)."""
        alone = self.alone_anchor(model) if kept is None else None
        if alone is not None:
            return [alone(i, r) for i, r in enumerate(rec)]
        parallel = self.family(model).parallel(text_config(model))
        batch, n_q = len(inputs["input_ids"]), len(query)
        out = [LayerRecord() for _ in rec]
        at = None if kept is None else torch.tensor([kept.index(q) for q in query])  # queries in the kept sequence
        wanted = ("h", "m", "s") if parallel else ("m", "s")

        def pick(t: Tensor) -> Tensor:  # [B*Q, 1, .] or [B, K, .] -> [B, Q, .]
            if t.ndim == 2:  # a module run on the flattened tokens (OPT's MLP, inside an MoE block)
                t = t.view(batch, -1, t.shape[-1])
            return t.reshape(batch, n_q, *t.shape[2:]) if at is None else t[:, at.to(t.device)]

        def swap(i):
            def hook(module, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                if at is None:
                    h = rec[i].h.reshape(batch * n_q, 1, -1)
                else:
                    h = h.index_copy(1, at.to(h.device), rec[i].h.to(h.dtype))
                return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

            return hook

        def grab(i: int, site: NamedSite) -> Callable:
            def hook(module, args, third):
                t = pick(read(site, args, third))
                t = out[i].h + t if site.plus_h else t
                before = getattr(out[i], site.field) if (i, site.field) in summed else None  # NamedSite.adds
                setattr(out[i], site.field, t if before is None else before + t)

            return hook

        pairs, summed = [], set()
        for i in range(len(rec)):
            fam, layer = self._layer(model, i)
            if i > 0:  # before the sites: the layer input they read is the with-context one
                pairs.append((functools.partial(layer.register_forward_pre_hook, with_kwargs=True), swap(i)))
            for site in fam.sites(parallel):
                if site.field in wanted:
                    pairs.append((register(layer.get_submodule(site.module), site), grab(i, site)))
                    if site.adds:  # the field is the sum of its sites' tensors (one forward: each once)
                        summed.add((i, site.field))
        stripped = self.strip(inputs, torch.tensor(query if kept is None else kept), separate=kept is None)
        # each layer's output is read only where the next layer's input is not replaced: with a chunk
        # removed the other kept tokens need the whole layer, each query alone needs no MLP at all
        layers = [self._layer(model, i) for i in range(len(rec))]
        skip = _lone_pass(layers) if kept is None else contextlib.nullcontext()
        with registered_hooks(pairs), skip:
            model.base_model(**stripped, use_cache=False)
        return [(o.m, o.s) for o in out]

    def prompted(self, model: nn.Module, prompt: Tensor, keys: tuple[str, ...]) -> Callable:
        """Calibration queries read after ``prompt``, on the prompt's cached keys and values (``hf_calls``)."""
        return hf_calls.prompted(self, model, prompt, keys)

    def layer_calls(self, model: nn.Module, inputs: Tensor) -> tuple[Tensor, list[tuple[tuple, dict]]]:
        """Each decoder layer's call for ``inputs``, captured from the model's forward (``hf_calls``)."""
        return hf_calls.layer_calls(self, model, inputs)

    @staticmethod
    def _forward_kwargs(inputs: dict) -> dict:
        kw = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"], "use_cache": False}
        if inputs["attention_mask"] is not None:
            kw["attention_mask"] = inputs["attention_mask"]
        return kw

    def run(self, model: nn.Module, inputs: Any) -> tuple[Tensor, list[Tensor]]:
        """The model's own forward: ``(logits [B, T, vocab], [h^1 .. h^L] each [B, T, d])``."""
        if not isinstance(inputs, dict) or "attention_mask" not in inputs:
            inputs = (
                {**inputs, "attention_mask": None} if isinstance(inputs, dict) else self.check_inputs(model, inputs)
            )
        hidden: list[Tensor] = []
        layers = self.layers(model)
        pairs = [(layer.register_forward_hook, lambda mod, a, o: hidden.append(output_tensor(o))) for layer in layers]
        with registered_hooks(pairs):
            logits = model(**self._forward_kwargs(inputs)).logits
        return logits, hidden
