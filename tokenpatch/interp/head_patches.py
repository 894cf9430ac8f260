"""Head-resolved token patches: how much of each layer's implicit weight update each head carries.

A layer's token patch (``docs/deep-models.md``) changes what its MLP reads at the query,
``s_0 -> s_C``; on every matrix ``W`` reading it the patch is ``W D`` with the rank-1

    D = ds s_0^T / |s_0|^2,        ds = s_C - s_0,        |D|_F = |ds| / |s_0|.

At the query the layer input ``h`` is the same with and without context, so the MLP input is a
function ``s = F(z)`` of the attention's output-projection input ``z = [z_1 .. z_H]`` alone::

    ours (Pre-LN)   F(z) = LN2(h + W_O z + b_O)                 (norm-free: h + W_O z + b_O)
    Llama, Qwen     F(z) = RMSNorm(h + W_O z)
    Gemma 2 / 3     F(z) = RMSNorm_ff(h + RMSNorm_attn(W_O z))
    GPT-2           F(z) = LN_2(h + W_O z + b_O)

``z_C`` is the heads' output with context, ``z_0`` the query alone (each head's value: a lone key
has weight 1), and ``dz = z_C - z_0 = sum_h P_h dz`` with ``P_h`` keeping head ``h``'s slice.

**The exact split** is the straight-path integral (Aumann-Shapley, "integrated gradients")::

    ds = F(z_C) - F(z_0) = sum_h ds_h,     ds_h = int_0^1 J_F(z_0 + t dz) P_h dz dt,

exact for any ``F`` by the fundamental theorem of calculus (the parts sum to ``ds``). The integral
is a Gauss-Legendre sum; ``F`` is analytic along the path, so its error falls geometrically with the
nodes: on the small LM's longest paths 16 nodes leave ``closure = |sum_h ds_h - ds| / |ds|`` at up to
7e-10, the default 32 at rounding (at most 3e-12; it is reported). Where no norm sits between (a
norm-free block) ``F`` is affine and ``ds_h = W_O P_h dz`` for any nodes: the linear split of the
context vector ``dA = W_O dz``. The common **first-order split**, ``J_F(z_0) P_h dz`` (the norm
linearised at the anchor), does not sum to ``ds``; its miss ``linear_error`` is reported beside it.

``F`` and the output projections come from the model's adapter (``Adapter.mlp_input_from_heads``,
``Adapter.output_projections``); the states from its two passes, ``trace`` and ``anchors``, as
``token_patch`` runs them (a lone query's attention output through the output projection's hooks).

Per layer, query and head: ``share_h = <ds_h, ds> / |ds|^2`` (sums to 1 over heads; a head working
against the others has a negative share) and ``norm_h = |ds_h| / |s_0| = |D_h|_F``, the Frobenius
norm of that head's part of the patch. Computed in float64 on copies of the few weights ``F``
needs, whatever the model's dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from tokenpatch.arch import adapter_for, norms
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.errors import InputError
from tokenpatch.interp.ablation import active_modes, head_sites
from tokenpatch.plans import make_plan
from tokenpatch.progress import progress_bar

__all__ = ["HeadPatches", "head_patches", "split_by_heads", "pooled_share"]

NODES = 32


def __getattr__(name: str):
    """``RMS_OFFSETS``, re-exported here before the norm table moved to ``arch`` (kept one release)."""
    if name == "RMS_OFFSETS":
        warnings.warn(
            "tokenpatch.interp.head_patches.RMS_OFFSETS is deprecated; the norms are in tokenpatch.arch.norms.NORMS",
            DeprecationWarning,
            stacklevel=2,
        )
        return norms.RMS_OFFSETS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class HeadPatches:
    """Per layer ``l``, sequence ``b``, query ``q`` and head ``h`` (module docstring)."""

    share: Tensor  # [L, B, Q, H]  <ds_h, ds> / |ds|^2
    norm: Tensor  # [L, B, Q, H]  |ds_h| / |s_0|
    patch_norm: Tensor  # [L, B, Q]   |ds| / |s_0| = |D|_F
    closure: Tensor  # [L, B, Q]      |sum_h ds_h - ds| / |ds|   (the exact split's quadrature error)
    linear_error: Tensor  # [L, B, Q] |sum_h J_F(z_0) P_h dz - ds| / |ds|   (the first-order split's miss)
    delta: Tensor  # [L, B, Q, d]  ds itself (float64): token_patch's input change, W ds on our fc_in
    query: list[int]


def pooled_share(hp: HeadPatches) -> Tensor:
    """``[L, H]``: each head's share of its layer's patches over all sequences and queries,
    ``sum_{b,q} <D_h, D>_F / sum_{b,q} |D|_F^2`` with ``<D_h, D>_F = <ds_h, ds> / |s_0|^2``: the
    patches pooled as matrices, each weighted by its size (sums to 1 per layer)."""
    sq = hp.patch_norm.square()  # [L, B, Q]  |ds|^2 / |s_0|^2
    return (hp.share * sq[..., None]).sum((1, 2)) / sq.sum((1, 2))[..., None].clamp_min(1e-300)


def _nodes(n: int) -> tuple[Tensor, Tensor]:
    t, w = np.polynomial.legendre.leggauss(n)  # on [-1, 1]
    return torch.from_numpy((t + 1) / 2), torch.from_numpy(w / 2)  # on [0, 1]


def split_by_heads(
    f: Callable[[Tensor], Tensor], z0: Tensor, zc: Tensor, n_heads: int, nodes: int = NODES
) -> tuple[Tensor, Tensor]:
    """``(exact [N, H, d], first_order [N, H, d])``: each head's part of ``f(zc) - f(z0)``.

    ``f`` maps rows ``[..., H * dh] -> [..., d]``; ``z0, zc [N, H * dh]``. ``exact[:, h] =
    sum_k w_k J_f(z0 + t_k dz) P_h dz`` (Gauss-Legendre on [0, 1]), ``first_order[:, h] = J_f(z0) P_h dz``."""
    if z0.shape != zc.shape or z0.shape[-1] % n_heads:
        raise InputError(f"z0 {tuple(z0.shape)} and zc {tuple(zc.shape)} must match and split into {n_heads} heads")
    t, w = _nodes(nodes)
    t, w = t.to(z0), w.to(z0)
    dz = zc - z0  # [N, H*dh]
    path = z0 + t[:, None, None] * dz  # [K, N, H*dh]
    start = torch.cat([z0[None], path])  # [1 + K, N, H*dh]: the anchor, then the nodes
    dh = z0.shape[-1] // n_heads
    exact, first = [], []
    for h in range(n_heads):
        v = torch.zeros_like(dz)
        v[:, h * dh : (h + 1) * dh] = dz[:, h * dh : (h + 1) * dh]  # P_h dz
        with warnings.catch_warnings():  # torch scripts its forward-AD decompositions on first use (its own warning)
            warnings.simplefilter("ignore", DeprecationWarning)
            _, jv = torch.func.jvp(f, (start,), (v.expand_as(start),))  # [1 + K, N, d]
        first.append(jv[0])
        exact.append((w[:, None, None] * jv[1:]).sum(0))
    return torch.stack(exact, 1), torch.stack(first, 1)  # [N, H, d] each


# --------------------------------------------------------------------------- recording z
def _grab(modules: list[nn.Module], store: dict):
    """Pre-hooks recording module ``i``'s input as ``store[i]`` while the block runs (removed on exit)."""
    return registered_hooks(
        (m.register_forward_pre_hook, lambda mod, args, i=i: store.__setitem__(i, args[0].detach()))
        for i, m in enumerate(modules)
    )


def _states(model, adapter, inputs, query: list[int], o_projs: list[nn.Module]):
    """Per layer ``(h, z_C, z_0)`` at the queries ``[B, Q, .]``: the with-context pass and the lone-query pass
    of ``token_patch`` (``adapter.trace`` / ``adapter.anchors``), with the output projections' inputs recorded."""
    zc, z0 = {}, {}
    with _grab(o_projs, zc), torch.no_grad():
        rec = adapter.trace(model, inputs, query)
    with _grab(o_projs, z0), torch.no_grad():
        adapter.anchors(model, inputs, query, rec)
    batch, q = adapter.batch_size(inputs), torch.tensor(query)
    return [(rec[i].h, zc[i][:, q.to(zc[i].device)], z0[i].reshape(batch, len(query), -1)) for i in range(len(o_projs))]


@torch.no_grad()
def head_patches(model: nn.Module, inputs, query=-1, nodes: int = NODES, progress: bool | None = None) -> HeadPatches:
    """Each head's part of every layer's token patch at ``query`` (module docstring), all context removed.

    ``inputs``: as ``token_patch`` (our models' ``[B, T, d_in]``, token ids ``[B, T]`` or a dict for
    Hugging Face models); ``query``: an int, a list, a slice or ``"all"``. Inside ``ablate_heads`` the
    lone-query pass runs through the same hooks as the full pass: a zero- or mean-ablated head is
    ablated in both, so it carries nothing. Resampling works by position, which the lone pass does
    not keep, so it is refused. Where a layer's patch is zero (``ds = 0``, e.g. the first position)
    every share is 0."""
    if "resample" in active_modes(model):
        raise InputError(
            "head_patches inside a resample ablation: the lone-query pass cannot be aligned with the "
            "reference by position; ablate with mode='zero' or 'mean'"
        )
    adapter = adapter_for(model)
    adapter.require(
        "check_inputs",
        "seq_len",
        "sites",
        "n_heads",
        "output_projections",
        "mlp_input_from_heads",
        "trace",
        "anchors",
        "batch_size",
        by="tp.interp.head_patches",
    )
    inputs = adapter.check_inputs(model, inputs)
    plan = make_plan(adapter.seq_len(inputs), query)
    q = list(plan.query)
    adapter.sites(model, 0)  # an attention-only model has no patch to split
    modules, n_heads = head_sites(model)
    states = _states(model, adapter, inputs, q, modules)
    rows = {k: [] for k in ("share", "norm", "patch_norm", "closure", "linear_error", "delta")}
    for i in progress_bar(range(len(states)), progress, desc="head patches", unit="layer"):
        h, zc, z0 = (t.double() for t in states[i])  # [B, Q, .]
        lead = h.shape[:2]
        n = lead.numel()
        f = adapter.mlp_input_from_heads(model, i, h.reshape(n, -1))  # F(z) at each query's own h  [N, d]
        zc, z0 = zc.reshape(n, -1), z0.reshape(n, -1)
        s_c, s_0 = f(zc), f(z0)  # [N, d]
        ds = s_c - s_0
        exact, first = split_by_heads(f, z0, zc, n_heads, nodes)  # [N, H, d]
        ds_sq = ds.square().sum(-1)  # [N]
        safe = ds_sq.clamp_min(1e-300)
        s0n = s_0.norm(dim=-1)  # [N]
        rows["share"].append(((exact * ds[:, None]).sum(-1) / safe[:, None]).reshape(*lead, n_heads))
        rows["norm"].append((exact.norm(dim=-1) / s0n[:, None]).reshape(*lead, n_heads))
        rows["patch_norm"].append((ds.norm(dim=-1) / s0n).reshape(lead))
        rows["closure"].append(((exact.sum(1) - ds).norm(dim=-1) / safe.sqrt()).reshape(lead))
        rows["linear_error"].append(((first.sum(1) - ds).norm(dim=-1) / safe.sqrt()).reshape(lead))
        rows["delta"].append(ds.reshape(*lead, -1))
    return HeadPatches(**{k: torch.stack(v) for k, v in rows.items()}, query=q)
