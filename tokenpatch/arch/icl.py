"""Adapter for our own models: ``ICLTransformer`` and a bare ``Block``.

A bare ``Block`` is a one-layer model whose inputs are already hidden states ``[B, T, d_model]``
and whose output is the block output: ``token_patch(block, h)`` patches the paper's contextual
block ``T_W`` directly.
"""

from __future__ import annotations

from torch import Tensor, nn

from tokenpatch.errors import UnsupportedModelError
from tokenpatch.models.icl import Block, ICLTransformer, check_inputs
from tokenpatch.arch.base import Adapter, Sites


class ICLAdapter(Adapter):
    name = "icl"
    position_dependent_embedding = False  # read_in is applied token by token; no positions

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, (ICLTransformer, Block))

    @staticmethod
    def _blocks(model) -> list[Block]:
        return list(model.blocks) if isinstance(model, ICLTransformer) else [model]

    @staticmethod
    def _prefix(model, i: int) -> str:
        return f"blocks.{i}." if isinstance(model, ICLTransformer) else ""

    def n_layers(self, model) -> int:
        return len(self._blocks(model))

    def check_inputs(self, model, inputs: Tensor) -> Tensor:
        return check_inputs(model, inputs)

    def seq_len(self, inputs: Tensor) -> int:
        return inputs.shape[1]

    def batch_size(self, inputs: Tensor) -> int:
        return inputs.shape[0]

    def strip(self, inputs: Tensor, positions: Tensor, separate: bool) -> Tensor:
        kept = inputs[:, positions]  # [B, K, d]
        return kept.reshape(-1, 1, kept.shape[-1]) if separate else kept

    def embed(self, model, inputs: Tensor) -> Tensor:
        return model.read_in(inputs) if isinstance(model, ICLTransformer) else inputs

    def mix(self, model, i: int, h: Tensor) -> tuple[Tensor, Tensor]:
        return self._blocks(model)[i].mix(h)

    def mix_with_alone(self, model, i: int, h: Tensor, positions: list[int]):
        block = self._blocks(model)[i]
        if not hasattr(block.mixer, "with_alone"):  # recurrent layers: nothing to share
            return super().mix_with_alone(model, i, h, positions)
        a, a0 = block.mixer.with_alone(block.mixer_input(h), positions)  # [B, T, d], [B, P, d]
        return block.combine(h, a), block.combine(h[:, positions], a0)

    def mix_prefixes(self, model, i: int, h: Tensor, hq: Tensor, lengths: Tensor, with_alone: bool = False):
        block = self._blocks(model)[i]
        out = block.mixer.prefix_queries(block.mixer_input(h), block.mixer_input(hq), lengths, with_alone)
        return (block.combine(hq, out[0]), block.combine(hq, out[1])) if with_alone else block.combine(hq, out)

    def finish(self, model, i: int, m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        return self._blocks(model)[i].finish(m, s)

    def sites(self, model, i: int) -> Sites:
        block, p = self._blocks(model)[i], self._prefix(model, i)
        if block.mlp is None:
            raise UnsupportedModelError(f"layer {i} has no MLP (an attention-only model): a token patch acts on MLP "
                                        "weights, so there is nothing to patch; use a model with mlp=True")
        if not block.residual:
            output = None
        elif block.mlp.fc_out.bias is not None:
            output = ("bias", f"{p}mlp.fc_out.bias")
        else:
            output = ("matrix", f"{p}mlp.fc_out.weight")
        return Sites(inputs=(f"{p}mlp.fc_in.weight",), output=output)

    def run(self, model, inputs: Tensor) -> tuple[Tensor, list[Tensor]]:
        if isinstance(model, ICLTransformer):
            return model(inputs, return_hidden=True)
        return model(inputs), []  # a bare block: its output is the model output

    def describe(self, model) -> dict:
        return {**super().describe(model), "config": model.config.to_dict()}
