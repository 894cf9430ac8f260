"""The delta hooks: how a patch runs on a model without touching its weights.

One hook, ``DeltaHook``, runs every kind of delta on one module, per (batch, query) patch: a forward hook
adds ``dW x + db`` to the output (low-rank ``u (v . x)``, the factors never multiplied out), or a norm's
``dg * unit(x)``; a forward pre-hook changes an input, ``x -> x + D x``. ``hooked`` puts a patch's hooks on
a model for the duration of a block, every delta checked before any hook goes on. ``run.functional_call``
is the front; ``dynamics.finetuning`` and the thought patches' passes use the hooks directly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch.arch import weight_layout
from tokenpatch.arch.experts import experts_call, output_matrix, scattered_hiddens, stacked_experts
from tokenpatch.arch.hooks import registered_hooks
from tokenpatch.arch.norms import scale_norm
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch import INPUT_SUFFIX, Delta, LowRank, Patch

__all__ = ["DeltaHook", "hooked"]


def _weight_add(x: Tensor, weight: Delta | None, layout: str, b: Tensor | None) -> Tensor:
    """``dW x + db`` for groups of positions sharing a patch (low-rank ``dW``: ``u (v . x)``, the factors
    never multiplied out; ``deltas.apply``), in ``x``'s dtype (at least float32, ``DeltaHook._added``).

    ``x [N, G, K, in]``: G groups of K positions; ``weight`` (lead ``[N, G]``, in its ``layout``) and
    ``b [N, G, out]`` are the groups' deltas -> ``[N, G, K, out]``.
    """
    delta = torch.zeros((), dtype=x.dtype, device=x.device)
    if weight is not None:
        delta = dl.apply(weight, x, layout)  # [N, G, K, out]
    if b is not None:
        delta = delta + b.to(x)[:, :, None, :]  # [N, G, 1, out]
    return delta


class DeltaHook:
    """The one hook that runs a patch's deltas on one module, per (batch, query) patch.

    Patch ``[b, q]`` acts everywhere on no-context sequence ``b * Q + q``, or at position
    ``positions[q]`` of sequence ``b`` only; the input shape is checked against what the patch was
    made for on every call (a few integer comparisons). Three kinds of delta, one mechanism:

    * ``after`` (a forward hook) adds a weight delta and a dense bias delta to the output,
      ``out + dW x + db`` (``deltas.apply``: low-rank ``u (v . x)``, factors never multiplied out;
      dense ``[*lead, *W.shape]`` as ``finetuned`` runs them); or a norm's dense scale delta,
      ``out + dg * unit(x)`` (``arch.norms.SCALE_NORMS``);
    * ``before`` (a forward pre-hook with kwargs) changes the module's input, ``x -> x + D x``
      (a ``"<module>:input"`` delta ``D = sum_k d_k v_k^T``), so every matrix inside reading ``x``
      computes ``(W + W D) x`` with one product, and routers or stacked experts see the change too.

    ``consecutive=True`` (``dynamics.finetuning.finetuned``: ``R`` fine-tuned models at once): patch
    ``[r, 0]`` acts everywhere on the ``k`` consecutive sequences ``r k .. r k + k - 1`` of a batch of ``R k``.
    """

    def __init__(
        self,
        module_name: str,
        patch: Patch,
        broadcast: bool,
        any_length: bool,
        *,
        weight: Delta | None = None,
        layout: str = "out_in",
        bias: Tensor | None = None,
        unit=None,
        consecutive: bool = False,
    ):
        self.name, self.patch, self.unit, self.b = module_name, patch, unit, bias
        self.weight, self.layout = weight, layout
        # each [b, q] patch on the next n / (B Q) consecutive sequences (R fine-tuned models, ``finetuned``)
        self.consecutive = consecutive
        static = patch.static  # one update for any input (a thought patch): runs on all of them
        self.broadcast, self.any_length = broadcast or static, any_length or static
        self.lengths = {plan.stripped_len for plan in patch.made_for()}  # empty: no plan, any length

    def _check(self, x: Tensor) -> None:
        if x.ndim != 3:
            raise InputError(f"{self.name}: expected inputs [batch, pos, features], got {tuple(x.shape)}")
        (rows, queries), at = self.patch.lead, self.patch.acts == "at_positions"
        n = x.shape[0]
        if self.consecutive:
            if n % (rows * queries):
                raise InputError(
                    f"{self.name}: the input batch {n} is not a multiple of the {rows * queries} "
                    "fine-tuning runs (each run's sequences must be consecutive)"
                )
            return
        want_n = rows if at else rows * queries
        if n != want_n and not (self.broadcast and rows == 1 and n % (1 if at else queries) == 0):
            made = "one row per sequence" if at else "one per no-context sequence"
            hint = "; or pass broadcast=True to run its one row of patches over every sequence" if rows == 1 else ""
            raise InputError(
                f"{self.name}: the patch holds [batch, query] = {[rows, queries]} patches, {made}, "
                f"but the input batch is {n}; tp.strip_context gives the right inputs{hint}"
            )
        t = x.shape[1]
        if at and t <= max(self.patch.positions):
            raise InputError(
                f"{self.name}: the patch acts at positions {list(self.patch.positions)} but the "
                f"sequences have {t}; tp.strip_context gives the right inputs"
            )
        if self.lengths and t not in self.lengths and not self.any_length:
            raise InputError(
                f"{self.name}: the patch was made for no-context sequences of length {min(self.lengths)}, "
                f"got length {t} (with-context inputs?); tp.strip_context gives the right inputs, "
                "or pass any_length=True to run it on sequences of another length on purpose"
            )

    def _rows(self, t: Tensor | None, n: int) -> Tensor | None:
        """``[B, Q, ...]`` factor -> ``[N, G, ...]``: one group per sequence (everywhere), or Q groups."""
        if t is None:
            return None
        if self.patch.acts == "at_positions":
            return t.expand(n, *t.shape[1:])  # [N, Q, ...]
        if (
            t.shape[0] * t.shape[1] != n and not self.consecutive
        ):  # broadcast: one row of patches repeats over the batch
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
            raise InputError(
                f"{self.name}: flattened inputs {tuple(x.shape)} cannot be split into the patch's {n} "
                "no-context sequences"
            )
        return x.view(n, x.shape[0] // n, x.shape[1])

    def _added(self, target: Tensor, x: Tensor, change) -> Tensor:
        """``target + change(x_g)`` where the patch acts: ``x_g [N, G, K, in]`` groups the positions
        sharing a patch (one group of every position, or one group per query position), ``change``
        returns ``[N, G, K, out]`` in ``dt`` (at least float32); the sum is cast back to ``target``'s dtype."""
        ref = self.b if self.weight is None else self.weight
        dt = torch.promote_types(torch.promote_types(x.dtype, ref.dtype), torch.float32)
        if self.patch.acts == "everywhere":  # one group per sequence, or per run's consecutive sequences
            groups = self.patch.lead[0] * self.patch.lead[1] if self.consecutive else x.shape[0]
            xg = x.reshape(groups, 1, -1, x.shape[-1])  # [N, 1, T, in] (consecutive: [R, 1, k T, in])
            tg = target.reshape(groups, -1, target.shape[-1]).to(dt)  # [N, T, out] (consecutive: [R, k T, out])
            return (tg + change(xg, dt)[:, 0]).reshape(target.shape).to(target.dtype)
        where = torch.tensor(self.patch.positions, device=x.device)
        delta = change(x[:, where][:, :, None], dt)[:, :, 0]  # [N, Q, out]
        return target.index_copy(1, where, (target[:, where].to(dt) + delta).to(target.dtype))

    def _change(self, module: nn.Module, n: int):
        b = self._rows(self.b, n)  # [N, G, out]
        if self.unit is not None:  # a norm-scale delta: dg * unit(x)
            return lambda xg, dt: b.to(dt)[:, :, None, :] * self.unit(module, xg).to(dt)
        weight = None if self.weight is None else dl.map_tensors(self.weight, lambda t: self._rows(t, n))
        return lambda xg, dt: _weight_add(xg.to(dt), weight, self.layout, b)

    def after(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        """Forward hook: the output deltas."""
        if args[0].ndim == 2:
            return self.after(module, (self._unflatten(args[0]), *args[1:]), self._unflatten(out)).flatten(0, 1)
        x = args[0]
        self._check(x)
        return self._added(out, x, self._change(module, x.shape[0]))

    def after_experts(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        """Forward hook on stacked experts (``arch.experts``): the output matrices' delta, read as the one
        matrix ``[D_1 ... D_E]`` on the chosen experts' weighted hidden states ``z`` (recomputed here;
        tokens flattened, or ``[batch, pos, d]`` as DBRX's experts get them)."""
        x, index, weights = experts_call(module, args)
        z = scattered_hiddens(module, x.reshape(-1, x.shape[-1]), index.flatten(0, -2), weights.flatten(0, -2))
        return self.after(module, (z.view(*x.shape[:-1], -1),), out)

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook: the input change ``x -> x + D x``."""
        x = args[0] if args else kwargs["hidden_states"]
        flat = x.ndim == 2
        x = self._unflatten(x)
        self._check(x)
        new = self._added(x, x, self._change(module, x.shape[0]))
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
    pairs = []  # (register, hook): every delta checked before any hook goes on
    for module_name, deltas in by_module.items():
        module = model.get_submodule(module_name)
        owner = _experts_owner(model, module_name, deltas)
        if owner is not None:  # stacked experts' output matrices: a hook on the experts module
            ((attr, delta),) = deltas.items()
            layout = weight_layout(module, f"{module_name}.{attr}")  # [E, out, in], [E, in, out]; DBRX's [E * in, out]
            hook = DeltaHook(owner, patch, broadcast, any_length, weight=delta, layout=layout)
            pairs.append((model.get_submodule(owner).register_forward_hook, hook.after_experts))
            continue
        if (
            set(deltas) - {"weight", "bias"}
            or ("bias" in deltas and dl.is_lowrank(deltas["bias"]))
            or ("weight" in deltas and not dl.is_lowrank(deltas["weight"]) and "bias" in deltas)
        ):
            raise UnsupportedModelError(
                f"cannot apply deltas {sorted(deltas)} to {module_name} ({type(module).__name__}): "
                "functional_call supports low-rank weight and dense bias deltas of linear layers, dense "
                "scale deltas of known norms, and low-rank deltas of stacked experts' output matrices"
            )
        weight = deltas.get("weight")
        if weight is not None and not dl.is_lowrank(weight):  # a norm's scale
            hook = DeltaHook(
                module_name, patch, broadcast, any_length, bias=weight, unit=scale_norm(module, module_name)[0]
            )
        else:
            layout = weight_layout(module, module_name) if weight is not None else "out_in"
            hook = DeltaHook(
                module_name, patch, broadcast, any_length, weight=weight, layout=layout, bias=deltas.get("bias")
            )
        pairs.append((module.register_forward_hook, hook.after))
    for module_name, delta in inputs.items():
        hook = DeltaHook(module_name, patch, broadcast, any_length, weight=delta)
        for reading in _input_modules(module_name, patch.readers.get(f"{module_name}{INPUT_SUFFIX}", ())):
            register = model.get_submodule(reading).register_forward_pre_hook
            pairs.append((functools.partial(register, with_kwargs=True), hook.before))
    with registered_hooks(pairs):
        yield


def _input_modules(module: str, readers) -> list[str]:
    """The modules whose input an input change ``"<module>:input"`` changes: ``module``, and the module
    of each of its readers outside it (a block whose MLP is two modules reading one norm's output,
    Granite-MoE-Shared's experts and shared MLP: the same change on each)."""
    out = [module]
    for reader, _ in readers:
        owner = reader.rpartition(".")[0]
        if not owner.startswith(f"{module}.") and owner not in out:
            out.append(owner)
    return out


def _experts_owner(model: nn.Module, module_name: str, deltas: dict) -> str | None:
    """The experts module whose output matrices are the one delta of ``deltas`` (on ``module_name``):
    the module itself (``down_proj``), or the experts module above it (DBRX's ``mlp.w2``); else ``None``."""
    if len(deltas) != 1:
        return None
    name = f"{module_name}.{next(iter(deltas))}"
    for owner in (module_name, module_name.rpartition(".")[0]):
        module = model.get_submodule(owner)
        if name == f"{owner}.{output_matrix(module)}" and stacked_experts(module, owner):
            return owner
    return None
