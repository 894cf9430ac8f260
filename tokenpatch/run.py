"""Running a model with a patch: ``apply`` (write and restore) and ``functional_call`` (hooks).

``functional_call`` never touches the weights: forward hooks on the patched modules add
``u (v . x) + db`` to their outputs, the factors never multiplied out. The inputs must be the
no-context inputs the patch was made for (``tp.strip_context`` gives them); anything else is an
``InputError`` unless the call opts in: ``broadcast=True`` to run one row of patches over more
sequences, ``any_length=True`` to run sequences of another length (e.g. tokens after the query). A static
patch (``patch.static``, e.g. a thought patch: one update for any input) runs on any
no-context inputs as it is.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

from tokenpatch import files
from tokenpatch.arch import weight_layout
from tokenpatch.arch.families import scale_norm
from tokenpatch.patch import INPUT_SUFFIX, Delta, LowRank, Patch
from tokenpatch.errors import InputError, UnsupportedModelError

__all__ = ["apply", "functional_call", "patched_run"]


def _lowrank_add(x: Tensor, w_in: Tensor | None, w_out: Tensor | None, b: Tensor | None) -> Tensor:
    """``u (v . x) + db`` for groups of positions sharing a patch, in at least float32.

    ``x [N, G, K, in]``: G groups of K positions; ``w_in [N, G, r, in]``, ``w_out [N, G, r, out]``
    (the in- and out-side factors) and ``b [N, G, out]`` are the groups' deltas -> ``[N, G, K, out]``.
    """
    delta = torch.zeros((), dtype=x.dtype, device=x.device)
    if w_in is not None:
        coef = x @ w_in.to(x).transpose(-1, -2)  # [N, G, K, r]
        delta = coef @ w_out.to(x)  # [N, G, K, out]
    if b is not None:
        delta = delta + b.to(x)[:, :, None, :]  # [N, G, 1, out]
    return delta


class _Hook:
    """Forward hook of one linear module: adds its deltas, per (batch, query) patch, to the output.

    Patch ``[b, q]`` acts everywhere on no-context sequence ``b * Q + q``, or at position
    ``positions[q]`` of sequence ``b``; the input shape is checked against what the patch was made
    for on every call (a few integer comparisons).
    """

    def __init__(self, module_name: str, deltas: dict[str, Delta], layout: str, patch: Patch,
                 broadcast: bool, any_length: bool, unit=None):
        self.name, self.patch = module_name, patch
        w, self.b = deltas.get("weight"), deltas.get("bias")
        self.unit = None  # a norm's scale delta: ``out + dw * unit(x)`` (``arch.families.SCALE_NORMS``)
        if isinstance(w, Tensor):
            self.unit, self.b, w = unit, w, None
        self.w_in, self.w_out = (None, None) if w is None else ((w.v, w.u) if layout == "out_in" else (w.u, w.v))
        static = patch.static  # one update for any input (a thought patch): runs on all of them
        self.broadcast, self.any_length = broadcast or static, any_length or static
        self.length = None if patch.plan is None else patch.plan.stripped_len

    def _check(self, x: Tensor) -> None:
        if x.ndim != 3:
            raise InputError(f"{self.name}: expected inputs [batch, pos, features], got {tuple(x.shape)}")
        (rows, queries), at = self.patch.lead, self.patch.acts == "at_positions"
        n = x.shape[0]
        want_n = rows if at else rows * queries
        if n != want_n and not (self.broadcast and rows == 1 and n % (1 if at else queries) == 0):
            made = "one row per sequence" if at else "one per no-context sequence"
            hint = "; or pass broadcast=True to run its one row of patches over every sequence" if rows == 1 else ""
            raise InputError(f"{self.name}: the patch holds [batch, query] = {[rows, queries]} patches, {made}, "
                             f"but the input batch is {n}; tp.strip_context gives the right inputs{hint}")
        t = x.shape[1]
        if at and t <= max(self.patch.positions):
            raise InputError(f"{self.name}: the patch acts at positions {list(self.patch.positions)} but the "
                             f"sequences have {t}; tp.strip_context gives the right inputs")
        if self.length is not None and t != self.length and not self.any_length:
            raise InputError(f"{self.name}: the patch was made for no-context sequences of length {self.length}, "
                             f"got length {t} (with-context inputs?); tp.strip_context gives the right inputs, "
                             "or pass any_length=True to run it on sequences of another length on purpose")

    def _rows(self, t: Tensor | None, n: int) -> Tensor | None:
        """``[B, Q, ...]`` factor -> ``[N, G, ...]``: one group per sequence (everywhere), or Q groups."""
        if t is None:
            return None
        if self.patch.acts == "at_positions":
            return t.expand(n, *t.shape[1:])  # [N, Q, ...]
        if t.shape[0] * t.shape[1] != n:  # broadcast: one row of patches repeats over the batch
            t = t.expand(n // t.shape[1], *t.shape[1:])
        return t.flatten(0, 1)[:, None]  # [N, 1, ...]

    def _unflatten(self, x: Tensor) -> Tensor:
        """Tokens flattened to ``[batch * pos, features]`` (modules inside a mixture-of-experts
        block run so) -> ``[batch, pos, features]``, the no-context sequences the patch was made for."""
        if x.ndim != 2:
            return x
        rows, queries = self.patch.lead
        n = rows if self.patch.acts == "at_positions" else rows * queries  # the no-context sequences
        if x.shape[0] % n:
            raise InputError(f"{self.name}: flattened inputs {tuple(x.shape)} cannot be split into the patch's {n} "
                             "no-context sequences")
        return x.view(n, x.shape[0] // n, x.shape[1])

    def __call__(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        if args[0].ndim == 2:
            return self(module, (self._unflatten(args[0]), *args[1:]), self._unflatten(out)).flatten(0, 1)
        x = args[0]
        self._check(x)
        n = x.shape[0]
        ref = self.b if self.w_in is None else self.w_in
        dt = torch.promote_types(torch.promote_types(x.dtype, ref.dtype), torch.float32)
        factors = [self._rows(f, n) for f in (self.w_in, self.w_out)]
        b = self._rows(self.b, n)  # [N, G, out]
        if self.unit is not None and self.patch.acts == "everywhere":  # a norm-scale delta: dw * unit(x)
            return (out.to(dt) + b.to(dt) * self.unit(module, x).to(dt)).to(out.dtype)  # [N, 1, out] * [N, T, out]
        if self.unit is not None:  # at positions: patch [b, q] at position positions[q] of sequence b
            where = torch.tensor(self.patch.positions, device=x.device)
            change = b.to(dt) * self.unit(module, x[:, where]).to(dt)  # [N, Q, out]
            return out.index_copy(1, where, (out[:, where].to(dt) + change).to(out.dtype))
        if self.patch.acts == "everywhere":
            delta = _lowrank_add(x.to(dt)[:, None], *factors, b)[:, 0]  # [N, T, out]
            return (out.to(dt) + delta).to(out.dtype)
        where = torch.tensor(self.patch.positions, device=x.device)
        delta = _lowrank_add(x[:, where].to(dt)[:, :, None], *factors, b)[:, :, 0]  # [N, Q, out]
        return out.index_copy(1, where, (out[:, where].to(dt) + delta).to(out.dtype))


class _InputHook(_Hook):
    """Forward pre-hook of a module whose input the patch changes: ``x -> x + D x`` per patch row
    (``D = sum_k d_k v_k^T``, a ``"<module>:input"`` delta), so every matrix inside reading ``x``
    computes ``(W + W D) x`` with one product, and routers or stacked experts see the change too."""

    def __init__(self, module_name: str, delta: LowRank, patch: Patch, broadcast: bool, any_length: bool):
        super().__init__(module_name, {"weight": delta}, "out_in", patch, broadcast, any_length)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        x = args[0] if args else kwargs["hidden_states"]
        flat = x.ndim == 2
        x = self._unflatten(x)
        self._check(x)
        n = x.shape[0]
        dt = torch.promote_types(torch.promote_types(x.dtype, self.w_in.dtype), torch.float32)
        factors = [self._rows(f, n) for f in (self.w_in, self.w_out)]
        if self.patch.acts == "everywhere":
            new = (x.to(dt) + _lowrank_add(x.to(dt)[:, None], *factors, None)[:, 0]).to(x.dtype)
        else:
            where = torch.tensor(self.patch.positions, device=x.device)
            change = _lowrank_add(x[:, where].to(dt)[:, :, None], *factors, None)[:, :, 0]  # [N, Q, d]
            new = x.index_copy(1, where, (x[:, where].to(dt) + change).to(x.dtype))
        new = new.flatten(0, 1) if flat else new
        return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})


@contextlib.contextmanager
def hooked(model: nn.Module, patch: Patch, broadcast: bool, any_length: bool) -> Iterator[None]:
    """Register the patch's hooks for the duration of the block; removed on exit, errors included."""
    by_module: dict[str, dict[str, Delta]] = {}
    inputs: dict[str, LowRank] = {}
    for name, delta in patch.items():
        if name.endswith(INPUT_SUFFIX):
            inputs[name[: -len(INPUT_SUFFIX)]] = delta
            continue
        module_name, _, attr = name.rpartition(".")
        by_module.setdefault(module_name, {})[attr] = delta
    handles = []
    try:
        for module_name, deltas in by_module.items():
            module = model.get_submodule(module_name)
            unit, layout = None, "out_in"
            if set(deltas) - {"weight", "bias"} or isinstance(deltas.get("bias"), LowRank) or (
                    isinstance(deltas.get("weight"), Tensor) and "bias" in deltas):
                raise UnsupportedModelError(
                    f"cannot apply deltas {sorted(deltas)} to {module_name} ({type(module).__name__}): "
                    "functional_call supports low-rank weight and dense bias deltas of linear layers, and dense "
                    "scale deltas of known norms"
                )
            if isinstance(deltas.get("weight"), Tensor):
                unit = scale_norm(module, module_name)[0]
            elif "weight" in deltas:
                layout = weight_layout(module, module_name)
            hook = _Hook(module_name, deltas, layout, patch, broadcast, any_length, unit)
            handles.append(module.register_forward_hook(hook))
        for module_name, delta in inputs.items():
            hook = _InputHook(module_name, delta, patch, broadcast, any_length)
            handles.append(model.get_submodule(module_name).register_forward_pre_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def patched_run(run, model: nn.Module, patch: Patch, *args, broadcast: bool = False, any_length: bool = False,
                **kwargs):
    """``run(*args, **kwargs)`` with ``patch``'s hooks on ``model`` (checked against it first)."""
    patch.check_model(model)
    with hooked(model, patch, broadcast, any_length):
        return run(*args, **kwargs)


def functional_call(model: nn.Module, patch: Patch, *args, broadcast: bool = False, any_length: bool = False,
                    **kwargs):
    """``model(*args, **kwargs)`` with ``patch`` applied in the forward, nothing mutated.

    Each patched linear computes ``W x + b + u (v . x) + db`` (factors never multiplied out).
    Inputs as ``strip_context`` gives them: for a patch acting everywhere, input sequence
    ``b * Q + q`` uses patch ``[b, q]`` at every position; for one acting at positions, patch
    ``[b, q]`` acts at position ``positions[q]`` of sequence ``b``. Inputs that cannot be what the
    patch was made for raise ``InputError``: another number of sequences (``broadcast=True`` runs
    a patch holding one batch row over every sequence), or another sequence length
    (``any_length=True`` allows it, e.g. to run tokens after the query under the patch).
    Differentiable with respect to the model's parameters and the patch factors.

    The deltas ride on forward hooks registered for this call and removed afterwards (also on
    error): weights are never touched, but another thread running the same model meanwhile
    would see the patch. (``torch.func.functional_call`` substitutes whole parameters, which
    would mean materialising ``W + u v^T`` per patch, and cannot vary them along the batch.)
    """
    return patched_run(model, model, patch, *args, broadcast=broadcast, any_length=any_length, **kwargs)


@contextlib.contextmanager
def apply(model: nn.Module, patch: Patch) -> Iterator[nn.Module]:
    """Context manager: write ``W + delta`` into the model's weights; restore them bit-exactly
    on exit, also when the body raises.

    Only a single patch (``patch.lead == (1, 1)``, e.g. ``patch[b, q]``) acting everywhere can be
    written into weights; position-specific patches (a chunk removed from the middle of a deep
    model) need ``functional_call``. The delta is materialised here, cast to the weight's dtype.
    """
    if patch.lead != (1, 1):
        raise InputError(
            f"apply() writes one set of weights but the patch holds {patch.lead[0]} x {patch.lead[1]} "
            "(batch x query) patches; pick one with patch[b, q], or use functional_call"
        )
    if patch.acts == "at_positions":
        raise InputError(
            f"this patch acts only at position {patch.positions[0]} of the no-context sequence (a chunk "
            "was removed mid-sequence); written into weights it would change the context tokens too. "
            "Use functional_call"
        )
    patch.check_model(model)
    params = dict(model.named_parameters())
    state = files.cached_state(model)  # unchanged by the round trip below, so kept valid after it
    saved: dict[str, Tensor] = {}
    try:
        with torch.no_grad():
            for name, delta in patch.items():
                if name.endswith(INPUT_SUFFIX):  # W + W D on every matrix reading that input
                    d = delta.dense()[0, 0]  # [d, d]
                    for reader, layout in patch.readers[name]:
                        p = params[reader]
                        saved.setdefault(reader, p.detach().clone())
                        dd = d.to(device=p.device, dtype=torch.promote_types(p.dtype, torch.float32))
                        w = p.detach().to(dd.dtype)
                        p.copy_(w + (w @ dd if layout == "out_in" else dd.T @ w))
                    continue
                p = params[name]
                saved.setdefault(name, p.detach().clone())
                dense = delta.dense()[0, 0] if isinstance(delta, LowRank) else delta[0, 0]
                p.add_(dense.to(device=p.device, dtype=p.dtype))
        yield model
    finally:
        with torch.no_grad():
            for name, original in saved.items():
                params[name].copy_(original)
        files.restored(model, state, {id(params[name]) for name in saved})
