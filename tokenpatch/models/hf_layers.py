"""Contextual layers taken from ``transformers``: the token mixers of 2026's attention, recurrent and
hybrid language models, each built from its model's config and run as the ``A`` of our blocks.

Our linear-regression model (``icl.ICLTransformer``) then differs from the shipped toy models only in
its mixer, and the mixer is the code those models run (``docs/dynamics.md``, section 5):

    kind             transformers module               the mixer, per head, from a zero state
    llama            LlamaAttention (+ rotary)         softmax attention, rotary positions
    gated_deltanet   Qwen3NextGatedDeltaNet            S_t = e^{g_t} S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t
    mamba2           Mamba2Mixer                       h_t = e^{dt_t A} h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t
    rg_lru           RecurrentGemmaRecurrentBlock      h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)
    short_conv       Lfm2ShortConv                     y_t = C_t * sum_{j<3} w_j * (B x)_{t-j}

(The recurrent ones also have a short causal convolution before the scan and an output gate, as in
their models.) A token alone is a sequence of length one: attention's ``o_proj(v)``, one recurrence
step from the zero state, the convolution's last tap. ``transformers`` is imported when one of these
layers is built (``pip install "tokenpatch[hf]"``); the toy layers of ``layers.py`` never need it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import ClassVar

import torch
from torch import Tensor

from tokenpatch.errors import InputError
from tokenpatch.float64_mode import float64_everywhere
from tokenpatch.models.layers import ContextualLayer

__all__ = ["HF_LAYERS", "HF_LAYER_NAMES", "make_hf_layer"]


def _transformers(module: str):
    try:
        return importlib.import_module(f"transformers.models.{module}")
    except ImportError as exc:
        raise InputError(
            f"this contextual layer is transformers' own code: pip install 'tokenpatch[hf]' ({exc})"
        ) from exc


class _HFMixer(ContextualLayer):
    """A ``transformers`` mixer module (``self.mixer``) as a contextual layer of width ``d_model``,
    initialised as its model initialises it: ``_init_weights`` of the model's ``PreTrainedModel`` class
    on every submodule, as ``post_init`` does for a whole model (some mixers leave their parameters
    uninitialised until then: RG-LRU's gates and decay)."""

    module: ClassVar[str]  # transformers.models.<module>.modeling_<module>
    pretrained: ClassVar[str]  # the PreTrainedModel class of that module

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise InputError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        m = _transformers(f"{self.module}.modeling_{self.module}")
        config, self.mixer = self.build(m, d_model, n_heads, d_model // n_heads)
        cls = getattr(m, self.pretrained)
        holder = cls.__new__(cls)  # _init_weights reads only the config of its model
        object.__setattr__(holder, "config", config)
        with torch.no_grad():
            for sub in self.modules():
                cls._init_weights(holder, sub)

    def build(self, m, d_model: int, n_heads: int, head_dim: int):
        """``(config, mixer module)``."""
        raise NotImplementedError

    def forward(self, h: Tensor) -> Tensor:
        """``[B, T, d] -> [B, T, d]``; float64 inputs computed in float64 throughout (``float64_everywhere``:
        the chunked scans cast to float32 whatever the input), so that a prefix run alone and inside a
        longer sequence agree to float64 rounding."""
        with float64_everywhere() if h.dtype == torch.float64 else contextlib.nullcontext():
            return self.run(h)

    def run(self, h: Tensor) -> Tensor:
        return self.mixer(h)  # [B, T, d]


class LlamaLayer(_HFMixer):
    """Llama's attention: rotary queries and keys (positions ``0..T-1``), causal softmax, ``o_proj``."""

    kind, module, pretrained = "llama", "llama", "LlamaPreTrainedModel"

    def build(self, m, d_model, n_heads, head_dim):
        c = m.LlamaConfig(
            hidden_size=d_model,
            num_attention_heads=n_heads,
            num_key_value_heads=n_heads,
            head_dim=head_dim,
            attn_implementation="sdpa",  # causal when no mask is given
        )
        self.rotary = m.LlamaRotaryEmbedding(c)
        return c, m.LlamaAttention(c, layer_idx=0)

    def run(self, h: Tensor) -> Tensor:
        positions = torch.arange(h.shape[1], device=h.device)[None]  # [1, T]
        return self.mixer(h, position_embeddings=self.rotary(h, positions), attention_mask=None)[0]


class GatedDeltaNetLayer(_HFMixer):
    """Qwen3-Next's (and Qwen3.5's) Gated DeltaNet: a gated delta-rule scan over L2-normed keys."""

    kind, module, pretrained = "gated_deltanet", "qwen3_next", "Qwen3NextPreTrainedModel"

    def build(self, m, d_model, n_heads, head_dim):
        c = m.Qwen3NextConfig(
            hidden_size=d_model,
            linear_num_key_heads=n_heads,
            linear_num_value_heads=n_heads,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_conv_kernel_dim=4,
        )
        return c, m.Qwen3NextGatedDeltaNet(c, layer_idx=0)


class Mamba2Layer(_HFMixer):
    """Mamba 2's selective state-space scan (two value heads per ``n_heads``, state size 16)."""

    kind, module, pretrained = "mamba2", "mamba2", "Mamba2PreTrainedModel"

    def build(self, m, d_model, n_heads, head_dim):
        c = m.Mamba2Config(
            hidden_size=d_model,
            num_heads=2 * n_heads,  # expand 2: the inner width 2 d_model in heads of head_dim
            head_dim=head_dim,
            state_size=16,
            expand=2,
            n_groups=1,
            chunk_size=32,
        )
        return c, m.Mamba2Mixer(c, layer_idx=0)


class RGLRULayer(_HFMixer):
    """RecurrentGemma's recurrent block: convolution, real-gated linear recurrence, GeLU output gate."""

    kind, module, pretrained = "rg_lru", "recurrent_gemma", "RecurrentGemmaPreTrainedModel"

    def build(self, m, d_model, n_heads, head_dim):
        c = m.RecurrentGemmaConfig(hidden_size=d_model, lru_width=d_model, num_attention_heads=n_heads, conv1d_width=4)
        return c, m.RecurrentGemmaRecurrentBlock(c, layer_idx=0)

    def run(self, h: Tensor) -> Tensor:
        positions = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)  # [B, T]
        return self.mixer(h, position_ids=positions, attention_mask=None, use_cache=False)[0]


class ShortConvLayer(_HFMixer):
    """LFM2's gated short convolution: ``out_proj(C * conv(B * x))``, kernel 3, no recurrence."""

    kind, module, pretrained = "short_conv", "lfm2", "Lfm2PreTrainedModel"

    def build(self, m, d_model, n_heads, head_dim):
        c = m.Lfm2Config(hidden_size=d_model, conv_L_cache=3, conv_bias=False)
        return c, m.Lfm2ShortConv(c, layer_idx=0)


HF_LAYERS: dict[str, type[_HFMixer]] = {
    cls.kind: cls for cls in (LlamaLayer, GatedDeltaNetLayer, Mamba2Layer, RGLRULayer, ShortConvLayer)
}
HF_LAYER_NAMES = {
    "llama": "Llama-attention",
    "gated_deltanet": "Gated-DeltaNet",
    "mamba2": "Mamba-2",
    "rg_lru": "RG-LRU",
    "short_conv": "short-convolution",
}


def make_hf_layer(kind: str, d_model: int, n_heads: int) -> ContextualLayer:
    """Build the ``transformers`` mixer named ``kind`` (one of ``HF_LAYERS``); the slow-kernel notices of
    ``transformers`` (no CUDA kernels on this machine: the reference PyTorch scans run) are silenced."""
    if kind not in HF_LAYERS:
        raise InputError(f"unknown transformers mixer {kind!r}; choose one of {sorted(HF_LAYERS)}")
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return HF_LAYERS[kind](d_model, n_heads)
    finally:
        quiet.setLevel(level)
