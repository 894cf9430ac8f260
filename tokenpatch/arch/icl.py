"""Adapter for our own models: ``ICLTransformer`` and a bare ``Block``.

A bare ``Block`` is a one-layer model whose inputs are already hidden states ``[B, T, d_model]``
and whose output is the block output: ``token_patch(block, h)`` patches the paper's contextual
block ``T_W`` directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from tokenpatch.arch import layered
from tokenpatch.arch.base import Adapter
from tokenpatch.arch.float64 import linear64, norm64
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.arch.outputs import BiasOutput, MatrixOutput
from tokenpatch.arch.record import LayerRecord, NamedSite
from tokenpatch.arch.recording import recording as record_sites
from tokenpatch.arch.sites import Sites
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.models.icl import Block, ICLTransformer, check_inputs
from tokenpatch.models.layers import LinearAttention, SoftmaxAttention
from tokenpatch.solve import block_values


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

    def layers(self, model) -> list[Block]:
        return self._blocks(model)

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
            raise UnsupportedModelError(
                f"layer {i} has no MLP (an attention-only model): a token patch acts on MLP "
                "weights, so there is nothing to patch; use a model with mlp=True"
            )
        if not block.residual:
            output = None
        elif block.mlp.fc_out.bias is not None:
            output = BiasOutput(f"{p}mlp.fc_out.bias")
        else:
            output = MatrixOutput(f"{p}mlp.fc_out.weight")
        sum_norm = f"{p}ln2" if block.norm == "post" else None  # out = LN2(m + MLP(s))
        return Sites(inputs=(f"{p}mlp.fc_in.weight",), output=output, sum_norm=sum_norm)

    # ------------------------------------------------------------------------- the passes
    def _sites(self, block: Block) -> list[NamedSite]:
        """Block ``block``'s table of named sites (``arch.recording``): where its pass computes each
        ``LayerRecord`` field (``m``: what the MLP output is added to; ``s``: the MLP input; ``sum``: what a
        norm after the MLP's add reads; ``v``: the attention's values, which give a token alone's output)."""
        if block.norm == "pre":  # m = h + A(LN1(h)), s = LN2(m)
            m = NamedSite("m", "ln2", output=False)
        elif block.norm == "post":  # m = LN1(h + A(h)), s = m, out = LN2(m + MLP(s))
            m = NamedSite("m", "ln1", output=True)
        else:  # m = h + A(h), s = m
            m = NamedSite("m", "mlp.fc_in", output=False)
        sites = [
            NamedSite("h", "", output=False),
            m,
            NamedSite("s", "mlp.fc_in", output=False),
            NamedSite("hidden", "mlp.fc_out", output=False),
            NamedSite("out", "", output=True),
        ]
        if block.norm == "post":
            sites.append(NamedSite("sum", "ln2", output=False))
        if isinstance(block.mixer, (SoftmaxAttention, LinearAttention)):  # alone: out(v), from the values
            sites.append(NamedSite("v", "mixer.v", output=True))
        return sites

    def recording(self, model, query: Tensor, every: bool = False, on_layer: Callable | None = None):
        """Hooks recording, per block, its named sites (``_sites``) at positions ``query`` ``[B, Q, .]``
        during any forward inside the block (``Adapter.recording``, ``arch.recording``)."""
        return record_sites([(block, self._sites(block)) for block in self._blocks(model)], query, every, on_layer)

    def trace(self, model, inputs: Tensor, query: list[int], on_layer: Callable | None = None) -> list[LayerRecord]:
        """The with-context pass: the model's own forward, recorded at the queries (``Adapter.trace``)."""
        if self.layer_by_layer():  # a subclass written for mix and finish (deprecated)
            return layered.trace(self, model, inputs, query, on_layer)
        at = torch.tensor(query, device=inputs.device)
        every = query == list(range(inputs.shape[1]))
        with self.recording(model, at, every, on_layer) as rec, torch.no_grad():
            model(inputs)
        return rec

    def alone_anchor(self, model) -> Callable | None:
        """``(i, r) -> (m_0, s_0)``: each query alone at block ``i`` from its with-context record. A token
        alone is one step of its mixer on itself: attention's ``out(v)`` from the recorded values (one key,
        weight exactly 1), a recurrent layer's step from the zero state; then the block's own ``combine``."""
        if self.layer_by_layer():  # a subclass written for mix and finish (deprecated): anchors() runs them
            return None
        blocks = self._blocks(model)

        def anchor(i: int, r: LayerRecord) -> tuple[Tensor, Tensor]:
            block = blocks[i]
            if r.v is not None:
                a = block.mixer.out(r.v)  # [B, Q, d]
            else:
                x = block.mixer_input(r.h)  # [B, Q, d]
                a = block.mixer.alone(x.reshape(-1, x.shape[-1])).reshape(x.shape)
            return block.combine(r.h, a)

        return anchor

    def anchors(self, model, inputs: Tensor, query: list[int], rec: list[LayerRecord], kept: list[int] | None = None):
        """The no-context pass (``Adapter.anchors``): each query alone from the record (``alone_anchor``),
        or the kept positions as one sequence, each block's input at the queries replaced by its
        with-context state (the patched blocks below reproduce it), ``(m_0, s_0)`` recorded there."""
        if self.layer_by_layer():  # a subclass written for mix and finish (deprecated)
            return layered.anchors(self, model, inputs, query, rec, kept)
        if kept is None:
            anchor = self.alone_anchor(model)
            return [anchor(i, r) for i, r in enumerate(rec)]
        at = torch.tensor([kept.index(q) for q in query], device=inputs.device)  # the queries in the kept sequence

        def swap(i):
            def hook(module, args):
                return (args[0].index_copy(1, at, rec[i].h.to(args[0].dtype)),)

            return hook

        blocks = self._blocks(model)
        pairs = [(block.register_forward_pre_hook, swap(i)) for i, block in enumerate(blocks) if i > 0]
        with registered_hooks(pairs), self.recording(model, at) as out, torch.no_grad():
            model(inputs[:, kept])
        return [(r.m, r.s) for r in out]

    def prompted(self, model, prompt: Tensor, keys: tuple[str, ...]) -> Callable[[Tensor], list[LayerRecord]]:
        """Calibration queries read after ``prompt [1, P, d_in]`` (``Adapter.prompted``). The prompt runs once;
        its mixer inputs at every block are kept (by causality the same whatever follows) and each query
        batch runs alone, every mixer given them as its context: one-token queries as virtual rows
        (``prefix_queries``: attention reads the prompt's keys and values, a recurrent layer steps once
        from its state after the prompt), longer ones after the prompt's rows, ``O(b P)`` per layer for a
        token, not ``O(b P^2)``. Embeddings are position-free: a query's input is its own embedding."""
        prompt = self.check_inputs(model, prompt)
        blocks, seen = self._blocks(model), []
        pairs = [(b.mixer.register_forward_pre_hook, lambda m, args: seen.append(args[0])) for b in blocks]
        with registered_hooks(pairs), torch.no_grad():
            model(prompt)
        context = list(seen)  # [1, P, d]  each block's mixer input over the prompt

        def after_prompt(i: int) -> Callable:
            def hook(mixer, args, out):
                x, p = args[0], context[i].shape[1]  # [b, T_q, d]
                if x.shape[1] == 1:  # [1, b, d]: the queries as rows after the whole prompt
                    lengths = torch.full((x.shape[0],), p, dtype=torch.long)
                    return mixer.prefix_queries(context[i], x.transpose(0, 1), lengths).transpose(0, 1)
                return mixer.forward(torch.cat([context[i].expand(x.shape[0], -1, -1), x], 1))[:, p:]  # not hooked

            return hook

        def run(q: Tensor) -> list[LayerRecord]:
            q = self.check_inputs(model, q)
            at = torch.arange(q.shape[1], device=q.device)
            replaced = [(b.mixer.register_forward_hook, after_prompt(i)) for i, b in enumerate(blocks)]
            with self.recording(model, at, every=True) as rec, registered_hooks(replaced), torch.no_grad():
                model(q)
            return [r.only(keys) for r in rec]

        return run

    def layer_calls(self, model, inputs: Tensor) -> tuple[Tensor, list[tuple[tuple, dict]]]:
        """The first block's input for ``inputs`` and each block's other arguments (none)."""
        inputs = self.check_inputs(model, inputs)
        return self.embed(model, inputs), [((), {}) for _ in self._blocks(model)]

    def run(self, model, inputs: Tensor) -> tuple[Tensor, list[Tensor]]:
        if isinstance(model, ICLTransformer):
            return model(inputs, return_hidden=True)
        return model(inputs), []  # a bare block: its output is the model output

    # ------------------------------------------------------------------------- heads and attention
    def n_heads(self, model) -> int:
        return self._attention(model)[0].n_heads

    def output_projections(self, model) -> list[nn.Module]:
        return [mixer.out for mixer in self._attention(model)]

    def mlp_input_from_heads(self, model, i: int, h: Tensor) -> Callable[[Tensor], Tensor]:
        """``F(z) = s`` of block ``i``, from float64 copies of its output matrix and norms (no hooks)."""
        block = self._blocks(model)[i]
        out = linear64(block.mixer.out)
        ln1, ln2 = (norm64(block.ln1, "ln1"), norm64(block.ln2, "ln2")) if block.norm != "none" else (None, None)
        return lambda z: block_values(block.norm, block.residual, h, out(z), ln1, ln2)[1]

    def attention_patterns(self, model, inputs: Tensor) -> list[Tensor]:
        """From the softmax attention layers' own ``pattern`` (an ``InputError`` for other layers)."""
        blocks = self._blocks(model)
        for i, b in enumerate(blocks):
            if not hasattr(b.mixer, "pattern"):
                raise InputError(f"layer {i} is {b.mixer.kind} attention; probes need softmax attention")
        seen: list[Tensor] = []
        with (
            registered_hooks(
                (b.mixer.register_forward_pre_hook, lambda m, args: seen.append(m.pattern(args[0]))) for b in blocks
            ),
            torch.no_grad(),
        ):
            model(inputs)
        return seen

    def _attention(self, model) -> list[nn.Module]:
        """Every layer's attention (softmax or linear: heads with values and an output matrix)."""
        mixers = [b.mixer for b in self._blocks(model)]
        if not all(hasattr(m, "v") and hasattr(m, "out") for m in mixers):
            raise UnsupportedModelError(
                f"the heads need attention layers (softmax or linear): this model's layers are {model.config.layer!r}"
            )
        return mixers

    def describe(self, model) -> dict:
        return {**super().describe(model), "config": model.config.to_dict()}
