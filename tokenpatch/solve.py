"""Pure tensor math of token patches. No modules here: tensors in, factors out.

References are to ``science/token_patches.md``. Per query, with and without the removed context:

    s_C, s_0   the MLP input (``s_0`` is the *anchor*)
    m_C, m_0   the value the MLP output is added to (residual stream), when there is a residual
    h_C        the input of the MLP's output matrix in the with-context pass

**Minimal patch** (sections 2.1-2.2). For a matrix ``W`` reading ``s``, the patch must satisfy
``(W + dW) s_0 = W s_C``, i.e. ``dW s_0 = r`` with ``r = W (s_C - s_0)``. Every solution is

    dW = r s_0^T / |s_0|^2 + M (I - s_0 s_0^T / |s_0|^2)         (any M)

and the two terms are Frobenius-orthogonal, so the unique minimum-norm solution is the rank-1

    dW* = r s_0^T / |s_0|^2,      |dW*|_F = |r| / |s_0|,

which ``minimal_patch`` returns as factors ``(u, v) = (r, s_0 / |s_0|^2)``. It exists iff
``s_0 != 0`` or ``r = 0``; otherwise ``ZeroAnchorError``.

**Blocks** (sections 2.2, 3). After ``input_patch`` on every matrix that reads ``s`` the MLP's
hidden state is the with-context one, ``h_C``. A block with a residual adds the MLP output to
``m``, and ``m_0 != m_C``, so the output side needs ``dm = m_C - m_0`` too, absorbed either

* in the output bias: ``db = m_C - m_0`` (``output_shift``), or
* in the output matrix: ``dW_out = dm h_C^T / |h_C|^2`` (``output_patch``, rank 1).

The norm placements differ only in what ``s`` and ``m`` are (``block_values``): Pre-LN
``m = h + A(LN1(h))``, ``s = LN2(m)``; Post-LN ``s = m = LN1(h + A(h))``, the block output
``LN2(m + MLP(s))`` then has equal arguments in both passes; no norm ``s = m = h + A(h)``.
Residual-free blocks need no output term: ``MLP(s_0)`` with the input patch equals ``MLP(s_C)``.

**Deep models** (section 4.3): patch layers in order from one cached with-context pass; each
layer's anchor is the layer run on the with-context hidden state of the query alone, since the
patched earlier layers reproduce it exactly. ``patching.py`` implements it.

The math runs in at least float32 (float64 inputs stay float64), whatever the model dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .delta import LowRank
from .errors import InputError, ZeroAnchorError

__all__ = [
    "work_dtype",
    "block_values",
    "minimal_patch",
    "input_patch",
    "output_shift",
    "output_patch",
    "patch_family",
]


def work_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the math runs in: the widest input dtype, at least float32."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def block_values(norm: str, residual: bool, h: Tensor, a: Tensor, ln1=None, ln2=None) -> tuple[Tensor, Tensor]:
    """``(m, s)`` of a block from its input ``h`` and its contextual layer's output ``a``
    (``[..., d]`` each, position by position); ``ln1`` / ``ln2`` are the block's norms::

        norm   residual  m                 s
        none   on        h + a             m
        none   off       a                 m
        pre    on        h + a             LN2(m)      (a = A(LN1(h)))
        pre    off       a                 LN2(m)
        post   on        LN1(h + a)        m           (output LN2(m + MLP(s)))
        post   off       LN1(a)            m           (output LN2(MLP(s)))

    The patch of every form is ``input_patch`` on ``s`` plus, with a residual, ``output_shift``
    (or ``output_patch``) on ``m``.
    """
    m = h + a if residual else a
    if norm == "post":
        m = ln1(m)
    return m, (ln2(m) if norm == "pre" else m)


def _check_finite(**tensors: Tensor) -> None:
    for name, t in tensors.items():  # one cheap reduction first: any NaN/inf makes the sum non-finite
        if not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
            raise InputError(f"{name} contains NaN or inf")


def minimal_patch(r: Tensor, anchor: Tensor) -> LowRank:
    """``dW* = r anchor^T / |anchor|^2``, the minimum-Frobenius-norm ``dW`` with ``dW anchor = r``.

    ``r [*lead, rows]``, ``anchor [*lead, cols]`` -> ``LowRank(u [*lead, 1, rows], v [*lead, 1, cols])``.
    Rows where ``r = 0`` give a zero patch (even for a zero anchor); a zero anchor with ``r != 0``
    raises ``ZeroAnchorError`` listing the offending leading indices.
    """
    if r.shape[:-1] != anchor.shape[:-1]:
        raise InputError(f"r {tuple(r.shape)} and anchor {tuple(anchor.shape)} must share leading dims")
    dtype = work_dtype(r, anchor)
    r, anchor = r.to(dtype), anchor.to(dtype)
    sq = (anchor * anchor).sum(-1, keepdim=True)  # [*lead, 1]  |anchor|^2
    _check_finite(r=r, anchor=sq)
    zero = sq[..., 0] == 0  # [*lead]
    impossible = zero & (r != 0).any(-1) if zero.any() else zero
    if impossible.any():
        index = [tuple(i) for i in impossible.nonzero().tolist()]
        raise ZeroAnchorError(
            f"the anchor vector is zero at leading index {index[:5]}{' ...' if len(index) > 5 else ''} "
            "while a nonzero change is needed: no weight patch can act on a zero input",
            index,
        )
    v = anchor / torch.where(sq == 0, torch.ones_like(sq), sq)  # [*lead, cols]; 0 where anchor = 0
    return LowRank(r.unsqueeze(-2), v.unsqueeze(-2))


def input_patch(weight: Tensor, s_ctx: Tensor, s_anchor: Tensor) -> LowRank:
    """Rank-1 patch of a matrix ``weight [rows, cols]`` (applied as ``weight @ s``) such that
    ``(W + dW) s_anchor = W s_ctx``: ``dW = W (s_ctx - s_anchor) s_anchor^T / |s_anchor|^2``.

    ``s_ctx, s_anchor [*lead, cols]`` -> factors ``[*lead, 1, rows]``, ``[*lead, 1, cols]``.
    """
    dtype = work_dtype(weight, s_ctx, s_anchor)
    if s_ctx.shape != s_anchor.shape or s_ctx.shape[-1] != weight.shape[-1]:
        raise InputError(f"weight {tuple(weight.shape)} cannot read s_ctx {tuple(s_ctx.shape)} / s_anchor {tuple(s_anchor.shape)}")
    diff = s_ctx.to(dtype) - s_anchor.to(dtype)  # [*lead, cols]
    r = diff @ weight.to(dtype).T  # [*lead, rows]  W (s_C - s_0)
    return minimal_patch(r, s_anchor)


def output_shift(m_ctx: Tensor, m_anchor: Tensor) -> Tensor:
    """Output-bias term of a residual block: ``db = m_C - m_0`` ``[*lead, d]``."""
    dtype = work_dtype(m_ctx, m_anchor)
    db = m_ctx.to(dtype) - m_anchor.to(dtype)
    _check_finite(output_shift=db)
    return db


def output_patch(m_ctx: Tensor, m_anchor: Tensor, hidden_ctx: Tensor) -> LowRank:
    """Output-matrix form of the residual term: ``dW_out = (m_C - m_0) h_C^T / |h_C|^2``, rank 1,
    for MLPs without an output bias. ``[*lead, d]``, ``[*lead, hidden]`` -> factors."""
    return minimal_patch(output_shift(m_ctx, m_anchor), hidden_ctx)


def patch_family(r: Tensor, anchor: Tensor, m: Tensor) -> Tensor:
    """Every solution of ``dW anchor = r``: ``r a^T/|a|^2 + M (I - a a^T/|a|^2)`` (dense).

    ``r [rows]``, ``anchor [cols]``, ``m [rows, cols]`` (arbitrary) -> ``[rows, cols]``. Its
    Frobenius norm is ``sqrt(|r|^2/|a|^2 + |M (I - P)|_F^2)``, minimal exactly when
    ``M (I - P) = 0``: the basis of the minimal-norm property test.
    """
    dtype = work_dtype(r, anchor, m)
    r, a, m = r.to(dtype), anchor.to(dtype), m.to(dtype)
    sq = a @ a
    proj = torch.outer(a, a) / sq  # [cols, cols]
    return torch.outer(r, a) / sq + m @ (torch.eye(a.shape[0], dtype=dtype, device=a.device) - proj)
