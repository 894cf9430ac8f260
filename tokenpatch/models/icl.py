"""Our in-context-learning transformer, read top to bottom.

    inputs [B, T, d_in] --read_in--> h^0 --block_1--> h^1 ... --block_L--> h^L --ln_f--> read_out

Each ``Block`` is a contextual block (``docs/patch-theorem.md``, ``docs/deep-models.md``) with one of the
contextual layers of ``layers.py`` (ours) or ``hf_layers.py`` (``transformers``' own mixers; a hybrid
alternates two, ``ICLConfig.interleave``) as its mixer and a two-layer MLP
``MLP(s) = fc_out(act(fc_in(s)))``. Norm placement and the residual are options::

    norm   residual  mixer part (m: value the MLP output is added to; s: MLP input)   output y
    none   on        m = h + A(h)                 s = m                               m + MLP(s)
    none   off       m = A(h)                     s = m                               MLP(s)
    pre    on        m = h + A(LN1(h))            s = LN2(m)                          m + MLP(s)
    pre    off       m = A(LN1(h))                s = LN2(m)                          MLP(s)
    post   on        m = LN1(h + A(h))            s = m                               LN2(m + MLP(s))
    post   off       m = LN1(A(h))                s = m                               LN2(MLP(s))

The residual-free, norm-free block is exactly the paper's ``T_W(C, x) = f(W A(C, x) + b)`` with
``W, b = fc_in`` and ``f = fc_out . act``. ``Block.mix`` returns ``(m, s)`` and ``Block.finish``
the rest, which is all the patch algorithm needs to know about a block. (A bare ``Block`` uses
only ``d_model``, ``n_heads``, ``d_mlp``, ``layer``, ``norm``, ``residual``, ``bias`` and
``activation`` of its config.)

Checkpoints are safetensors files with the config as JSON metadata (``save_model`` /
``load_model``); ``load_model()`` with no path returns the checkpoint shipped in the package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tokenpatch import files
from tokenpatch.errors import FileFormatError, InputError
from tokenpatch.models.hf_layers import HF_LAYER_NAMES, HF_LAYERS, make_hf_layer
from tokenpatch.models.layers import LAYERS, make_layer
from tokenpatch.models.placement import as_device, as_dtype
from tokenpatch.solve import block_values

__all__ = [
    "ICLConfig",
    "MLP",
    "Block",
    "ICLTransformer",
    "save_model",
    "load_model",
    "read_checkpoint",
    "DEFAULT_CHECKPOINT",
    "SHIPPED",
    "SHIPPED_TRANSFORMERS",
    "MODEL_FORMAT",
]

MODEL_FORMAT = "tokenpatch.model/1"
DEFAULT_CHECKPOINT = "linreg-pre10.safetensors"
# Shipped checkpoints (tokenpatch/models/data/), one per contextual layer: the same recipe, only the layer differs.
SHIPPED = {
    "softmax": DEFAULT_CHECKPOINT,
    **{k: f"linreg-{k}-pre10.safetensors" for k in ("linear", "rnn", "gru", "lstm")},
}
# Shipped models whose mixers are transformers' own (hf_layers.py; workbench.train.kinds has the recipe).
SHIPPED_TRANSFORMERS = {
    k: f"linreg-tf-{k}.safetensors" for k in ("llama", "deltanet", "mamba2", "rg_lru", "short_conv", "hybrid")
}
NORMS = ("none", "pre", "post")
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}
LAYER_NAMES = {
    "softmax": "softmax-attention",
    "linear": "linear-attention",
    "rnn": "Elman-RNN",
    "gru": "GRU",
    "lstm": "LSTM",
    **HF_LAYER_NAMES,
}
MIXERS = (*LAYERS, *HF_LAYERS)  # every contextual layer kind: ours (layers.py), then transformers' (hf_layers.py)


@dataclass(frozen=True)
class ICLConfig:
    """Shape of an ``ICLTransformer`` (or of one ``Block`` when ``n_layers == 1``)."""

    d_in: int  # token width, D + 1 for linear regression
    d_out: int = 1  # prediction width
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_mlp: int = 0  # 0 means 4 * d_model
    layer: str = "softmax"  # one of MIXERS
    norm: str = "pre"  # none | pre | post
    residual: bool = True
    bias: bool = True
    activation: str = "gelu"
    mlp: bool = True  # False: attention-only blocks, y = h + A(LN1(h)) (no token patch: nothing to act on)
    interleave: str = ""  # a hybrid: this kind (one of MIXERS) in every ``interval``-th layer, as Qwen3.5 does
    interval: int = 0

    def __post_init__(self) -> None:
        for name in ("d_in", "d_out", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"ICLConfig.{name} must be a positive integer, got {value!r}")
        if self.d_mlp < 0:
            raise InputError(f"ICLConfig.d_mlp must be >= 0, got {self.d_mlp}")
        for name in ("layer", "interleave") if self.interleave else ("layer",):
            if getattr(self, name) not in MIXERS:
                raise InputError(f"ICLConfig.{name}={getattr(self, name)!r}; choose one of {sorted(MIXERS)}")
        if bool(self.interleave) != (self.interval > 0):
            raise InputError(
                "a hybrid ICLConfig needs both interleave (a layer kind) and interval (a positive integer)"
            )
        if self.norm not in NORMS:
            raise InputError(f"ICLConfig.norm={self.norm!r}; choose one of {NORMS}")
        if self.activation not in ACTIVATIONS:
            raise InputError(f"ICLConfig.activation={self.activation!r}; choose one of {sorted(ACTIVATIONS)}")
        if not self.mlp and (self.norm == "post" or not self.residual):
            raise InputError("an attention-only model (mlp=False) needs the residual stream and norm 'pre' or 'none'")
        kinds = (self.layer, self.interleave) if self.interleave else (self.layer,)
        if any(k not in ("rnn", "gru", "lstm") for k in kinds) and self.d_model % self.n_heads:  # headed layers
            raise InputError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def hidden(self) -> int:
        return self.d_mlp or 4 * self.d_model

    def kind(self, i: int) -> str:
        """The contextual layer kind of block ``i``: ``interleave`` in blocks ``interval - 1``,
        ``2 interval - 1``, ..., ``layer`` elsewhere."""
        return self.interleave if self.interval and (i + 1) % self.interval == 0 else self.layer

    def describe(self) -> str:
        """E.g. ``"10-layer Pre-LN softmax-attention transformer"``."""
        norm = {"none": "norm-free", "pre": "Pre-LN", "post": "Post-LN"}[self.norm]
        mixer = LAYER_NAMES[self.layer]
        kind = "transformer" if self.layer in ("softmax", "linear", "llama") else "network"
        res = "" if self.residual else " residual-free"
        only = "" if self.mlp else " (attention-only)"
        every = f", {LAYER_NAMES[self.interleave]} in one block of every {self.interval}" if self.interval else ""
        return f"{self.n_layers}-layer {norm}{res} {mixer} {kind}{only}{every}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; ``mlp`` only when False, so every file written before it existed
        (checkpoints, training recipes) reads and resumes unchanged."""
        d = dataclasses.asdict(self)
        for name, default in (("mlp", True), ("interleave", ""), ("interval", 0)):
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ICLConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise InputError(f"unknown ICLConfig fields {sorted(unknown)}")
        return cls(**d)


class MLP(nn.Module):
    """``MLP(s) = fc_out(act(fc_in(s)))``; ``fc_in`` is the paper's ``W, b``."""

    def __init__(self, d_model: int, hidden: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        self.fc_in = nn.Linear(d_model, hidden, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.fc_out = nn.Linear(hidden, d_model, bias=bias)

    def hidden(self, s: Tensor) -> Tensor:
        return self.act(self.fc_in(s))  # [B, T, hidden]

    def forward(self, s: Tensor) -> Tensor:
        return self.fc_out(self.hidden(s))  # [B, T, d]


class Block(nn.Module):
    """One contextual block; see the table in the module docstring."""

    def __init__(self, config: ICLConfig, layer: str | None = None):
        super().__init__()
        c = self.config = config
        self.norm, self.residual = c.norm, c.residual
        if c.norm != "none":
            self.ln1 = nn.LayerNorm(c.d_model)
            self.ln2 = nn.LayerNorm(c.d_model)
        kind = layer or c.layer
        if kind in HF_LAYERS:
            self.mixer = make_hf_layer(kind, c.d_model, c.n_heads)
        else:
            self.mixer = make_layer(kind, c.d_model, c.n_heads, bias=c.bias)
        self.mlp = MLP(c.d_model, c.hidden, c.activation, bias=c.bias) if c.mlp else None

    def mix(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """``(m, s)`` from the block input ``h`` [B, T, d]."""
        return self.combine(h, self.mixer(self.mixer_input(h)))

    def mixer_input(self, h: Tensor) -> Tensor:
        return self.ln1(h) if self.norm == "pre" else h

    def combine(self, h: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """``(m, s)`` from the block input ``h`` and the mixer output ``a`` (position by position)."""
        return block_values(self.norm, self.residual, h, a, getattr(self, "ln1", None), getattr(self, "ln2", None))

    def finish(self, m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        """``(hidden, out)`` from ``(m, s)``; an attention-only block's output is ``m`` (no hidden units)."""
        if self.mlp is None:
            return m[..., :0], m
        hidden = self.mlp.hidden(s)
        y = self.mlp.fc_out(hidden)
        if self.residual:
            y = m + y
        if self.norm == "post":
            y = self.ln2(y)
        return hidden, y

    def forward(self, h: Tensor) -> Tensor:
        return self.finish(*self.mix(h))[1]


class ICLTransformer(nn.Module):
    """``read_out(ln_f(block_L(...block_1(read_in(inputs)))))``; no positional encoding.

    ``forward(inputs [B, T, d_in]) -> [B, T, d_out]``; with ``return_hidden=True`` also the
    list of block outputs ``h^1..h^L`` (each [B, T, d_model]). ``ln_f`` exists for Pre-LN only.
    """

    def __init__(self, config: ICLConfig):
        super().__init__()
        self.config = config
        self.read_in = nn.Linear(config.d_in, config.d_model, bias=config.bias)
        self.blocks = nn.ModuleList(Block(config, config.kind(i)) for i in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model) if config.norm == "pre" else nn.Identity()
        self.read_out = nn.Linear(config.d_model, config.d_out, bias=config.bias)
        self.meta: dict[str, Any] = {}  # filled by load_model from the checkpoint

    def forward(self, inputs: Tensor, return_hidden: bool = False):
        h = self.read_in(inputs)  # [B, T, d_model]
        hidden = []
        for block in self.blocks:
            h = block(h)
            hidden.append(h)
        out = self.read_out(self.ln_f(h))  # [B, T, d_out]
        return (out, hidden) if return_hidden else out


# ----------------------------------------------------------------------------- checkpoints


def save_model(model: ICLTransformer, path, meta: dict | None = None, extra: dict[str, Tensor] | None = None):
    """Write ``model`` to ``path`` (safetensors; config, fingerprint and ``meta`` as JSON).

    ``extra`` tensors (optimizer state of a training run) are stored under ``train.<name>``.
    """
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update({f"train.{k}": v for k, v in (extra or {}).items()})
    doc = {
        "class": type(model).__name__,
        "config": model.config.to_dict(),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "fingerprint": files.fingerprint(model),
        "meta": meta or {},
    }
    return files.write_file(path, tensors, MODEL_FORMAT, doc)


def read_checkpoint(path) -> tuple[ICLTransformer, dict[str, Any], dict[str, Tensor]]:
    """``(model, meta, extra)`` from a file written by ``save_model``; clear errors otherwise."""
    tensors, doc = files.read_file(path, MODEL_FORMAT)
    if doc.get("class") != ICLTransformer.__name__:
        raise FileFormatError(f"{path} holds a {doc.get('class')!r}, not an ICLTransformer")
    try:
        config = ICLConfig.from_dict(doc["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FileFormatError(f"{path}: invalid model config: {exc}") from exc
    model = ICLTransformer(config)
    state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise FileFormatError(f"{path} does not match its config: missing {missing}, unexpected {unexpected}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise FileFormatError(
                f"{path}: {name} has shape {tuple(t.shape)}, config needs {tuple(expected[name].shape)}"
            )
    model = model.to(state[next(iter(state))].dtype)
    model.load_state_dict(state)
    model.meta = doc.get("meta", {})
    extra = {k.removeprefix("train."): v for k, v in tensors.items() if k.startswith("train.")}
    return model.eval(), doc, extra


def load_model(
    path=None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    *,
    layer: str | None = None,
) -> ICLTransformer:
    """Load a checkpoint (default: one shipped with tokenpatch) in eval mode.

    ``path``: a file written by ``save_model`` / ``tokenpatch train``; without it, the shipped model
    whose contextual layer is ``layer`` (``SHIPPED``; default ``"softmax"``): 10-layer Pre-LN
    ``ICLTransformer`` models trained on in-context linear regression with one recipe, only the
    layer differing (``tokenpatch train --layer ...`` retrains them). ``dtype``: a torch dtype or its
    name (``"float64"``, ``"float16"``, ...); ``device``: e.g. ``"cpu"``, ``"cuda:0"``.
    ``model.meta`` holds the task, the training record and the evaluation.
    """
    dtype, device = as_dtype(dtype), as_device(device)
    if path is not None and layer is not None:
        raise InputError("give a checkpoint path or a shipped model's layer, not both")
    if path is None:
        layer, shipped = layer or "softmax", {**SHIPPED, **SHIPPED_TRANSFORMERS}
        if layer not in shipped:
            raise InputError(f"no shipped model with layer {layer!r}; shipped: {sorted(shipped)}")
        ref = resources.files("tokenpatch.models") / "data" / shipped[layer]
        with resources.as_file(ref) as p:
            model = read_checkpoint(Path(p))[0]
    else:
        model = read_checkpoint(path)[0]
    return model.to(device=device, dtype=dtype)


def check_inputs(model: ICLTransformer | Block, inputs: Tensor) -> Tensor:
    """Raise ``InputError`` unless ``inputs`` is a finite float tensor [B, T, d] for ``model``."""
    if not isinstance(inputs, Tensor):
        raise InputError(f"inputs must be a torch.Tensor [batch, pos, d], got {type(inputs).__name__}")
    if inputs.ndim != 3:
        raise InputError(f"inputs must have shape [batch, pos, d], got {tuple(inputs.shape)}")
    width = model.config.d_in if isinstance(model, ICLTransformer) else model.config.d_model
    if inputs.shape[-1] != width:
        raise InputError(f"inputs have width {inputs.shape[-1]}, the model reads width {width}")
    if inputs.shape[0] == 0 or inputs.shape[1] == 0:
        raise InputError(f"inputs are empty: shape {tuple(inputs.shape)}")
    dtype = next(model.parameters()).dtype
    if inputs.dtype != dtype:
        raise InputError(f"inputs are {inputs.dtype} but the model computes in {dtype}; cast with .to({dtype})")
    if not torch.isfinite(inputs).all():
        bad = (~torch.isfinite(inputs)).nonzero()[0].tolist()
        raise InputError(f"inputs contain NaN or inf (first at [batch, pos, feature] = {bad})")
    return inputs
