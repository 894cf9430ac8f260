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
half of ``HFAdapter`` that names modules); this module adds the passes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch.arch.families import CONFIG_IGNORED, Family
from tokenpatch.arch.hf_modules import HFModules
from tokenpatch.arch.hooks import output_tensor, registered_hooks
from tokenpatch.errors import InputError
from tokenpatch.plans import refuse_padded_queries

__all__ = ["HFAdapter", "output_tensor", "registered_hooks"]


def check_finite(rec: list[dict[str, Tensor]], padded: bool) -> None:
    """Raise if the recorded states hold NaN or inf, naming the first layer (a non-finite value
    anywhere reaches the last layer's output through the residual stream: one check suffices)."""
    if bool(torch.isfinite(rec[-1]["out"]).all()):
        return
    for i, r in enumerate(rec):
        if not all(bool(torch.isfinite(t).all()) for t in r.values()):
            hint = (
                " (with padding, attn_implementation='eager' gives NaN in transformers' own forward: use 'sdpa')"
                if padded
                else ""
            )
            raise InputError(f"the model's own forward gives non-finite states at the queries at layer {i}{hint}")


def _before_patches(module: nn.Module):
    """Registers a forward pre-hook on ``module`` that runs before any registered earlier: on the MLP
    (which reads ``m`` itself where no norm comes first), before a patch's input change, so ``m`` and
    ``s`` are recorded as the layer computes them, unchanged, as a norm's hooks would see them."""
    return lambda hook: module.register_forward_pre_hook(hook, prepend=True)


class _Zero(nn.Module):
    """Stands in for a module whose output nobody needs: zeros of ``width`` features (the input's
    own width by default), no work."""

    def __init__(self, width: int | None = None):
        super().__init__()
        self.width = width

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        return x.new_zeros(*x.shape[:-1], self.width or x.shape[-1])


@contextlib.contextmanager
def _lone_pass(layers: nn.ModuleList, fam: Family) -> Iterator[None]:
    """For the no-context pass of each query token alone: in every layer, the MLP and the query and
    key projections replaced by ``_Zero``, put back on exit (errors included).

    Every layer's input after the first is replaced by the with-context state, so the MLP outputs
    are never read; and a token alone attends to itself only, so its attention weight is 1 whatever
    its query and key are (``softmax`` of one score): zero queries and keys (and their norms and
    rotations: still zero) leave the attention output ``W_o v`` exactly as it is. Where the MLP reads
    the residual stream itself (``Family.mlp_norm`` is ``None``) it stays: its input is ``m_0``."""
    names = (*([fam.mlp] if fam.mlp_norm is not None else []), *fam.lone_zero)
    saved = [[layer.get_submodule(n) for n in names] for layer in layers]
    try:
        for layer in layers:
            for n in names:
                parent, _, attr = n.rpartition(".")
                module = layer.get_submodule(n)
                width = getattr(module, "out_features", None)  # a Linear's; an MLP module keeps its input's
                setattr(layer.get_submodule(parent) if parent else layer, attr, _Zero(width))
        yield
    finally:
        for layer, modules in zip(layers, saved):
            for n, module in zip(names, modules):
                parent, _, attr = n.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr, module)


class HFAdapter(HFModules):
    """Hugging Face causal LMs of the ``FAMILIES`` block designs (see the module docstring).

    Inputs: token ids ``[batch, pos]``, or a mapping with ``input_ids`` and optionally
    ``attention_mask`` (what a tokenizer returns; padded batches) and ``position_ids``. Without
    position ids they are counted from the attention mask (``cumsum - 1``), so a left-padded row
    gets the positions it would have alone.
    """

    name = "hf"
    traced = True  # token_patch runs ``trace`` and ``anchors`` instead of the layer-by-layer mix/finish
    config_ignored = CONFIG_IGNORED

    def check_positions(self, model: nn.Module, patch: Any, args: tuple, kwargs: dict) -> None:
        """Refuse a forward that leaves out ``position_ids`` (the model then counts them from 0 in each
        sequence) where the patch's plan needs others: with absolute positions (a ``Family.position_table``,
        GPT-2) any position but 0 of each sequence; with rotary ones, a kept sequence whose distances changed (a chunk
        removed before a kept token; a token alone, or a kept run shifted as a whole, is the same at
        any position). Given position ids are the caller's: with padding they are not the plan's
        positions, so they are not compared. A patch without a plan or static has no positions."""
        plan = patch.plan
        if len(args) > 1:  # arguments by position: in the order of this model's own forward
            kwargs = {**inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments, **kwargs}
        # a cache's length starts the count: positions the adapter cannot see
        given = any(kwargs.get(k) is not None for k in ("position_ids", "cache", "past_key_values"))
        if plan is None or patch.static or given:
            return
        kept = list(plan.query if plan.mode == "alone" else plan.kept)
        if self.family(model).position_table is not None:  # absolute positions: every id counts
            wrong = any(p != (0 if plan.mode == "alone" else i) for i, p in enumerate(kept))
        else:
            wrong = plan.mode == "chunk" and any(b - a != 1 for a, b in zip(kept, kept[1:]))
        if wrong:
            what = f"its queries alone at positions {kept}" if plan.mode == "alone" else f"the kept positions {kept}"
            raise InputError(
                f"this patch was made for {what}, but no position_ids were given, so the model counts "
                "from 0: pass position_ids= as tp.strip_context gives them (**tp.strip_context(model, inputs))"
            )

    def position_limit(self, model: nn.Module) -> int | None:
        fam = self.family(model)
        table = fam.position_table
        return model.base_model.get_submodule(table).num_embeddings - fam.position_offset if table else None

    # ------------------------------------------------------------------------- inputs
    def check_inputs(self, model: nn.Module, inputs: Any) -> dict:
        """``{"input_ids" [B, T], "attention_mask" [B, T] or None, "position_ids" [B, T]}``."""
        self.check_model(model)  # a causal LM in eval mode whose layers have their own modules
        if isinstance(inputs, Tensor):
            inputs = {"input_ids": inputs}
        if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
            raise InputError(
                f"inputs must be token ids [batch, pos] or a mapping with 'input_ids' (a tokenizer's "
                f"output), got {type(inputs).__name__}"
            )
        ids = inputs["input_ids"]
        if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise InputError(
                f"input_ids must be an integer tensor [batch, pos], got "
                f"{tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}"
                f"{' ' + str(ids.dtype) if isinstance(ids, Tensor) else ''}"
            )
        if not ids.numel():
            raise InputError(f"input_ids are empty (shape {tuple(ids.shape)}): pass at least one row of one token")
        vocab = model.get_input_embeddings().num_embeddings
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InputError(
                f"input_ids must lie in [0, {vocab}) (the model's vocabulary), got [{int(ids.min())}, {int(ids.max())}]"
            )
        device = model.get_input_embeddings().weight.device
        mask = inputs.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.shape != ids.shape:
                got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
                raise InputError(
                    f"attention_mask must be a tensor of the shape of input_ids {tuple(ids.shape)}, got {got}"
                )
            if bool(((mask != 0) & (mask != 1)).any()):  # before any cast: 0.5 is not a token
                raise InputError("attention_mask must hold 0 (padding) and 1 (token) only")
            mask = None if mask.all() else mask.to(device=device, dtype=torch.long)
        pos = inputs.get("position_ids")
        if pos is None:
            pos = (
                (mask.cumsum(-1) - 1).clamp_min(0)
                if mask is not None
                else torch.arange(ids.shape[1], device=device).expand(ids.shape)
            )
        elif not isinstance(pos, Tensor) or pos.shape != ids.shape or pos.dtype not in (torch.int64, torch.int32):
            raise InputError(f"position_ids must be an integer tensor of the shape of input_ids {tuple(ids.shape)}")
        if int(pos.min()) < 0:
            raise InputError(f"position_ids must be >= 0, got {int(pos.min())}")
        size = self.position_limit(model)  # learned absolute positions (GPT-2) end somewhere
        if size is not None and int(pos.max()) >= size:
            raise InputError(
                f"position id {int(pos.max())} is past the model's learned position table "
                f"({self.family(model).position_table}, {size} positions): pass at most {size} tokens per row"
            )
        return {"input_ids": ids.to(device), "attention_mask": mask, "position_ids": pos.to(device)}

    def padding(self, inputs: dict) -> Tensor | None:
        mask = inputs["attention_mask"]
        return None if mask is None else mask == 0

    def seq_len(self, inputs: dict) -> int:
        return inputs["input_ids"].shape[1]

    def batch_size(self, inputs: dict) -> int:
        return inputs["input_ids"].shape[0]

    def strip(self, inputs: dict, positions: Tensor, separate: bool) -> dict:
        """The keyword arguments of the no-context forward, every token at its original position id:
        each of ``positions`` alone (``separate``: ``input_ids``, ``position_ids`` ``[B*K, 1]``), or the
        kept tokens ``positions`` as one sequence per row (``[B, K]``, with the attention mask if padded)."""
        mask = inputs["attention_mask"]
        if not separate:
            ids = inputs["input_ids"][:, positions]
            # an explicit mask, even of ones: without one, transformers reads a jump in the position ids
            # (the removed chunk) as the start of another packed sequence and masks what came before
            return {
                "input_ids": ids,
                "position_ids": inputs["position_ids"][:, positions],
                "attention_mask": torch.ones_like(ids) if mask is None else mask[:, positions],
            }
        refuse_padded_queries(self.padding(inputs), positions.tolist())
        return {
            "input_ids": inputs["input_ids"][:, positions].reshape(-1, 1),
            "position_ids": inputs["position_ids"][:, positions].reshape(-1, 1),
        }

    # ------------------------------------------------------------------------- the two passes
    @contextlib.contextmanager
    def recording(self, model: nn.Module, query: Tensor, every: bool = False) -> Iterator[list[dict[str, Tensor]]]:
        """Hooks that record, during any forward of ``model`` inside the block, per layer ``h, m, s,
        hidden, out`` (and ``p``, the MLP output before a norm after it; ``gate``, a shared expert's
        gate logit) at positions ``query`` of the sequence run ``[B, Q, .]`` (``every``: the query is
        every position in order, kept without a copy); the list is filled on exit (``m`` of a
        parallel block is ``h`` plus the attention output)."""
        parallel = self.family(model).parallel(model.config)
        rec: list[dict[str, Tensor]] = [{} for _ in range(self.n_layers(model))]

        shape: list[int] = []  # [batch, pos] of the sequences running (set by each layer's first hook)

        def grab(i, key, take_input):
            def hook(module, args, *rest):
                kwargs = rest[0] if take_input and rest and isinstance(rest[0], dict) else {}
                t = (args[0] if args else kwargs["hidden_states"]) if take_input else output_tensor(rest[-1])
                if key == "h":
                    shape[:] = t.shape[:2]
                if t.ndim == 2:  # a module run on the flattened tokens [batch * pos, .] (inside an MoE block)
                    t = t.view(*shape, -1)
                rec[i][key] = t if every else t[:, query.to(t.device)]

            return hook

        pairs, s_is_m = [], []  # s_is_m: layers whose MLP reads the residual stream itself
        for i in range(len(rec)):
            site = self._sites_of(model, i)
            s_is_m.append("mlp_norm" not in site)
            pairs.append(
                (lambda h, mod=site["layer"]: mod.register_forward_pre_hook(h, with_kwargs=True), grab(i, "h", True))
            )
            pairs.append((site["layer"].register_forward_hook, grab(i, "out", False)))
            if "mlp_norm" in site:
                pairs.append((site["mlp_norm"].register_forward_hook, grab(i, "s", False)))
            pairs.append((site["down"].register_forward_pre_hook, grab(i, "hidden", True)))
            if "down_gate" in site:
                pairs.append((site["down_gate"].register_forward_hook, grab(i, "gate", False)))
            if self._layer_family(model, i).out_norm is not None:  # the MLP output before its norm
                pairs.append((site["down"].register_forward_hook, grab(i, "p", False)))
            if parallel:
                pairs.append((site["attn"].register_forward_hook, grab(i, "a", False)))
            else:  # the norm's input, or the MLP's where it reads the residual stream itself (s = m)
                pairs.append((_before_patches(site.get("mlp_norm", site["mlp"])), grab(i, "m", True)))
        with registered_hooks(pairs):
            yield rec
        for r, same in zip(rec, s_is_m):
            if parallel and "a" in r:  # a layer the forward reached (a caller may end it early)
                r["m"] = r["h"] + r.pop("a")
            if same and "m" in r:
                r["s"] = r["m"]

    def trace(self, model: nn.Module, inputs: dict, query: list[int]) -> list[dict[str, Tensor]]:
        """The with-context pass: per layer ``h, m, s, hidden, out`` at the query positions ``[B, Q, .]``."""
        every = query == list(range(self.seq_len(inputs)))
        with self.recording(model, torch.tensor(query, device=inputs["input_ids"].device), every) as rec:
            model.base_model(**self._forward_kwargs(inputs))
        check_finite(rec, inputs["attention_mask"] is not None)
        return rec

    def anchors(
        self,
        model: nn.Module,
        inputs: dict,
        query: list[int],
        rec: list[dict[str, Tensor]],
        kept: list[int] | None = None,
    ):
        """The no-context pass: per layer ``(m_0, s_0)`` at the queries ``[B, Q, .]``. Each query alone
        (``kept=None``), or the kept tokens as one sequence (a chunk removed). The input of layer
        ``i > 0`` at a query is the with-context state ``rec[i]["h"]`` (the patched layers below
        reproduce it); other kept tokens run unpatched, as ``functional_call`` runs them."""
        parallel = self.family(model).parallel(model.config)
        batch, n_q = len(inputs["input_ids"]), len(query)
        out: list[dict[str, Tensor]] = [{} for _ in rec]
        at = None if kept is None else torch.tensor([kept.index(q) for q in query])  # queries in the kept sequence

        def pick(t: Tensor) -> Tensor:  # [B*Q, 1, .] or [B, K, .] -> [B, Q, .]
            return t.reshape(batch, n_q, *t.shape[2:]) if at is None else t[:, at.to(t.device)]

        def swap(i):
            def hook(module, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                if at is None:
                    h = rec[i]["h"].reshape(batch * n_q, 1, -1)
                else:
                    h = h.index_copy(1, at.to(h.device), rec[i]["h"].to(h.dtype))
                return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

            return hook

        def grab(i, key, take_input):
            def hook(module, args, *rest):
                out[i][key] = pick(args[0] if take_input else output_tensor(rest[-1]))

            return hook

        def record(i):
            def hook(module, args, kwargs):
                out[i]["h"] = pick(args[0] if args else kwargs["hidden_states"])

            return hook

        pairs = []
        for i in range(len(rec)):
            site = self._sites_of(model, i)
            register = lambda h, mod=site["layer"]: mod.register_forward_pre_hook(h, with_kwargs=True)
            if i > 0:
                pairs.append((register, swap(i)))
            elif parallel:
                pairs.append((register, record(i)))
            if "mlp_norm" in site:
                pairs.append((site["mlp_norm"].register_forward_hook, grab(i, "s", False)))
            if parallel:
                pairs.append((site["attn"].register_forward_hook, grab(i, "a", False)))
            else:
                pairs.append((_before_patches(site.get("mlp_norm", site["mlp"])), grab(i, "m", True)))
        stripped = self.strip(inputs, torch.tensor(query if kept is None else kept), separate=kept is None)
        # each layer's output is read only where the next layer's input is not replaced: with a chunk
        # removed the other kept tokens need the whole layer, each query alone needs no MLP at all
        skip = _lone_pass(self.layers(model), self.family(model)) if kept is None else contextlib.nullcontext()
        with registered_hooks(pairs), skip:
            model.base_model(**stripped, use_cache=False)
        if parallel:  # m_0 = (the layer input) + (the lone token's attention output)
            for i, o in enumerate(out):
                o["m"] = (rec[i]["h"] if i > 0 else o.pop("h")) + o.pop("a")
        return [(o["m"], o.get("s", o["m"])) for o in out]  # no norm before the MLP: s = m

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
