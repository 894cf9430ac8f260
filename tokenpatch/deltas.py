"""Deltas: the one protocol over the two kinds of change a patch holds.

A delta is a batch of changes of one parameter (or of one module's input), batched over leading dims:

* dense, a ``Tensor [*lead, *shape]`` (a bias, a norm scale; or any matrix, as ``finetuned`` runs them);
* low-rank, a ``LowRank`` (``lowrank.py``): ``delta[i] = sum_k outer(u[i, k], v[i, k]) = U_i^T V_i``,
  factors ``u [*lead, r, rows]``, ``v [*lead, r, cols]``, the matrix never formed unless asked.

Every function here takes either kind and gives the same numbers for both (``dense(d)`` of a
``LowRank`` is its ``Tensor``): ``a + b`` (low-rank: the terms stack, ``[U; X]^T [V; Y]``), ``scale``
(``c U^T V`` as ``(c U)^T V``), ``apply`` (``delta x`` as ``U^T (V x)``), ``norm``, ``cosine``,
``nbytes``, ``index``, ``cat``, ``sum_over`` (low-rank: the summed dim's terms join the rank dim),
``zeros``, ``map_tensors`` (dtype/device moves). The type test lives here and in ``LowRank``'s own
methods only (``tests/test_house.py``); a caller that needs to tell the kinds apart asks
``kind`` / ``is_lowrank``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank, as_parameter, matrix_shape, norm_of

__all__ = [
    "Delta",
    "KINDS",
    "kind",
    "is_lowrank",
    "from_tensors",
    "tensors",
    "lead",
    "shape",
    "signature",
    "describe",
    "map_tensors",
    "index",
    "dense",
    "norm",
    "nbytes",
    "add",
    "scale",
    "apply",
    "sum_over",
    "cat",
    "zeros",
    "zeroed_at",
    "as_weight",
    "shape_for",
    "cosine",
]

Delta = LowRank | Tensor
KINDS = ("dense", "lowrank")  # the names ``kind`` gives (and patch files record)


def kind(d: Delta) -> str:
    """``"lowrank"`` for a ``LowRank``, ``"dense"`` for a ``Tensor``; anything else is an ``InputError``."""
    if isinstance(d, LowRank):
        return "lowrank"
    if isinstance(d, Tensor):
        return "dense"
    raise InputError(f"a patch delta is a torch.Tensor or a tokenpatch.LowRank, got {type(d).__name__}")


def is_lowrank(d: Delta) -> bool:
    return kind(d) == "lowrank"


def from_tensors(name: str, parts: Sequence[Tensor]) -> Delta:
    """The delta of kind ``name`` from its ``tensors``: ``(u, v)`` or ``(d,)``."""
    return LowRank(*parts) if name == "lowrank" else parts[0]


def tensors(d: Delta) -> tuple[Tensor, ...]:
    """What a delta is stored as: ``(u, v)`` for a ``LowRank``, ``(d,)`` for a dense one."""
    return (d.u, d.v) if is_lowrank(d) else (d,)


def lead(d: Delta, dims: int = 2) -> tuple[int, ...]:
    """The batch dims: a ``LowRank``'s ``lead``; a dense delta's first ``dims``."""
    return d.lead if is_lowrank(d) else tuple(d.shape[:dims])


def shape(d: Delta, dims: int = 2) -> tuple[int, ...]:
    """The shape of one change: ``(rows, cols)`` of a ``LowRank``, a dense delta's dims after ``dims``."""
    return d.shape if is_lowrank(d) else tuple(d.shape[dims:])


def signature(d: Delta, dims: int = 2) -> tuple:
    """What deltas joined along a batch dim must share: ``(rank, shape)``, or the dense shape."""
    return (d.rank, d.shape) if is_lowrank(d) else tuple(d.shape[dims:])


def describe(d: Delta, dims: int = 2) -> str:
    """``LowRank(rank=r, rows x cols)`` or ``dense(shape)``, for messages and ``repr``."""
    return f"LowRank(rank={d.rank}, {d.shape[0]}x{d.shape[1]})" if is_lowrank(d) else f"dense{tuple(d.shape[dims:])}"


def map_tensors(d: Delta, fn: Callable[[Tensor], Tensor]) -> Delta:
    """``fn`` on every stored tensor (each factor, or the dense one): ``lambda t: t.double()``, ``.to(device)``."""
    return LowRank(fn(d.u), fn(d.v)) if is_lowrank(d) else fn(d)


def index(d: Delta, key) -> Delta:
    """``d[key]`` over the leading dims (a ``LowRank``'s factors indexed alike)."""
    return d.index(key) if is_lowrank(d) else d[key]


def dense(d: Delta) -> Tensor:
    """The materialised delta ``[*lead, *shape]`` (``U^T V`` of a ``LowRank``)."""
    return d.dense() if is_lowrank(d) else d


def norm(d: Delta) -> Tensor:
    """Frobenius norm over the change dims -> ``lead`` (``lowrank.norm_of``: from the factors, rescaled)."""
    return norm_of(d)


def nbytes(d: Delta) -> int:
    """Bytes stored: the factors' (``r (rows + cols)`` per matrix), or the dense tensor's."""
    return sum(t.numel() * t.element_size() for t in tensors(d))


def add(a: Delta, b: Delta) -> Delta:
    """``a + b`` (broadcast over the leading dims): low-rank terms stack, the rank adds up."""
    if kind(a) != kind(b):
        raise InputError(f"cannot add a {kind(a)} delta to a {kind(b)} one")
    return a + b


def scale(d: Delta, c) -> Delta:
    """``c * d`` (``c`` a number or a tensor broadcasting over the factor ``u``): ``(c U)^T V``."""
    return LowRank(c * d.u, d.v) if is_lowrank(d) else c * d


def apply(d: Delta, x: Tensor, layout: str = "out_in") -> Tensor:
    """``delta x`` for inputs ``x [*lead, K, in]`` -> ``[*lead, K, out]``, the delta cast to ``x``.

    ``layout`` is the matrix's stored one: ``"out_in"`` (``nn.Linear``: ``y = x W^T``) or ``"in_out"``
    (``y = x W``). Low-rank ``W = U^T V``: ``x V^T U`` (out_in) or ``x U^T V`` (in_out), ``r`` numbers per
    position and never the matrix."""
    if is_lowrank(d):
        first, second = (d.v, d.u) if layout == "out_in" else (d.u, d.v)
        return (x @ first.to(x).transpose(-1, -2)) @ second.to(x)
    return x @ (d.transpose(-1, -2) if layout == "out_in" else d).to(x)


def sum_over(d: Delta, dim: int) -> Delta:
    """Sum over leading dim ``dim``, kept with size 1 (low-rank: its terms join the rank dim)."""
    return d.sum(dim) if is_lowrank(d) else d.sum(dim, keepdim=True)


def cat(parts: Sequence[Delta], dim: int) -> Delta:
    """Deltas of one kind and signature joined along leading dim ``dim``."""
    if len({kind(p) for p in parts}) > 1:
        raise InputError(f"cannot join deltas of kinds {[kind(p) for p in parts]}")
    if is_lowrank(parts[0]):
        return LowRank(torch.cat([p.u for p in parts], dim), torch.cat([p.v for p in parts], dim))
    return torch.cat(list(parts), dim)


def zeros(d: Delta) -> Delta:
    """An exact zero of ``d``'s kind, shapes, dtype and device."""
    return map_tensors(d, torch.zeros_like)


def zeroed_at(d: Delta, key) -> Delta:
    """``d`` with the changes at leading index ``key`` set to exactly zero (low-rank: their ``u``)."""
    if is_lowrank(d):
        u = d.u.clone()
        u[key] = 0
        return LowRank(u, d.v)
    d = d.clone()
    d[key] = 0
    return d


def as_weight(d: Delta, param_shape: tuple[int, ...]) -> Tensor:
    """The dense delta ``[*lead, *param_shape]`` laid out as its parameter (stacked experts' one matrix
    ``[out, E * in]`` back to ``[E, out, in]``, ``lowrank.as_parameter``)."""
    return as_parameter(d.dense(), param_shape) if is_lowrank(d) else d


def shape_for(d: Delta, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The ``shape`` a delta of ``d``'s kind has for a parameter of ``param_shape``: the matrix it is
    patched as (``lowrank.matrix_shape``) for a low-rank one, the parameter's own for a dense one.
    Stacked matrices have two storage layouts (``[E, out, in]``, ``[E, in, out]``), told apart by the
    delta's own shape (``lowrank.as_parameter``): the one it matches, else the first."""
    if not is_lowrank(d):
        return tuple(param_shape)
    shapes = [matrix_shape(tuple(param_shape), layout) for layout in ("out_in", "in_out")]
    return next((s for s in shapes if s == d.shape), shapes[0])


def cosine(a: Delta, b: Delta) -> Tensor:
    """Normalised Frobenius inner product ``<A, B>_F / (|A|_F |B|_F)`` of two batches of matrices,
    each a ``LowRank`` or a dense ``[*lead, rows, cols]`` tensor, in one layout -> ``[*lead]`` (0 where
    either is zero). A ``LowRank`` against a dense ``D`` reads ``<U^T V, D>_F = sum_k u_k^T D v_k``
    from the factors, never forming the low-rank matrix: how the token patch is set beside a
    fine-tuning update (``tp.finetune``)."""
    if not is_lowrank(a) and is_lowrank(b):
        a, b = b, a
    if is_lowrank(a) and is_lowrank(b):
        dt = a.dtype
        inner, na, nb = a.inner(b), a.norm(), b.norm()
    elif is_lowrank(a):
        if tuple(b.shape[-2:]) != a.shape:
            raise InputError(f"cannot compare a {a.shape} low-rank matrix with dense {tuple(b.shape[-2:])} ones")
        dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float64)
        u, v = a.u.to(dt), a.v.to(dt)
        # D v_k in D's own dtype (one pass over the dense matrix, never copied wider), the rest in float64
        dv = (b @ a.v.to(b.dtype).transpose(-1, -2)).to(dt)  # [*lead, rows, k]
        inner = (u * dv.transpose(-1, -2)).sum((-1, -2))  # sum_k u_k^T D v_k
        na, nb = LowRank(u, v).norm(), b.flatten(-2).norm(dim=-1).to(dt)
    else:
        if a.shape[-2:] != b.shape[-2:]:
            raise InputError(f"cannot compare {tuple(a.shape[-2:])} and {tuple(b.shape[-2:])} matrices")
        dt = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float64)
        a, b = a.to(dt).flatten(-2), b.to(dt).flatten(-2)
        inner, na, nb = (a * b).sum(-1), a.norm(dim=-1), b.norm(dim=-1)
    den = na * nb
    return torch.where(den > 0, inner / den.clamp_min(torch.finfo(dt).tiny), torch.zeros_like(inner))
