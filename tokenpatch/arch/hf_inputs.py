"""The inputs of a Hugging Face causal LM as tokenpatch reads them: token ids, attention mask and
position ids checked and completed (``check_inputs``), the no-context inputs (``strip``), and the
position checks a patch's forward needs (``check_positions``, ``position_limit``), and the config
fields that do not change the forward (``CONFIG_IGNORED``, left out of a patch's config record).

``HFInputs`` is the middle of ``HFAdapter``: it adds these to the module map (``arch.hf_modules``);
``arch.hf`` adds the two passes.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import offload
from tokenpatch.arch.hf_modules import HFModules, text_config
from tokenpatch.arch.rotary import LengthScaling, length_scaling
from tokenpatch.errors import InputError
from tokenpatch.plans import refuse_padded_queries

__all__ = ["HFInputs", "CONFIG_IGNORED"]

# Hugging Face config fields that do not change a causal LM's forward, left out of a patch's config
# record (every other field counts, ``Adapter.config_ignored``): names and versions, the dtype (the
# weight fingerprint survives ``.double()``), the cache and output flags, the attention and experts
# implementations, the initialisation, labels and special token ids (read by tokenizers and
# generation, not the forward), and GPT-2's sequence-summary head (a double-heads model's, not the LM's).
CONFIG_IGNORED = (
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "attn_implementation",
    "_attn_implementation",
    "experts_implementation",
    "_experts_implementation",
    "initializer_range",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
)


class HFInputs(HFModules):
    """Inputs: token ids ``[batch, pos]``, or a mapping with ``input_ids`` and optionally
    ``attention_mask`` (what a tokenizer returns; padded batches) and ``position_ids``. Without
    position ids they are counted from the attention mask (``cumsum - 1``), so a left-padded row
    gets the positions it would have alone."""

    def check_positions(self, model: nn.Module, patch: Any, args: tuple, kwargs: dict) -> None:
        """Refuse a forward that leaves out ``position_ids`` (the model then counts them from 0 in each
        sequence) where the patch's plan needs others: with absolute positions (a ``Family.position_table``,
        GPT-2) any position but 0 of each sequence; with rotary ones, a kept sequence whose distances changed (a chunk
        removed before a kept token; a token alone, or a kept run shifted as a whole, is the same at
        any position). Given position ids are the caller's: with padding they are not the plan's
        positions, so they are not compared. A patch without a plan or static has no positions."""
        if "position_ids" not in inspect.signature(model.forward).parameters:
            return  # positions from the attention mask alone (Bloom's ALiBi): the patch's own pass ran so too
        if len(args) > 1:  # arguments by position: in the order of this model's own forward
            kwargs = {**inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments, **kwargs}
        # a cache's length starts the count: positions the adapter cannot see
        given = any(kwargs.get(k) is not None for k in ("position_ids", "cache", "past_key_values"))
        if patch.static:
            return
        if kwargs.get("position_ids") is not None and not any(
            kwargs.get(k) is not None for k in ("cache", "past_key_values")
        ):
            self._check_given_positions(model, patch, kwargs["position_ids"], kwargs.get("attention_mask"))
        if given:
            return
        for plan in patch.made_for():  # each row's plans (a stack or sum of patches of different plans)
            self._check_plan_positions(model, plan)

    def _check_given_positions(self, model: nn.Module, patch: Any, pos: Any, mask: Any) -> None:
        """Given position ids for a patch made with a chunk removed (rotary positions): in each row the
        kept tokens' ids (where ``mask`` is 1) must be the plan's kept positions ``p_j`` shifted as a
        whole, ``p_j - c`` (a left-padded row starts later), so the distances the patch was made for stay;
        compacted ids (``0, 1, ..`` after a removed chunk) change them. Where the rotation changes with
        the length (``arch.rotary``) a row without padding must keep ``p_j`` themselves (a shift moves
        the longest position). Learned absolute positions and queries alone: the caller's."""
        plans = patch.made_for()
        if len(plans) != 1 or plans[0].mode != "chunk" or self.family(model).position_table is not None:
            return
        kept = torch.tensor(plans[0].kept)
        if not isinstance(pos, Tensor) or pos.ndim != 2 or pos.shape[1] != len(kept):
            return  # not the kept sequence: the forward's own checks say
        shift = pos.detach().cpu().long() - kept  # [B, K]
        real = torch.ones_like(shift, dtype=torch.bool)
        if isinstance(mask, Tensor) and mask.shape == pos.shape:
            real = mask.detach().cpu() != 0
        scaling = self.length_scaling(model)
        for b in range(shift.shape[0]):
            row = shift[b][real[b]]
            if not row.numel():
                continue
            if bool((row != row[0]).any()):
                why = "they change the distances between its tokens"
            elif scaling is not None and bool(real[b].all()) and int(row[0]) != 0:
                why = f"shifted as a whole, with {scaling.describe()}"
            else:
                continue
            raise InputError(
                f"this patch was made for the kept positions {list(plans[0].kept)}, but row {b} runs at position "
                f"ids {pos[b].tolist()} ({why}): pass position_ids= as tp.strip_context gives them "
                "(**tp.strip_context(model, inputs))"
            )

    def _check_plan_positions(self, model: nn.Module, plan: Any) -> None:
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
        """The rows of the absolute position table (``Family.position_table``; ``None`` without one): an
        embedding (OPT's ids offset by 2 into it), a buffer of sinusoids (CTRL's), or a module keeping
        one (XGLM's, offset by 2: transformers grows it for a longer sequence, not for a lone token's id)."""
        name = self.family(model).position_table
        if name is None:
            return None
        owner, _, leaf = name.rpartition(".")
        table = getattr(model.base_model.get_submodule(owner), leaf)
        if isinstance(table, Tensor):
            return table.shape[0]
        rows = table.num_embeddings if hasattr(table, "num_embeddings") else table.weights.shape[0]
        return rows - getattr(table, "offset", 0)

    def length_scaling(self, model: nn.Module) -> LengthScaling | None:
        """``rope_parameters`` of type ``longrope`` or ``dynamic`` (``arch.rotary``), or ``None``."""
        return length_scaling(text_config(model))

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
        device = offload.device(model.get_input_embeddings())  # an offloaded table: where its hook runs it
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
            leaky = [m.kind for m in self.family(model).mixers if m.reads_pads]
            if mask is not None and leaky:
                raise InputError(
                    f"{type(model).__name__} reads padding: transformers does not mask the input of its "
                    f"{leaky[0]} layers, so a padded row's forward is not its prompt's; pass each prompt "
                    "without padding (one per call, or a batch of one length)"
                )
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
        size = self.position_limit(model)  # absolute positions (GPT-2's learned, CTRL's sinusoids) end somewhere
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

    def prefix_inputs(self, model: nn.Module, inputs: dict, query: int, prefixes: range, width: int) -> dict:
        """The rows of ``prefixes`` (``arch.prefixes``): per row of ``inputs`` and prefix ``i``, the tokens
        ``c_1..c_i`` and the query at position ``query``, right-aligned in ``width`` positions (padding: the
        query token, masked), ``[B * len(prefixes), width]`` batch-major, as ``check_inputs`` returns them."""
        if inputs["attention_mask"] is not None:
            raise InputError("tp.trajectory on a language model takes unpadded sequences (no attention mask)")
        ids = inputs["input_ids"]  # [B, T]
        rows = ids[:, query : query + 1, None].expand(ids.shape[0], len(prefixes), width).clone()  # [B, G, width]
        mask = torch.zeros_like(rows)
        for j, i in enumerate(prefixes):  # row j: c_1..c_i, then x, right-aligned
            rows[:, j, width - 1 - i : width - 1] = ids[:, :i]
            mask[:, j, width - 1 - i :] = 1
        return self.check_inputs(model, {"input_ids": rows.flatten(0, 1), "attention_mask": mask.flatten(0, 1)})

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
