"""``save_lora``: a static patch (a thought patch) as a LoRA adapter folder in the Hugging Face
``peft`` format, so that any stack that serves LoRA adapters serves a compressed prompt.

A static patch is one weight update for every input. A ``peft`` LoRA adds to a targeted linear
module the product ``B A`` times ``lora_alpha / r`` (``lora_B.weight [out, r]``, ``lora_A.weight
[r, in]``, in the convention ``y = W x``); here ``lora_alpha = r``, so the product itself. Each kind
of delta maps to it exactly:

* a matrix delta ``dW = sum_k a_k b_k^T`` (``LowRank``, ``a_k`` on the output side, ``b_k`` on the
  input side): ``B = [a_1 ... a_k]``, ``A = [b_1 ... b_k]^T``. A ``Conv1D`` weight is stored
  ``[in, out]`` (GPT-2): its factors swap sides, and the folder says ``fan_in_fan_out``;
* an MLP-input change ``s -> s + D s`` with ``D = sum_k d_k v_k^T``: every matrix ``W`` reading ``s``
  becomes ``W + W D``, a LoRA with ``B = [W d_1 ... W d_k]``, ``A = [v_1 ... v_k]^T``;
* a bias delta of a linear module: that module's ``lora_B.bias`` (``lora_bias``, peft >= 0.14);
* any other vector delta (the scale of Gemma's post-MLP norm) is no product of thin matrices: its
  module is written whole, with ``w + dw``, as peft stores the modules it trains in full
  (``modules_to_save``).

Pieces on one module sit side by side (their ranks add). The adapter has one rank ``r``, the largest
module's; smaller ones are padded with zero columns (rank patterns are name regexes in peft, and a
uniform rank is what LoRA servers load most widely). Lora_bias and modules_to_save are peft
features that not every server implements: ``LoraExport.extras`` names what needs them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import Tensor, nn

from tokenpatch import deltas as dl
from tokenpatch import offload
from tokenpatch.arch import text_config, weight_layout
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.patch import INPUT_SUFFIX, Patch
from tokenpatch.paths import not_a_new_folder, write_new
from tokenpatch.version import __version__

__all__ = ["LoraExport", "save_lora", "lora_pieces"]

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # how peft names the wrapped model's modules in its files
PEFT_MOE_NAMES = ("gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")  # _peft_retargets
# peft refuses a LoRA on these modules of these model types (its Mamba kernels bypass them): written whole
PEFT_MAMBA_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")
PEFT_MAMBA_NAMES = ("out_proj", "conv1d")
DUMMY_TARGETS = "dummy-target-modules"  # peft's target_modules when only modules_to_save are written


@dataclass(frozen=True)
class LoraExport:
    """What ``save_lora`` wrote: the folder, the rank, the LoRA targets (module names), the modules
    written whole (``modules_to_save``), whether ``lora_bias`` is on, and the file's bytes."""

    folder: Path
    rank: int
    targets: tuple[str, ...]
    whole: tuple[str, ...]
    lora_bias: bool
    nbytes: int

    @property
    def extras(self) -> list[str]:
        """The peft features beyond a plain LoRA this adapter needs (empty: any LoRA server)."""
        return ["lora_bias"] * self.lora_bias + ["modules_to_save"] * bool(self.whole)

    def __repr__(self) -> str:
        extras = f", needs {' and '.join(self.extras)}" if self.extras else ""
        return (
            f"LoraExport({str(self.folder)!r}: rank {self.rank} on {len(self.targets)} modules"
            f"{f', {len(self.whole)} written whole' if self.whole else ''}, {self.nbytes / 1e6:.2f} MB{extras})"
        )


def _module_of(name: str) -> tuple[str, str]:
    """``"model.layers.0.mlp.down_proj.weight"`` -> ``("model.layers.0.mlp.down_proj", "weight")``."""
    module, _, param = name.rpartition(".")
    return module, param


def _layout(module: nn.Module) -> str | None:
    """A LoRA target's weight layout (``arch.weight_layout``), or ``None`` for a module that is none."""
    try:
        return weight_layout(module)
    except UnsupportedModelError:
        return None


def _linear(model: nn.Module, module_name: str, what: str) -> str:
    """The weight layout of a LoRA target, or a clear error for a parameter peft cannot target."""
    module = model.get_submodule(module_name)
    layout = _layout(module)
    stacked = getattr(module, "weight", None) is not None and module.weight.ndim != 2  # JetMoE's experts [E, out, in]
    if layout is None or what != f"{module_name}.weight" or stacked:
        raise UnsupportedModelError(
            f"save_lora: {what} is a parameter of {module_name} ({type(module).__name__}) that a LoRA cannot "
            "target (peft LoRA adapts the weight of a linear layer); keep this patch as a tokenpatch file (tp.save_patch)"
        )
    return layout


def lora_pieces(model: nn.Module, patch: Patch) -> tuple[dict, dict, dict]:
    """The LoRA form of a static ``patch`` ``[1, 1]`` on ``model`` (module docstring), in float64:
    ``(pieces, biases, whole)`` with ``pieces[module] = [(B [out, k], A [k, in]), ...]`` and its
    layout, ``biases[module] = db [out]`` and ``whole[module] = {param: new value}``. Every weight is
    read through ``offload.value`` (an ``accelerate``-offloaded one is on ``meta``: its data is elsewhere)."""
    pieces: dict[str, list[tuple[Tensor, Tensor]]] = {}
    layouts: dict[str, str] = {}
    biases: dict[str, Tensor] = {}
    whole: dict[str, dict[str, Tensor]] = {}

    def add(module: str, layout: str, b: Tensor, a: Tensor) -> None:
        pieces.setdefault(module, []).append((b, a))
        layouts[module] = layout

    for key, delta in patch.items():
        if key.endswith(INPUT_SUFFIX):  # s -> s + D s, D = sum_k d_k v_k^T: W + W D on each reader
            d, v = delta.u[0, 0].double(), delta.v[0, 0].double()  # [k, H] each
            for reader, layout in patch.readers.get(key, ()):
                module, _ = _module_of(reader)
                if _linear(model, module, reader) != layout:
                    raise InputError(f"save_lora: the patch reads {reader} as {layout}, the model's layout differs")
                w = offload.value(model, reader).detach().to(d.device, torch.float64)
                wd = d @ w.T if layout == "out_in" else d @ w  # [k, out]: W d_k for each k
                add(module, layout, wd.T, v)
        elif dl.is_lowrank(delta):
            module, _ = _module_of(key)
            layout = _linear(model, module, key)
            u, v = delta.u[0, 0].double(), delta.v[0, 0].double()  # [k, rows], [k, cols] in the stored layout
            out_side, in_side = (u, v) if layout == "out_in" else (v, u)
            add(module, layout, out_side.T, in_side)
        else:  # a vector: a linear module's bias, or a module written whole
            module, param = _module_of(key)
            layout = _layout(model.get_submodule(module))
            if param == "bias" and layout is not None:
                biases[module] = delta[0, 0].double()
                layouts.setdefault(module, layout)
            else:
                state = {
                    n: offload.value(model, f"{module}.{n}", t).detach().to(delta.device, torch.float64)
                    for n, t in model.get_submodule(module).state_dict(keep_vars=True).items()
                }
                state[param] = state[param] + delta[0, 0].double()
                whole[module] = state
    for module in biases:
        pieces.setdefault(module, [])
    return {m: (p, layouts[m]) for m, p in pieces.items()}, biases, whole


def _check(model: nn.Module, patch: Any) -> Patch:
    patch = getattr(patch, "patch", patch)  # a ThoughtPatch holds its Patch
    if not isinstance(patch, Patch):
        raise InputError(f"save_lora: patch must be a tp.Patch or a thought patch, got {type(patch).__name__}")
    if not patch.static:
        raise InputError(
            "save_lora: a LoRA is one weight update for every input, and this patch is not static (a token "
            "patch acts on its own queries): export a thought patch (tp.thought_patch(...).patch)"
        )
    if patch.lead != (1, 1):
        raise InputError(
            f"save_lora: the patch holds {patch.lead} patches [batch, query]; pick one: patch[b:b+1, q:q+1]"
        )
    patch.check_model(model)
    patch.check_finite()
    return patch


def _free_folder(folder: Path) -> None:
    what = not_a_new_folder(folder)
    if what:
        raise InputError(f"save_lora: {folder} is {what}; choose a new folder (nothing is replaced)")
    if not folder.parent.is_dir():
        raise InputError(f"save_lora: the folder {folder.parent} does not exist; create it first")


def save_lora(
    model: nn.Module, patch: Any, folder: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> LoraExport:
    """Write the static ``patch`` of ``model`` (a thought patch, or its ``Patch``) to ``folder`` as a
    ``peft`` LoRA adapter: ``adapter_config.json`` and ``adapter_model.safetensors``, which
    ``peft.PeftModel.from_pretrained(model, folder)`` loads onto the unmodified model (module
    docstring for the mapping). ``dtype``: of the written tensors (default: the model's).
    ``folder`` must be new or empty; it appears complete or not at all. Returns a ``LoraExport``."""
    patch = _check(model, patch)
    folder = Path(folder)
    _free_folder(folder)
    pieces, biases, whole = lora_pieces(model, patch)
    if not pieces and not whole:
        raise InputError("save_lora: the patch has no deltas")
    for module in [m for m in pieces if _peft_retargets(model, m)]:  # written whole: W + B A (+ db)
        whole[module] = _merged(model, module, pieces.pop(module)[0], biases.pop(module, None))
    layouts = {layout for _, layout in pieces.values()}
    if len(layouts) > 1:
        raise UnsupportedModelError(
            "save_lora: the LoRA targets mix Linear and Conv1D weights; peft takes one fan_in_fan_out"
        )
    dtype = dtype or next(model.parameters()).dtype
    rank = max([sum(b.shape[1] for b, _ in p) for p, _ in pieces.values()] + [1])
    tensors: dict[str, Tensor] = {}
    for module, (parts, _) in sorted(pieces.items()):
        out_f, in_f = _features(model, module)
        b = torch.zeros(out_f, rank, dtype=torch.float64)
        a = torch.zeros(rank, in_f, dtype=torch.float64)
        k = 0
        for pb, pa in parts:
            b[:, k : k + pb.shape[1]], a[k : k + pa.shape[0]] = pb.cpu(), pa.cpu()
            k += pb.shape[1]
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.to(dtype)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.to(dtype)
        if biases:
            db = biases.get(module)
            tensors[f"{PREFIX}{module}.lora_B.bias"] = (torch.zeros(out_f) if db is None else db.cpu()).to(dtype)
    for module, state in sorted(whole.items()):
        for name, value in state.items():
            tensors[f"{PREFIX}{module}.{name}"] = value.cpu().to(dtype)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None) or None,
        "r": rank,
        "lora_alpha": rank,  # scaling lora_alpha / r = 1: B A is the update itself
        "lora_dropout": 0.0,
        "target_modules": sorted(pieces) or DUMMY_TARGETS,
        "fan_in_fan_out": layouts == {"in_out"},
        "bias": "none",
        "lora_bias": bool(biases),
        "modules_to_save": sorted(whole) or None,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    provenance = {"tokenpatch": __version__, "model": patch.meta.get("model"), "thought": patch.meta.get("thought")}
    data = st_save(
        {k: v.contiguous() for k, v in tensors.items()},
        metadata={"format": "pt", "tokenpatch": json.dumps(provenance, default=str)},
    )
    _write_folder(folder, {CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode(), WEIGHTS_FILE: data})
    return LoraExport(folder, rank, tuple(sorted(pieces)), tuple(sorted(whole)), bool(biases), len(data))


def _peft_retargets(model: nn.Module, module: str) -> bool:
    """Whether peft would not load a LoRA on ``module``: on a mixture-of-experts model (its config counts
    experts) peft (0.18 on, with transformers 5) takes a target named like an expert projection (``PEFT_MOE_NAMES``)
    for the fused experts and drops it, even on a dense layer (a Qwen3-MoE with ``mlp_only_layers``); on
    a Mamba model it refuses a LoRA of the mixer's ``out_proj`` and ``conv1d`` (``PEFT_MAMBA_NAMES``)."""
    config = text_config(model)
    leaf = module.rsplit(".", 1)[-1]
    if getattr(config, "model_type", None) in PEFT_MAMBA_TYPES and leaf in PEFT_MAMBA_NAMES:
        return True
    moe = any(getattr(config, k, None) for k in ("num_experts", "num_local_experts"))
    return moe and leaf in PEFT_MOE_NAMES


def _merged(model: nn.Module, module: str, parts: list, db: Tensor | None) -> dict[str, Tensor]:
    """The state of the linear ``module`` with its LoRA pieces ``(B, A)`` and bias change ``db`` added."""
    state = {
        n: offload.value(model, f"{module}.{n}", t).detach().to(torch.float64)
        for n, t in model.get_submodule(module).state_dict(keep_vars=True).items()
    }
    for b, a in parts:
        ba = b.to(torch.float64).cpu() @ a.to(torch.float64).cpu()  # [out, in]
        state["weight"] = state["weight"] + (ba if weight_layout(model.get_submodule(module)) == "out_in" else ba.T)
    if db is not None:
        state["bias"] = state["bias"] + db.to(torch.float64).cpu()
    return state


def _features(model: nn.Module, module: str) -> tuple[int, int]:
    """``(out, in)`` of a LoRA target, from its weight and layout."""
    mod = model.get_submodule(module)
    rows, cols = mod.weight.shape
    return (rows, cols) if weight_layout(mod) == "out_in" else (cols, rows)


def _write_folder(folder: Path, contents: dict[str, bytes]) -> None:
    """Write every file into a hidden sibling folder, then rename it into place (an interrupted
    export leaves no half adapter); an existing empty ``folder`` is replaced by the complete one."""
    tmp = folder.parent / f".{folder.name}.{secrets.token_hex(6)}.tmp"
    tmp.mkdir()
    try:
        for name, data in contents.items():
            write_new(tmp / name, data)
        if folder.exists():
            folder.rmdir()  # empty (checked); a file that appeared meanwhile makes this fail, nothing lost
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
