"""Activation steering on a Hugging Face language model: vectors added to (or written over) what a
decoder layer or its attention puts into the residual stream, and per-head edits of the attention
output (the input of ``o_proj``, the heads side by side). The injection half of every baseline in
``docs/prompt-compression.md``; every edit is a context manager whose hooks are removed on exit,
errors included, so the model is left exactly as it was (no weight is ever written).

Sites, per decoder layer ``l`` of a sequential block ``x -> m = x + A(x) -> y = m + F(m)``:

* ``"residual"``: the layer's output ``y`` (the residual stream after layer ``l``);
* ``"attention"``: the attention's contribution ``A(x)`` (after Gemma's post-attention norm), so
  a shift there also reaches the MLP's input;
* ``"mlp"``: the MLP's contribution ``F(m)`` (after Gemma's post-MLP norm);
* heads: ``o_proj``'s input ``z = [z_1 .. z_H]``, ``A(x) = W_O z (+ b)``, head ``h``'s slice ``z_h``.

``position="last"``: only the last position of the sequence run (a prompt's answer position when
the prompt is left-padded); ``"all"``: every position, generated tokens included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from tokenpatch.arch import adapter_for
from tokenpatch.arch.hooks import output_tensor, registered_hooks
from tokenpatch.errors import InputError

SITES = ("residual", "attention", "mlp")


def site_modules(model: nn.Module, site: str) -> list[nn.Module]:
    """Per decoder layer, the module whose output is ``site`` (``"residual"``: ``Adapter.layers``;
    ``"attention"``: ``Adapter.attention_outputs``; ``"mlp"``: ``Adapter.mlp_outputs``)."""
    if site not in SITES:
        raise InputError(f"site must be one of {SITES}, got {site!r}")
    adapter = adapter_for(model)
    method = {"residual": "layers", "attention": "attention_outputs", "mlp": "mlp_outputs"}[site]
    adapter.require("layers", "attention_outputs", "mlp_outputs", by="the steering baselines (tp.baselines)")
    return list(getattr(adapter, method)(model))


def stream_of(t: Tensor, batch: Tensor | tuple[int, int]) -> Tensor:
    """A site's output as ``[B, T, d]``: a module run on the flattened tokens ``[B * T, d]`` (OPT's MLP)
    is viewed with the ``[B, T]`` of the sequences run (``batch``: their token ids, or that shape)."""
    if t.ndim != 2:
        return t
    return t.view(*(batch.shape[:2] if isinstance(batch, Tensor) else batch), t.shape[-1])


def o_proj_modules(model: nn.Module) -> list[nn.Module]:
    """Per decoder layer, the attention's output matrix (its input: the heads' outputs side by side;
    ``Adapter.output_projections``)."""
    return adapter_for(model).output_projections(model)


def n_heads(model: nn.Module) -> int:
    """Attention heads per layer (``Adapter.n_heads``)."""
    return adapter_for(model).n_heads(model)


@dataclass
class Steering:
    """Vectors ``[d]`` per layer, added to (``mode="add"``) or written over (``"replace"``) the
    output of ``site`` at ``position``, or (``"rotate"``, every position: the in-context vector's
    injection) turning the output ``x`` towards ``v`` with its norm kept:

        x' = |x| unit(unit(x) + (1 + max(0, cos(x, -v))) v)        (unit(a) = a / |a|, |v| the strength)

    ``meta``: how they were extracted (JSON-able)."""

    site: Literal["residual", "attention", "mlp"]
    vectors: dict[int, Tensor]
    mode: Literal["add", "replace", "rotate"] = "add"
    position: Literal["last", "all"] = "all"
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        modes = ("add", "replace", "rotate")
        if (
            self.site not in SITES
            or self.mode not in modes
            or self.position not in ("last", "all")
            or (self.mode == "rotate" and self.position != "all")
        ):
            raise InputError(
                f"Steering(site={self.site!r}, mode={self.mode!r}, position={self.position!r}): site is one "
                f"of {SITES}, mode one of {modes}, position 'last' or 'all' ('all' for 'rotate')"
            )
        if any(not isinstance(v, Tensor) or v.ndim != 1 for v in self.vectors.values()):
            raise InputError("Steering vectors must be 1-d tensors [d], one per layer")

    def only(self, layer: int) -> Steering:
        """The same steering at one layer (a task or function vector at its chosen layer)."""
        if layer not in self.vectors:
            raise InputError(f"no vector at layer {layer}; layers: {sorted(self.vectors)}")
        return Steering(
            self.site, {layer: self.vectors[layer]}, self.mode, self.position, {**self.meta, "layer": layer}
        )

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.vectors.values())


@contextlib.contextmanager
def steer(model: nn.Module, steering: Steering | None, where: Tensor | None = None) -> Iterator[nn.Module]:
    """Run ``model`` with ``steering`` in every forward inside the block (``None``: no change).
    ``where`` ``[B, T]`` (bool): with ``position="all"``, the positions of the batch run that are
    steered (e.g. not the leading BOS, not padding); ``None``: all of them."""
    if steering is None:
        yield model
        return
    modules = site_modules(model, steering.site)
    bad = [i for i in steering.vectors if not 0 <= i < len(modules)]
    if bad:
        raise InputError(f"steering layers {bad} are not in [0, {len(modules)})")

    shape: list[int] = []  # [B, T] of the sequences each forward runs (a flattened site's output needs it)

    def note(module, args, kwargs):
        shape[:] = (args[0] if args else kwargs["hidden_states"]).shape[:2]

    def hook_for(vector: Tensor):
        def hook(module, args, out):
            flat = output_tensor(out)
            t = stream_of(flat, tuple(shape))
            if vector.shape[-1] != t.shape[-1]:
                raise InputError(f"a steering vector has {vector.shape[-1]} features, the stream {t.shape[-1]}")
            v = vector.to(t.device, t.dtype)
            if steering.position == "all":
                if steering.mode == "rotate":
                    new = _rotated(t, v).to(t.dtype)
                else:
                    new = t + v if steering.mode == "add" else v.expand_as(t).clone()
                if where is not None:
                    if where.shape != t.shape[:2]:
                        raise InputError(
                            f"steer: where has shape {tuple(where.shape)}, the batch run {tuple(t.shape[:2])}"
                        )
                    new = torch.where(where.to(t.device)[..., None], new, t)
            else:
                new = t.clone()
                new[:, -1] = t[:, -1] + v if steering.mode == "add" else v
            new = new.reshape(flat.shape)
            return new if isinstance(out, Tensor) else (new, *out[1:])

        return hook

    first = adapter_for(model).layers(model)[0]  # its input [B, T, d] gives the shape
    pairs = [(lambda h: first.register_forward_pre_hook(h, with_kwargs=True), note)]
    pairs += [(modules[i].register_forward_hook, hook_for(v)) for i, v in steering.vectors.items()]
    with registered_hooks(pairs):
        yield model


def _rotated(x: Tensor, v: Tensor) -> Tensor:
    """``|x| unit(unit(x) + (1 + max(0, cos(x, -v))) v)`` (``Steering``'s ``"rotate"``), in float32 at least."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    x, v = x.to(dtype), v.to(dtype)
    norm = x.norm(dim=-1, keepdim=True)
    boost = 1 + torch.nn.functional.cosine_similarity(x, -v.expand_as(x), dim=-1).clamp_min(0)[..., None]
    return torch.nn.functional.normalize(torch.nn.functional.normalize(x, dim=-1) + boost * v, dim=-1) * norm


@contextlib.contextmanager
def heads_set(model: nn.Module, values: dict[tuple[int, int], Tensor]) -> Iterator[nn.Module]:
    """Run ``model`` with head ``h`` of layer ``l`` writing ``values[(l, h)]`` (``[head_dim]``, or
    ``[B, head_dim]`` per sequence) at the last position, in place of its own output."""
    o_projs, heads = o_proj_modules(model), n_heads(model)
    by_layer: dict[int, dict[int, Tensor]] = {}
    for (layer, head), v in values.items():
        if not (0 <= layer < len(o_projs) and 0 <= head < heads):
            raise InputError(f"head ({layer}, {head}) is not in the model ({len(o_projs)} layers x {heads} heads)")
        by_layer.setdefault(layer, {})[head] = v

    def hook_for(edits: dict[int, Tensor]):
        def hook(module, args):
            z = args[0].clone()  # [B, T, H * dh]
            dh = z.shape[-1] // heads
            for h, v in edits.items():
                z[:, -1, h * dh : (h + 1) * dh] = v.to(z.device, z.dtype)
            return (z, *args[1:])

        return hook

    with registered_hooks((o_projs[layer].register_forward_pre_hook, hook_for(e)) for layer, e in by_layer.items()):
        yield model


@contextlib.contextmanager
def recording_heads(model: nn.Module) -> Iterator[list[Tensor]]:
    """Record every layer's heads at the last position: the list holds ``[B, H, head_dim]`` per
    layer on exit."""
    o_projs, heads = o_proj_modules(model), n_heads(model)
    rec: list[Any] = [None] * len(o_projs)

    def hook_for(i: int):
        def hook(module, args):
            z = args[0][:, -1]  # [B, H * dh]
            rec[i] = z.reshape(z.shape[0], heads, -1).detach()

        return hook

    with registered_hooks((m.register_forward_pre_hook, hook_for(i)) for i, m in enumerate(o_projs)):
        yield rec


def head_contribution(model: nn.Module, layer: int, head: int, z: Tensor) -> Tensor:
    """What head ``head`` of ``layer`` writing ``z [head_dim]`` adds to the residual stream through
    ``o_proj``: ``W_O[:, h] z_h`` (the bias, shared by all heads, is not part of it)."""
    o_proj, heads = o_proj_modules(model)[layer], n_heads(model)
    width = _in_features(o_proj)
    dh = width // heads
    full = z.new_zeros(2, width)
    full[0, head * dh : (head + 1) * dh] = z
    with torch.no_grad():
        out = o_proj(full.to(_weight(o_proj).dtype))
    return (out[0] - out[1]).detach()  # [d]


def _weight(module: nn.Module) -> Tensor:
    return next(p for n, p in module.named_parameters() if n.endswith("weight"))


def _in_features(module: nn.Module) -> int:
    if hasattr(module, "in_features"):
        return int(module.in_features)
    return int(_weight(module).shape[0])  # GPT-2's Conv1D keeps its weight as [in, out]
