"""Recording a model's named sites during its own forward: the one recording loop of every adapter.

A layer is described by its table of named sites (``NamedSite``: which ``LayerRecord`` field is the
input or the output of which module under it; our blocks: ``ICLAdapter``, a Hugging Face design:
``Family.sites``). ``recording`` registers one hook per site, reads the field at the positions asked
for during any forward inside the block, and gives one ``LayerRecord`` per layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import Tensor, nn

from tokenpatch.arch.experts import experts_call, scattered_hiddens
from tokenpatch.arch.hooks import output_tensor, registered_hooks
from tokenpatch.arch.record import LayerRecord, NamedSite

__all__ = ["recording", "register", "read"]


def register(module: nn.Module, site: NamedSite) -> Callable:
    """How a hook on ``site`` is registered on ``module``: a forward hook on its output, or a pre-hook
    (with the keyword arguments) on its input, ahead of any registered earlier where ``site.first``:
    on the MLP, which reads ``m`` itself where no norm comes first, before a patch's input change, so
    ``m`` and ``s`` are recorded as the layer computes them, unchanged, as a norm's hooks would see them."""
    if site.output:
        return module.register_forward_hook
    return functools.partial(module.register_forward_pre_hook, prepend=site.first, with_kwargs=True)


def read(site: NamedSite, args: tuple, third: Any) -> Tensor:
    """The tensor at ``site`` from a hook's arguments: ``third`` is the module's output (a forward
    hook) or its keyword arguments (a pre-hook, whose input may come as ``hidden_states``)."""
    if site.output:
        return output_tensor(third)
    return args[0] if args else third["hidden_states"]


@contextlib.contextmanager
def recording(
    layers: Sequence[tuple[nn.Module, Sequence[NamedSite]]],
    query: Tensor,
    every: bool = False,
    on_layer: Callable | None = None,
) -> Iterator[list[LayerRecord]]:
    """Hooks recording, during any forward inside the block, each layer's named sites (``layers``: per
    layer its module and its sites) at positions ``query`` of the sequences run, ``[B, Q, .]``
    (``every``: the query is every position in order, kept without a copy; a site read ``every`` is
    kept whole until its layer finishes), as one ``LayerRecord`` per layer, filled on exit.
    ``on_layer(i, record)``: called as each layer finishes, with its record, which is then dropped (its
    entry in the list stays empty); the hooks pause while it runs (it may call the layer's modules)."""
    rec = [LayerRecord() for _ in layers]
    shape: list[int] = []  # [batch, pos] of the sequences running (set by each [B, T, .] tensor read)
    paused: list[bool] = []  # non-empty while on_layer runs
    # (layer, field) -> {adds: tensor}: the fields a site adds a term to, their terms as last recorded
    summed: dict[tuple[int, str], dict[bool, Tensor]] = {
        (i, site.field): {} for i, (_, sites) in enumerate(layers) for site in sites if site.adds
    }

    def take(t: Tensor, everywhere: bool) -> Tensor:
        if t.ndim == 2:  # a module run on the flattened tokens [batch * pos, .] (inside an MoE block)
            t = t.view(*shape, -1)
        else:
            shape[:] = t.shape[:2]
        return t if everywhere else t[:, query.to(t.device)]

    def grab(i: int, site: NamedSite) -> Callable:
        def hook(module, args, third):
            if paused:
                return
            if site.experts:  # experts(x [B*T, d], index [B*T, K], weights [B*T, K]), or a block routing itself
                x, index, weights = (take(t, every) for t in experts_call(module, args))
                z = scattered_hiddens(module, x.flatten(0, 1), index.flatten(0, 1), weights.flatten(0, 1))
                t = z.view(*x.shape[:2], -1)  # [B, Q, E * I]
            else:
                t = take(read(site, args, third), every or site.every)
            t = rec[i].h + t if site.plus_h else t
            if (i, site.field) in summed:  # the field is the sum of its sites' latest tensors (NamedSite.adds)
                terms = summed[i, site.field]
                terms[site.adds] = t
                t = terms[False] + terms[True] if len(terms) == 2 else t
            setattr(rec[i], site.field, t)

        return hook

    def complete(i: int) -> None:  # the sites recorded at every position, at the queries
        if not every:
            for site in layers[i][1]:
                t = getattr(rec[i], site.field)
                if site.every and t is not None:
                    setattr(rec[i], site.field, t[:, query.to(t.device)])

    def finished(i: int) -> Callable:
        def hook(module, args, out):
            complete(i)
            paused.append(True)
            try:
                on_layer(i, rec[i])
            finally:
                paused.clear()
            rec[i] = LayerRecord()

        return hook

    pairs = []
    for i, (layer, sites) in enumerate(layers):
        pairs += [(register(layer.get_submodule(site.module), site), grab(i, site)) for site in sites]
        if on_layer is not None:  # after the "out" site: hooks run in the order registered
            pairs.append((layer.register_forward_hook, finished(i)))
    with registered_hooks(pairs):
        yield rec
    for i in range(len(rec)):
        complete(i)
