"""Prompt baking: the gradient baseline practitioners use to put a prompt into weights.

Gradient context distillation (Snell et al. 2022, *Learning by Distilling Context*; Bhargava et
al. 2024, *Prompt Baking*): a LoRA adapter (``peft``) on the MLP matrices, trained so that the
model *without* the prompt reproduces the model *with* it, next token by next token, on the
calibration inputs:

    min_{B, A}  mean_j KL( p(. | prompt, q_<=j) || p_{W + s B A}(. | q_<=j) )       s = alpha / r

by full-batch Adam, from peft's initialisation (``B = 0``: the start is the plain model) or on top
of a closed-form thought patch (``base``: the hybrid, the thought patch written in first). Trained
for a wall-time budget; ``seconds`` may list several budgets, each a snapshot of one run. Every
result is a tokenpatch ``Patch`` of rank-``r`` matrix deltas (``s B A``, exactly what the adapter
adds), so it runs inside the same restoring ``tp.apply`` as every other patch, and
``tp.save_lora`` writes it back out as an adapter. ``peft`` (``pip install 'tokenpatch[lora]'``)
trains it, on a copy of the model: the model passed in is never modified.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tokenpatch import files
from tokenpatch.arch import adapter_for, weight_layout
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank
from tokenpatch.patch import Patch
from tokenpatch.progress import progress_bar
from tokenpatch.run import apply

__all__ = ["Baked", "bake"]


@dataclass(frozen=True)
class Baked:
    """One budget's snapshot: ``patch`` (the LoRA as rank-``r`` deltas, plus ``base`` if given),
    ``steps`` taken, ``seconds`` of training (the teacher pass and the model's copy included), ``losses``: the KL at the
    start and after each step, the last one ``patch``'s own."""

    patch: Patch
    steps: int
    seconds: float
    losses: list[float]


def bake(
    model: nn.Module,
    prompt: Tensor,
    calibration: list[Tensor],
    *,
    seconds: float | list[float],
    rank: int = 4,
    alpha: float = 8.0,
    lr: float = 1e-3,
    keep_bos: bool = True,
    base: Patch | None = None,
    max_steps: int = 100_000,
    seed: int = 0,
    progress: bool | None = None,
) -> list[Baked]:
    """Bake ``prompt`` (token ids ``[P]``) into a LoRA of ``rank`` on every layer's MLP matrices (module
    docstring), over ``calibration`` (batches of token ids ``[b, T]``, each read after the prompt;
    with ``keep_bos`` the prompt's first token stays in front of them without it). Returns one
    ``Baked`` per budget in ``seconds`` (ascending), snapshots of one training run."""
    try:
        import peft  # noqa: PLC0415  an optional extra: only this baseline needs it
    except ImportError as exc:
        raise InputError("prompt baking trains a peft LoRA: pip install 'tokenpatch[lora]'") from exc
    budgets = sorted(float(s) for s in ([seconds] if isinstance(seconds, (int, float)) else seconds))
    if not budgets or budgets[0] <= 0:
        raise InputError(f"bake: seconds must be > 0, got {seconds!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"bake: rank must be an int >= 1, got {rank!r}")
    adapter = adapter_for(model)
    adapter.check_model(model)
    prompt = prompt.reshape(1, -1)
    if keep_bos and prompt.shape[1] < 2:
        raise InputError("bake: keep_bos=True needs a prompt of at least 2 tokens (the first is kept)")
    device = model.get_input_embeddings().weight.device
    targets = sorted({name for i in range(adapter.n_layers(model)) for name in _modules(adapter.sites(model, i))})
    layouts = {weight_layout(model.get_submodule(t), f"{t}.weight") for t in targets}
    if len(layouts) > 1:
        raise InputError("bake: the MLP matrices mix Linear and Conv1D weights; peft takes one fan_in_fan_out")
    start = time.perf_counter()
    with torch.no_grad():  # the teacher: next-token log-probabilities after the prompt
        teacher = [
            model(input_ids=torch.cat([prompt.expand(q.shape[0], -1), q], 1).to(device), use_cache=False)
            .logits[:, prompt.shape[1] :]
            .to(_at_least_float32(model))
            .log_softmax(-1)
            for q in calibration
        ]
    head = prompt[:, :1] if keep_bos else prompt[:, :0]
    inputs = [torch.cat([head.expand(q.shape[0], -1), q], 1).to(device) for q in calibration]
    torch.manual_seed(seed)  # peft's initialisation of A
    student = copy.deepcopy(model)
    for p in student.parameters():
        p.requires_grad_(False)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
        fan_in_fan_out=layouts != {"out_in"},  # GPT-2's Conv1D keeps its weight as [in, out]
    )
    out: list[Baked] = []
    with apply(student, base) if base is not None else contextlib.nullcontext():
        lora = peft.get_peft_model(student, config)
        trained = [p for n, p in lora.named_parameters() if "lora_" in n]
        opt = torch.optim.Adam(trained, lr=lr)
        losses: list[float] = []
        bar = progress_bar(range(max_steps + 1), progress, desc="prompt baking", unit="step")
        for step in bar:  # the KL of the weights as they are, then (unless done) one step
            loss = sum(
                _kl(lora(input_ids=x, use_cache=False).logits[:, head.shape[1] :], t) for x, t in zip(inputs, teacher)
            )
            loss = loss / sum(t.shape[0] * t.shape[1] for t in teacher)
            losses.append(float(loss.detach()))
            elapsed = time.perf_counter() - start
            while budgets and (elapsed >= budgets[0] or step == max_steps):
                out.append(Baked(_patch(model, lora, rank, alpha, base), step, elapsed, list(losses)))
                budgets.pop(0)
            if not budgets:
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        lora.unload()  # the copy's modules as they were (then apply restores its weights)
    return out


def _modules(sites) -> list[str]:
    """The MLP's matrices a layer's patch touches (those reading its input, its output matrix), as
    the names of their modules."""
    names = [n.rpartition(".")[0] for n in sites.inputs if n.endswith(".weight")]
    return names + ([sites.output.name.rpartition(".")[0]] if sites.output is not None else [])


def _at_least_float32(model: nn.Module) -> torch.dtype:
    return torch.promote_types(model.get_input_embeddings().weight.dtype, torch.float32)


def _kl(student_logits: Tensor, teacher_logp: Tensor) -> Tensor:
    """``sum over positions of KL(teacher || student)``, ``[b, T, vocab]`` each."""
    logq = student_logits.to(teacher_logp.dtype).log_softmax(-1)
    return (teacher_logp.exp() * (teacher_logp - logq)).sum()


@torch.no_grad()
def _patch(model: nn.Module, lora, rank: int, alpha: float, base: Patch | None) -> Patch:
    """The adapter's ``s B A`` per target weight, as rank-``r`` deltas of ``model``'s own parameters."""
    scale = alpha / rank
    deltas = {}
    for name, module in lora.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        a = module.lora_A["default"].weight.detach().double()  # [r, in]
        b = module.lora_B["default"].weight.detach().double()  # [out, r]
        own = name.removeprefix("base_model.model.") + ".weight"
        layout = weight_layout(model.get_submodule(own.rpartition(".")[0]), own)
        u, v = (scale * b).T, a  # [r, out], [r, in]: delta = u^T v in the out_in layout
        if layout != "out_in":
            u, v = v, u
        dtype = model.get_parameter(own).dtype
        deltas[own] = LowRank(u[None, None].to(dtype), v[None, None].to(dtype))
    adapter = adapter_for(model)
    meta = {
        "model": {**adapter.describe(model), "fingerprint": files.fingerprint(model)},
        "baking": {"rank": rank, "alpha": alpha},
    }
    lora_patch = Patch(deltas, None, meta, static=True)
    return lora_patch if base is None else base + lora_patch
