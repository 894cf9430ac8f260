"""The output side of a layer's thought-patch fit (``engine.fit``), and the next layer's stream
written from its pass.

With the input change in place, ``dW h' (+ db) ~ t``: ``t = out_C - out_0``, what the layer still
misses, on the output matrix (and its bias, affine); a shared expert's output is scaled by
``sigmoid(gate)``, so ``t / sigmoid(gate)`` is fitted. A norm after the MLP (Gemma 2/3: ``out = m +
g * unit(W h')``) makes the output nonlinear in ``W``: there ``dW`` aims the norm's input ``p = W h'``
at the direction the norm must output, ``unit((out_C - m_0) / g) rms(p)`` (``arch.outputs.norm_target``), and the
norm's scale is then fitted per channel (``fit_norm``; ``docs/prompt-compression.md`` §2), after
Gauss-Newton steps on the norm's output itself if asked (``through_norm``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tokenpatch import offload
from tokenpatch.arch import OutputSite, weight_layout
from tokenpatch.arch.norms import norm_eps, scale_norm
from tokenpatch.errors import InputError
from tokenpatch.patch import Delta
from tokenpatch.run import hooked
from tokenpatch.thought.fit import cut_rank, solve_output, static_patch
from tokenpatch.thought.lstsq import factor
from tokenpatch.thought.through_norm import best_scale, refine


def fit_output(
    model: nn.Module,
    i: int,
    site: OutputSite,
    pairs_source,
    deltas: dict,
    output: str,
    ridge: float | str,
    distributed: bool,
    solver: str,
) -> dict:
    """``dW h' (+ db) ~ out_C - out_0`` on layer ``i``'s output matrix; adds to ``deltas``. The pairs are
    the output kind's own (``OutputSite.fit_pairs``: over a shared expert's gate, aimed through a norm
    after the MLP, ...), from ``pairs_source``'s ``(with-context, no-context, real positions)`` records."""
    if output == "vector" and not site.affine:  # only a bias site has a bias: the others fit a linear map
        raise InputError(
            f"layer {i}: {site.module} is an output matrix without a bias; a thought vector needs a bias to "
            "live in: use output='affine'"
        )
    pairs = site.fit_pairs(model, ((rc, r0, v) for rc, r0, v in pairs_source))
    bias = site.name if site.affine else None
    return solve_output(pairs, i, model, site.matrix, bias, output, deltas, ridge, distributed, solver)


STREAM_KEYS = ("m", "hidden", "gate", "sum", "p")  # what next_streams reads of the output side's pass


def next_streams(
    model: nn.Module, site: OutputSite, mine: dict[str, Delta], kept: list, sum_norm: str | None = None
) -> list[Tensor]:
    """Per batch, the layer's output under all of ``mine`` from the output side's pass, run under
    its input change only: the output deltas act after the MLP's hidden features ``h'`` (recorded),
    so only the output matrix (and the post-MLP norm) run again (``OutputSite.stream``).

    ``out = out_pass + g (W' h' - W h')`` (``g``: the shared expert's ``sigmoid(gate)``, else 1, times
    ``OutputSite.scale``), or
    with a norm after the MLP (Gemma 2/3) ``out = m + norm'(W' h')``, primes marking the patched
    module. The fit already assumes this form (``out = m + MLP output``). ``sum_norm`` (a norm after the
    MLP's add, ``Sites.sum_norm``): ``out = N(sum_pass + g (W' h' - W h'))``."""
    names = {f"{site.module}.weight", f"{site.module}.bias", *site.names}
    patch = static_patch({k: d for k, d in mine.items() if k in names}, {})
    norm = None if sum_norm is None else model.get_submodule(sum_norm)
    return [site.stream(model, rec, out, mine, lambda: hooked(model, patch, True, True), norm) for rec, out in kept]


def fit_norm(
    model: nn.Module,
    site: OutputSite,
    pairs: list,
    mine: dict[str, Delta],
    ridge: float,
    steps: int,
    rank: int | None,
    distributed: bool,
) -> dict:
    """The post-MLP norm's scale change ``dg`` into ``mine`` (``[1, 1, d]``), after ``steps`` Gauss-Newton
    steps on the output matrix's change (``through_norm.refine``, which replaces it in ``mine``, cut
    to ``rank``), all from the output side's recorded states ``pairs`` (no layer pass: ``p' = p +
    dW h'``). The scale: per channel ``c`` the least squares ``min sum_n ((g_c + dg_c) u_nc -
    y_nc)^2``, ``u = unit(p')``, ``y = out_C - m_0`` (channels no row reaches keep ``g_c``); with
    the directions met, it restores the magnitudes: exact for one query. Returns the diagnostics
    (``norm_error``: the relative output error at the closed form and after each step)."""
    down_name = site.name.rpartition(".")[0]
    down, key = model.get_submodule(down_name), f"{down_name}.weight"
    norm = model.get_submodule(site.norm.rpartition(".")[0])
    unit, offset = scale_norm(norm)
    g0 = (offset + offload.value(model, site.norm).detach()).double()  # [d]
    records = [(rc, r0, v) for rc, r0, v in pairs]
    h, p, y = (
        torch.cat(t).double() for t in zip(*((r0.hidden[v], r0.p[v], (rc.out - r0.m)[v]) for rc, r0, v in records))
    )
    out_in = weight_layout(down, key) == "out_in"

    def math_dw() -> Tensor:  # [d, d_hidden]  the output matrix's change in math layout
        dense = mine[key].dense()[0, 0].double() if key in mine else p.new_zeros(p.shape[1], h.shape[1])
        return dense if out_in else dense.T

    def scale_on(dw: Tensor) -> Tensor:
        u = unit(norm, p + h @ dw.T).double()  # [N, d]
        uy, uu = (u * y).sum(0), u.square().sum(0)
        if distributed:
            for t in (uy, uu):
                torch.distributed.all_reduce(t)
        return best_scale(uy, uu, g0)

    info: dict = {}
    if steps:  # (not distributed: thought_patch refuses that)
        dw, errors = refine(h, p, y, math_dw(), scale_on(math_dw()), g0, norm_eps(norm), ridge, steps)
        mine.update(cut_rank({key: factor(dw if out_in else dw.T).to(down.weight.dtype)}, rank))
        info = {"norm_steps": len(errors) - 1, "norm_error": errors}
    mine[site.norm] = (scale_on(math_dw()) - g0)[None, None].to(norm.weight.dtype)  # [1, 1, d]
    return info
