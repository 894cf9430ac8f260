"""What the thought-patch fits share (``docs/thought-patches.md``): their result types, the rank cut,
the calibration batches, and the output side's least squares.

The fits themselves: ``icl.py`` (our own models) and ``hf.py`` (Hugging Face language models);
``front.py`` holds ``thought_patch``, which picks one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch import files
from tokenpatch.arch import weight_layout
from tokenpatch.errors import InputError
from tokenpatch.patch import Delta, LowRank, Patch
from tokenpatch.thought.lstsq import accumulate, factor, residual, solve

__all__ = [
    "LayerFit",
    "ThoughtPatch",
    "cut_rank",
    "ridge_setting",
    "calibration_batches",
    "provenance",
    "solve_output",
    "static_patch",
]


@dataclass(frozen=True)
class LayerFit:
    """Fit diagnostics of one layer (``None`` where a side was not fitted):

    * ``n``: calibration positions;
    * per side, the relative training residual ``|fit - target|_F / |target|_F`` (input side: of
      ``D s_0 ~ s_C - s_0``, in the MLP-input space). With ``solver="normal"`` it is read from the
      sums, so an exact fit reads as about ``sqrt(eps * condition)``, not 0; with ``"qr"`` it is
      exact. ``evaluate_thought_patch`` on the calibration inputs measures the fit itself;
    * per side, the rank and condition number of the normal equations and the ``lambda`` used
      (``input_ridge``, ``output_ridge``: ``ridge`` itself, or what ``ridge="gcv"`` chose there);
    * through a post-MLP norm with ``norm_steps``: the Gauss-Newton steps taken and ``norm_error``,
      the relative error of the norm's output ``|g' unit(p') - y|_F / |y|_F`` at the closed form and
      after each step.
    """

    layer: int
    n: int
    input_residual: float | None = None
    input_rank: int | None = None
    input_condition: float | None = None
    output_residual: float | None = None
    output_rank: int | None = None
    output_condition: float | None = None
    ridge: float | str = 0.0
    input_ridge: float | None = None
    output_ridge: float | None = None
    norm_steps: int | None = None
    norm_error: list[float] | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ThoughtPatch:
    """``patch``: the static patch (lead ``[1, 1]``, acts everywhere, ``patch.static``: it runs on
    any no-prompt inputs, ``tp.functional_call(model, patch, x)`` or ``with tp.apply(model, patch)``);
    ``fits``: per-layer ``LayerFit``."""

    patch: Patch
    fits: list[LayerFit] = field(default_factory=list)

    def truncate(self, rank: int) -> Patch:
        """The patch with every matrix delta cut to its top ``rank`` singular directions (the best
        rank-``rank`` approximation in Frobenius norm: the factors are stored in SVD order)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise InputError(f"rank must be an int >= 1, got {rank!r}")
        return self.patch.replace(
            deltas=cut_rank(dict(self.patch.items()), rank), meta={**self.patch.meta, "truncated_rank": rank}
        )

    def vector(self) -> Patch:
        """Only the dense (bias) deltas: the thought vector."""
        return _subset(self.patch, dense=True)

    def matrices(self) -> Patch:
        """Only the matrix deltas: the thought matrices."""
        return _subset(self.patch, dense=False)


def ridge_setting(ridge: float | str) -> float | str:
    """``ridge`` as recorded: a float, or ``"gcv"``."""
    return ridge if ridge == "gcv" else float(ridge)


def cut_rank(deltas: dict[str, Delta], rank: int | None) -> dict[str, Delta]:
    """Matrix deltas (factors in SVD order) cut to their top ``rank`` terms; others unchanged."""
    if rank is None:
        return dict(deltas)
    return {n: LowRank(d.u[..., :rank, :], d.v[..., :rank, :]) if dl.is_lowrank(d) else d for n, d in deltas.items()}


def _subset(patch: Patch, dense: bool) -> Patch:
    kept = {n: d for n, d in patch.items() if dl.is_lowrank(d) != dense}
    if not kept:
        raise InputError(f"this thought patch has no {'vector' if dense else 'matrix'} deltas")
    return patch.replace(deltas=kept)


def calibration_batches(calibration: Any, batch_size: int) -> list:
    """Calibration inputs as a re-iterable of ``[b, T_q, ...]`` batches."""
    if isinstance(calibration, Tensor):
        return list(calibration.split(batch_size))
    if isinstance(calibration, Iterable) and not isinstance(calibration, (str, bytes)):
        if iter(calibration) is calibration:
            raise InputError(
                "calibration is a one-shot iterator; the fit reads the calibration batches more than "
                "once: pass a tensor, a list of batches or a re-iterable loader"
            )
        return calibration
    raise InputError(
        f"calibration must be a tensor [m, T_q, ...] or a re-iterable of such batches, got {type(calibration).__name__}"
    )


def provenance(model: nn.Module, adapter, fits: list[LayerFit], **settings) -> dict:
    """A thought patch's ``meta``: the model it was fitted on, and the fit's settings and size."""
    return {
        "model": {**adapter.describe(model), "fingerprint": files.fingerprint(model)},
        "thought": {**settings, "positions": fits[0].n},
    }


def static_patch(deltas: dict[str, Delta], meta: dict, readers=None) -> Patch:
    """A thought patch's ``Patch``: one update for any input (``static``), acting everywhere."""
    return Patch(deltas, None, meta, static=True, readers=readers)


def solve_output(
    pairs,
    i: int,
    model: nn.Module,
    matrix: str,
    bias: str | None,
    output: str,
    deltas: dict,
    ridge: float | str,
    distributed: bool,
    solver: str,
) -> dict:
    """The output side's least squares on ``(hidden [N, d_hidden], target [N, d])`` pairs: the output
    matrix ``matrix`` (a parameter name; ``output="affine"``; ``"vector"`` fits no matrix, so the
    features are empty) and, where the site has a ``bias``, the intercept as a last feature of ones,
    into ``deltas``; returns diagnostics. Stacked experts' output matrices ``[E, out, in]`` are fitted
    as the one matrix ``[out, E * in]`` on the scattered hidden states (``arch.experts``)."""
    affine = bias is not None

    def design():
        for x, t in pairs:
            x = x if output == "affine" else t.new_zeros(t.shape[0], 0)
            yield (torch.cat([x, x.new_ones(x.shape[0], 1)], 1) if affine else x), t

    acc = accumulate(design(), distributed, solver)
    a, rank, cond, lam, parts = solve(acc, ridge, affine, f"layer {i} output side")
    if output == "affine":
        dw = a[:, :-1] if affine else a  # [d, d_hidden]  math layout
        w = model.get_parameter(matrix)
        layout = weight_layout(model.get_submodule(matrix.rpartition(".")[0]), matrix)
        if parts is not None and layout != "out_in":
            parts = (parts[1].T, parts[0].T)
        deltas[matrix] = factor(dw if layout == "out_in" else dw.T, parts).to(w.dtype)
    if affine:
        deltas[bias] = a[:, -1][None, None].to(model.get_parameter(bias).dtype)  # [1, 1, d]
    return {
        "n": acc.n,
        "output_residual": residual(acc, a, lam, affine),
        "output_rank": rank,
        "output_condition": cond,
        "output_ridge": lam,
    }
