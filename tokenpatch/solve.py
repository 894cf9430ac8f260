"""Pure tensor math of token patches. No modules here: tensors in, factors out.

The derivations are in ``docs/patch-theorem.md`` and ``docs/deep-models.md``. Per query, with
and without the removed context:

    s_C, s_0   the MLP input (``s_0`` is the *anchor*)
    m_C, m_0   the value the MLP output is added to (residual stream), when there is a residual
    h_C        the input of the MLP's output matrix in the with-context pass

**Minimal patch**. For a matrix ``W`` reading ``s``, the patch must satisfy
``(W + dW) s_0 = W s_C``, i.e. ``dW s_0 = r`` with ``r = W (s_C - s_0)``. Every solution is

    dW = r s_0^T / |s_0|^2 + M (I - s_0 s_0^T / |s_0|^2)         (any M)

and the two terms are Frobenius-orthogonal, so the unique minimum-norm solution is the rank-1

    dW* = r s_0^T / |s_0|^2,      |dW*|_F = |r| / |s_0|,

which ``minimal_patch`` returns as factors ``(u, v) = (r, s_0 / |s_0|^2)``. It exists iff
``s_0 != 0`` or ``r = 0``; otherwise ``ZeroAnchorError``. "Minimal" is among the patches that
reproduce the MLP's pre-activation ``W s_C``; a smaller patch can reproduce the block's output
(with ReLU, rows dead in both passes need no change).

**Blocks**. After ``input_patch`` on every matrix that reads ``s`` the MLP's
hidden state is the with-context one, ``h_C``. A block with a residual adds the MLP output to
``m``, and ``m_0 != m_C``, so the output side needs ``dm = m_C - m_0`` too, absorbed either

* in the output bias: ``db = m_C - m_0`` (``output_shift``), or
* in the output matrix: ``dW_out = dm h_C^T / |h_C|^2`` (``output_patch``, rank 1).

The norm placements differ only in what ``s`` and ``m`` are (``block_values``): Pre-LN
``m = h + A(LN1(h))``, ``s = LN2(m)``; Post-LN ``s = m = LN1(h + A(h))``, the block output
``LN2(m + MLP(s))`` then has equal arguments in both passes; no norm ``s = m = h + A(h)``.
Residual-free blocks need no output term: ``MLP(s_0)`` with the input patch equals ``MLP(s_C)``.

**Deep models**: patch layers in order from one cached with-context pass; each
layer's anchor is the layer run on the with-context hidden state of the query alone, since the
patched earlier layers reproduce it exactly. ``patching.py`` implements it.

The math runs in at least float32 (float64 inputs stay float64), whatever the model dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tokenpatch.errors import InputError, ZeroAnchorError
from tokenpatch.lowrank import LowRank

__all__ = [
    "work_dtype",
    "block_values",
    "minimal_patch",
    "input_patch",
    "apply_weight",
    "output_shift",
    "output_patch",
    "output_patch_scaled",
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

    ``r [*lead, rows]``, ``anchor [*lead, cols]`` -> ``LowRank(u [*lead, 1, rows], v [*lead, 1, cols])``
    with ``u = r`` and ``v = anchor / |anchor|^2``. Rows where ``r = 0`` give a zero patch (even for a
    zero anchor); a zero anchor with ``r != 0`` raises ``ZeroAnchorError`` listing the offending
    leading indices. ``|anchor|^2`` is summed directly where that is accurate to rounding (finite, far
    above the subnormal range: one pass); else scaled by ``c = max_i |anchor_i|`` so that a tiny but
    nonzero anchor never underflows: ``v = (a / |a|^2) / c`` with ``a = anchor / c``.
    """
    if r.shape[:-1] != anchor.shape[:-1]:
        raise InputError(f"r {tuple(r.shape)} and anchor {tuple(anchor.shape)} must share leading dims")
    dtype = work_dtype(r, anchor)
    r, anchor = r.to(dtype), anchor.to(dtype)
    _check_finite(r=r)
    sq = torch.linalg.vecdot(anchor, anchor).unsqueeze(-1)  # [*lead, 1]  |anchor|^2
    # |anchor|^2 as summed is accurate to rounding when it is finite and far above the subnormal range
    # (each square lost below it is under finfo.tiny * eps): then v = anchor / |anchor|^2 directly
    info = torch.finfo(dtype)
    if bool(((sq >= anchor.shape[-1] * info.tiny / info.eps) & (sq <= info.max)).all()):
        return LowRank(r.unsqueeze(-2), (anchor * (1 / sq)).unsqueeze(-2))
    return LowRank(r.unsqueeze(-2), _scaled_inverse(r, anchor).unsqueeze(-2))


def _scaled_inverse(r: Tensor, anchor: Tensor) -> Tensor:
    """``anchor / |anchor|^2`` ``[*lead, cols]`` with ``|anchor|^2`` summed scaled by ``c = max_i |anchor_i|``
    (no underflow or overflow of the squares); zero where the anchor is zero, which ``r`` must be
    there too (else ``ZeroAnchorError``); ``InputError`` for an anchor not finite or too small for
    ``1 / |anchor|`` to exist in its dtype."""
    c = anchor.abs().amax(-1, keepdim=True)  # [*lead, 1]  c = max_i |anchor_i|
    _check_finite(anchor=c)
    zero = c == 0  # [*lead, 1]  exactly the zero vectors
    if zero.any():
        impossible = zero[..., 0] & (r != 0).any(-1)
        if impossible.any():
            index = [tuple(i) for i in impossible.nonzero().tolist()]
            raise ZeroAnchorError(
                f"the anchor vector is zero at leading index {index[:5]}{' ...' if len(index) > 5 else ''} "
                "while a nonzero change is needed: no weight patch can act on a zero input",
                index,
            )
        c = torch.where(zero, torch.ones_like(c), c)
    a = anchor / c  # [*lead, cols]  max |a_i| = 1 (0 where the anchor is 0)
    sq = torch.linalg.vecdot(a, a).unsqueeze(-1)  # [*lead, 1]  |a|^2 in [1, cols], or 0
    inv = 1 / (torch.where(zero, torch.ones_like(sq), sq) * c)  # [*lead, 1]  1 / (|a|^2 c) = c / |anchor|^2
    if not torch.isfinite(inv).all():
        small = float(c[~torch.isfinite(inv)].min())
        raise InputError(
            f"an anchor vector has max |entry| {small:.1e}: 1/|anchor| overflows {anchor.dtype}; "
            "compute in float64 (model.double())"
        )
    return a * inv  # anchor / |anchor|^2


def apply_weight(weight: Tensor, x: Tensor, layout: str = "out_in") -> Tensor:
    """``W x`` for every row of ``x [*lead, cols]`` -> ``[*lead, rows]``, in ``x``'s dtype.

    ``weight`` as stored: ``[rows, cols]`` (``"out_in"``, ``nn.Linear``) or ``[cols, rows]``
    (``"in_out"``, GPT-2's ``Conv1D``). A weight of a narrower dtype is cast a block of at most
    ``_BLOCK`` entries at a time, never copied whole.
    """
    w = weight if layout == "out_in" else weight.T  # [rows, cols], a view
    if w.dtype == x.dtype:
        return x @ w.T
    step = max(1, _BLOCK // w.shape[1])
    return torch.cat([x @ w[i : i + step].to(x.dtype).T for i in range(0, w.shape[0], step)], -1)


_BLOCK = 1 << 20  # entries of a weight cast at once by apply_weight


def input_patch(weight: Tensor, s_ctx: Tensor, s_anchor: Tensor, layout: str = "out_in") -> LowRank:
    """Rank-1 patch of a matrix ``W`` reading ``s`` such that ``(W + dW) s_anchor = W s_ctx``:
    ``dW = W (s_ctx - s_anchor) s_anchor^T / |s_anchor|^2`` (``docs/patch-theorem.md``).

    ``weight`` as stored (``layout`` as in ``apply_weight``); ``s_ctx, s_anchor [*lead, cols]`` ->
    factors ``[*lead, 1, rows]``, ``[*lead, 1, cols]`` of the math ``[rows, cols]`` matrix.
    """
    dtype = work_dtype(weight, s_ctx, s_anchor)
    cols = weight.shape[-1] if layout == "out_in" else weight.shape[0]
    if s_ctx.shape != s_anchor.shape or s_ctx.shape[-1] != cols:
        raise InputError(
            f"weight {tuple(weight.shape)} ({layout}) cannot read s_ctx {tuple(s_ctx.shape)} / "
            f"s_anchor {tuple(s_anchor.shape)}"
        )
    diff = s_ctx.to(dtype) - s_anchor.to(dtype)  # [*lead, cols]
    r = apply_weight(weight, diff, layout)  # [*lead, rows]  W (s_C - s_0)
    return minimal_patch(r, s_anchor)


def output_shift(m_ctx: Tensor, m_anchor: Tensor, scale: float = 1.0) -> Tensor:
    """Output-bias term of a residual block: ``db = (m_C - m_0) / scale`` ``[*lead, d]`` (``scale``: a
    constant the block multiplies the MLP output by, Granite's ``residual_multiplier``)."""
    dtype = work_dtype(m_ctx, m_anchor)
    db = m_ctx.to(dtype) - m_anchor.to(dtype)
    if isinstance(scale, Tensor):  # a factor per channel [d] (ZAYA's learned residual scaling)
        db = db / scale.to(db)
    elif scale != 1.0:
        db = db / scale
    _check_finite(output_shift=db)
    return db


def output_patch(m_ctx: Tensor, m_anchor: Tensor, hidden_ctx: Tensor) -> LowRank:
    """Output-matrix form of the residual term: ``dW_out = (m_C - m_0) h_C^T / |h_C|^2``, rank 1,
    for MLPs without an output bias. ``[*lead, d]``, ``[*lead, hidden]`` -> factors."""
    return minimal_patch(output_shift(m_ctx, m_anchor), hidden_ctx)


def output_patch_scaled(
    out_ctx: Tensor, m_ctx: Tensor, m_anchor: Tensor, down_ctx: Tensor, hidden_ctx: Tensor, scale: Tensor, eps: float
) -> tuple[LowRank, Tensor]:
    """Output side of a block whose MLP output passes a post-norm ``N(y) = scale * y / rms(y)``,
    ``rms(y) = sqrt(mean(y^2) + eps)`` (Gemma 2/3: ``scale = 1 + w``), before the residual add.

    The patched no-context layer must output ``out_C``, i.e. the norm must produce
    ``t = out_C - m_0``. Choose the down-projection output ``m' = t / scale`` (per channel), patch the
    down matrix to produce it from ``h_C`` (rank 1: ``(m' - W h_C) h_C^T / |h_C|^2``), and rescale the
    norm: ``scale' = scale * rms(m')``. Then ``N'(m') = scale * rms(m') * (t / scale) / rms(m') = t``.
    The down matrix alone cannot do it: ``|N(y) / scale|_rms < 1`` for every ``y``.

    Channels where ``scale`` is exactly 0 (Gemma 3 270M has nine) output 0 whatever ``m'`` is, so
    ``t / scale`` is undefined there: keep ``m'_j = (W h_C)_j`` (or ``t_j`` if that is 0) and give the
    channel its own scale ``t_j rms(m') / m'_j`` (0 where ``t_j = 0``: left unchanged).

    A query whose residual value is the same with and without the context (``m_C = m_0``, e.g. no
    context before it) needs no change: both deltas are exactly 0 there.

    Two other choices of ``m'`` are exact in exact arithmetic and fail in float32 on Gemma 3 270M
    (per-layer errors 1e1-1e2, measured): ``m' = W h_C`` with the scale alone doing the work divides
    by near-zero channels of ``W h_C`` and multiplies their rounding; the multiple of ``t / scale`` of
    the size of ``W h_C`` leaves channels where ``|m'_j| << |(W h_C)_j|``, and the patched layer's sum
    ``W h_C + (m' - W h_C)`` cancels there.

    ``out_ctx, m_ctx, m_anchor, down_ctx [*lead, d]``, ``hidden_ctx [*lead, hidden]``, ``scale [d]``
    -> ``(down-matrix factors, dense scale delta [*lead, d])``.
    """
    dtype = work_dtype(out_ctx, m_anchor, down_ctx, hidden_ctx, scale)
    t = out_ctx.to(dtype) - m_anchor.to(dtype)  # [*lead, d]  what the norm must output
    f, scale = down_ctx.to(dtype), scale.to(dtype)  # [*lead, d], [d]
    live = scale != 0  # [d]
    off = (~live).nonzero()[:, 0]  # the zero-scale channels (few: handled apart, without full-width passes)
    m_new = t / torch.where(live, scale, 1)  # [*lead, d]
    if off.numel():
        f_off = f[..., off]
        m_new[..., off] = torch.where(f_off != 0, f_off, t[..., off])
    same = (m_ctx == m_anchor).all(-1, keepdim=True)  # [*lead, 1]  nothing to change
    if same.any():
        m_new = torch.where(same, f, m_new)
    rms = (torch.linalg.vecdot(m_new, m_new).unsqueeze(-1) / m_new.shape[-1] + eps).sqrt()  # [*lead, 1]
    new_scale = scale * rms  # [*lead, d]
    if off.numel():  # a zero-scale channel gets its own scale t_j rms / m'_j (0 where m'_j = 0: unchanged)
        m_off = m_new[..., off]
        ok = m_off != 0
        new_scale[..., off] = torch.where(ok, t[..., off] * rms / torch.where(ok, m_off, 1), scale[off])
    if same.any():
        new_scale = torch.where(same, scale, new_scale)
    _check_finite(scale_patch=new_scale)
    return minimal_patch(m_new - f, hidden_ctx), new_scale - scale


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
