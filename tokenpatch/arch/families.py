"""Hugging Face block designs as data: one ``Family`` record per design.

The adapter (``arch.hf``) changes the MLP input of every layer once (``Sites.input_site``), which
covers every parameter reading it, so it needs to know only where ``m``, ``s`` and ``hidden`` are
read and where the output side goes; that is the ``Family`` record. The five forms
(``docs/hugging-face.md``, "Block designs", with every ``model_type`` and its measured error):

* sequential, a norm before the MLP (``llama`` and its kin, ``gpt2``, ``gpt_neo``, ``phi3``, ``olmo``,
  ``starcoder2``, ``opt``, ``biogpt``, ``bloom``, ``mpt``, sequential ``gpt_neox`` and ``falcon``;
  ``opt_post``, OPT-350m, norms after each add instead, which the same two terms pass through): the
  input change on the MLP's input; the output shift ``m_C - m_0`` in the output bias, else a rank-1
  patch of the output matrix;
* a residual multiplier (``granite``, ``minicpm3``): the block adds ``r * MLP(s)``, so the shift is divided by
  ``r`` (``OutputSite.scale``);
* a norm after the MLP (``gemma2``: Gemma 2/3, scale ``1 + w``; ``glm4``, scale ``w``; ``olmo2``: OLMo
  2/3 and EXAONE 4, scale ``w``, and no norm before the MLP, ``s = m``): a rank-1 output-matrix patch and a dense patch
  of the norm's scale (``solve.output_patch_scaled``, zero-scale channels included);
* parallel (``gpt_neox`` by default, ``phi``, ``gptj``, ``codegen``, ``cohere``, ``stablelm_parallel``,
  Falcon's ``falcon_parallel`` and ``falcon_ln_mlp``): the MLP reads a norm of the layer input, the same in both
  passes, so there is no input change; the whole attention difference is the output shift;
* mixture of experts: the router and every expert read the input change (the same experts are
  chosen, with the same weights); the output shift goes into a shared expert's ``down_proj``
  (``arch.shared_experts``: divided by its sigmoid gate where it has one), or, without one, into the
  chosen experts' ``down_proj``, split in proportion to their routing weights (``arch.routed_experts``,
  ``arch.experts``); blocks that place these parts otherwise (a shared MLP beside the experts block,
  Llama 4's, AFMoE's norm after the block, MiniMax-M3's): ``arch.moe_blocks``.

A multimodal model whose text decoder is one of these (Gemma 3's ``Gemma3ForConditionalGeneration``, the
4B and larger checkpoints) is patched on text as its decoder: its layers are under ``language_model``, its
fields read from its text config (``arch.hf_modules.text_config``).

An attention that does more than mix values (sinks, a gate on its output, latent attention, a norm
before ``o_proj``) names no ``value``: a token alone runs the layer. The hybrid and recurrent designs
are in ``arch.recurrent``; the sequential form under other names (CTRL, XGLM, GPT-NeoX Japanese,
ModernBERT decoder) in ``arch.renamed``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tokenpatch.arch.family import PARALLEL, SELF_ATTN_QK, Family
from tokenpatch.arch.moe_blocks import MOE_BLOCKS
from tokenpatch.arch.recurrent import HYBRIDS, RECURRENT
from tokenpatch.arch.renamed import RENAMED
from tokenpatch.arch.routed_experts import ROUTED_EXPERTS
from tokenpatch.arch.shared_experts import SHARED_EXPERTS

__all__ = ["Family", "FAMILIES"]


_GATED = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
# Llama's block; the other designs below are written as what differs from it (or from Falcon's).
_LLAMA = Family(
    name="llama",
    model_types=(
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "cwm",
        "emu3",  # Emu3's text decoder (Emu3ForCausalLM, its config emu3_text_model)
        "emu3_text_model",
        "ernie4_5",
        "exaone",
        "helium",
        "hunyuan_v1_dense",
        "internlm3",
        "iquestcoder",
        "ministral",
        "ministral3",
        "seed_oss",
        "smollm3",
    ),
    mlp_norm="post_attention_layernorm",
    inputs=_GATED,
    down="mlp.down_proj",
    lone_zero=SELF_ATTN_QK,
    value="self_attn.v_proj",
)
_FALCON = Family(  # sequential (parallel_attn=False); its query, key and value are one fused matrix
    name="falcon",
    model_types=("falcon",),
    layers="h",
    mlp_norm="post_attention_layernorm",
    attn="self_attention",
    inputs=("mlp.dense_h_to_4h.weight",),
    down="mlp.dense_4h_to_h",
    o_proj="self_attention.dense",
    when=lambda c: not c.parallel_attn and not c.new_decoder_architecture,
)
_GPT2 = Family(
    name="gpt2",
    model_types=("gpt2", "gpt_bigcode", "gpt-sw3"),  # GPT-SW3: GPT2Config, its model_type kept from config.json
    layers="h",
    mlp_norm="ln_2",
    attn="attn",
    inputs=("mlp.c_fc.weight",),
    down="mlp.c_proj",
    o_proj="attn.c_proj",
    position_table="wpe",
)
_GPT1 = replace(  # GPT-1: GPT-2's names, norms after each residual add (OPT-350m's form)
    _GPT2,
    name="openai_gpt",
    model_types=("openai-gpt",),
    mlp_norm=None,
    post_add_norms=("ln_1", "ln_2"),
    position_table="positions_embed",
)
_GPTJ = Family(
    name="gptj",
    model_types=("gptj",),
    layers="h",
    mlp_norm="ln_1",
    attn="attn",
    inputs=("mlp.fc_in.weight",),
    down="mlp.fc_out",
    parallel=lambda config: True,
    lone_zero=("attn.q_proj", "attn.k_proj"),
    o_proj="attn.out_proj",
    value="attn.v_proj",
)
# Persimmon: NeoX's names in Llama's block (fused query, key and value; q/k norms)
_PERSIMMON = replace(
    _LLAMA,
    name="persimmon",
    model_types=("persimmon",),
    inputs=("mlp.dense_h_to_4h.weight",),
    down="mlp.dense_4h_to_h",
    o_proj="self_attn.dense",
    lone_zero=(),
    value=None,
)
FAMILIES: list[Family] = [
    _LLAMA,
    # Llama's block whose attention does more than mix values (BitNet: a norm before o_proj; DiffLlama:
    # differential attention): a token alone runs the layers
    replace(_LLAMA, name="llama_attention", model_types=("bitnet", "diffllama"), value=None),
    # Gemma 2/3: a norm after the attention and after the MLP (patched in its scale), another before it
    replace(
        _LLAMA,
        name="gemma2",
        model_types=("gemma2", "gemma3_text"),
        mlp_norm="pre_feedforward_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        post_attn_norm="post_attention_layernorm",
    ),
    _GPT2,
    _GPT1,
    Family(
        name="gpt_neox",
        model_types=("gpt_neox",),
        mlp_norm="post_attention_layernorm",
        attn="attention",
        inputs=("mlp.dense_h_to_4h.weight",),
        down="mlp.dense_4h_to_h",
        parallel=lambda config: bool(getattr(config, "use_parallel_residual", False)),
        o_proj="attention.dense",
    ),
    # Llama's block under other names or with other details that change nothing for the patch:
    # a fused gate_up_proj (Phi-3; the input change covers it), norms without parameters (OLMo),
    # LayerNorm with biases (StableLM), biases and a plain MLP (StarCoder 2); and Granite, whose
    # residual_multiplier scales each sublayer's output: the output shift is divided by it.
    replace(
        _LLAMA, name="phi3", model_types=("phi3", "glm"), inputs=("mlp.gate_up_proj.weight",), lone_zero=(), value=None
    ),
    replace(
        _LLAMA,
        name="olmo",
        model_types=("olmo", "stablelm"),
        when=lambda config: not getattr(config, "use_parallel_residual", False),
    ),
    replace(_LLAMA, name="starcoder2", model_types=("starcoder2",), inputs=("mlp.c_fc.weight",), down="mlp.c_proj"),
    replace(
        _LLAMA, name="granite", model_types=("granite",), out_scale=lambda config: float(config.residual_multiplier)
    ),
    # HyperCLOVA X: Gemma 2's four norms and Granite's multipliers, the output norm's scale patched where
    # the residual multiplier is 1 (a multiplier beside a norm after the MLP is not supported yet)
    replace(
        _LLAMA,
        name="hyperclovax",
        model_types=("hyperclovax",),
        post_attn_norm="post_norm1",
        post_mlp_norm="post_norm2",
        out_scale=lambda config: float(config.residual_multiplier),
        when=lambda config: float(config.residual_multiplier) == 1.0,
    ),
    # Granite with attention sinks (a learned logit per head in every softmax): a token alone's attention
    # weight on itself is sigmoid(q.k - sink), so its query and key are needed and it runs the layers
    replace(
        _LLAMA,
        name="granite_swa",
        model_types=("granite_swa",),
        out_scale=lambda config: float(config.residual_multiplier),
        lone_zero=(),
        value=None,
    ),
    # Norms after the sublayers (OLMo 2 and 3, EXAONE 4): the MLP reads the residual stream itself
    # (s = m), and a norm between the MLP and the residual add is patched in its scale, as Gemma 2/3's.
    replace(
        _LLAMA,
        name="olmo2",
        model_types=("olmo2", "olmo3", "exaone4"),
        mlp_norm=None,
        post_mlp_norm="post_feedforward_layernorm",
        post_attn_norm="post_attention_layernorm",
    ),
    # GLM-4: Gemma 2's four norms (scale w) around Phi-3's fused gate_up_proj
    replace(
        _LLAMA,
        name="glm4",
        model_types=("glm4",),
        inputs=("mlp.gate_up_proj.weight",),
        post_mlp_norm="post_mlp_layernorm",
        post_attn_norm="post_self_attn_layernorm",
    ),
    # Parallel blocks: attention and MLP both read the norm of the layer input (Phi, GPT-J, Cohere and
    # Cohere Compass's text decoder (M-RoPE), StableLM with use_parallel_residual, Falcon), so the MLP input
    # is the same in both passes and the whole attention difference goes to the output side, as in NeoX.
    replace(
        _LLAMA,
        name="phi",
        model_types=("phi",),
        inputs=("mlp.fc1.weight",),
        down="mlp.fc2",
        o_proj="self_attn.dense",
        **PARALLEL,
    ),
    _GPTJ,
    replace(_LLAMA, name="cohere", model_types=("cohere", "cohere2", "cohere_compass_text"), **PARALLEL),
    replace(
        _LLAMA,
        name="stablelm_parallel",
        model_types=("stablelm",),
        when=lambda config: config.use_parallel_residual,
        **PARALLEL,
    ),
    # Falcon, three designs by config: a separate norm for the MLP (the new decoder architecture with
    # two norms), one norm for both (parallel attention), or the sequential block.
    replace(
        _FALCON,
        name="falcon_ln_mlp",
        mlp_norm="ln_mlp",
        parallel=lambda config: True,
        when=lambda c: c.new_decoder_architecture and c.parallel_attn and c.num_ln_in_parallel_attn in (None, 2),
    ),
    replace(
        _FALCON,
        name="falcon_parallel",
        **PARALLEL,
        when=lambda c: c.parallel_attn and (not c.new_decoder_architecture or c.num_ln_in_parallel_attn == 1),
    ),
    _FALCON,
    # OPT, and OPT-350m's norms after each add (m = N(h + a) = s; the layer outputs N'(m + MLP(m)))
    # Llama's block with a two-matrix MLP: ReLU^2 (Arcee, Nemotron, Jais 2), xIELU (Apertus, its norms
    # named for their sublayers), NanoChat's fc1/fc2; VaultGemma (Gemma's names, no norms after); MiniCPM 3
    # (latent attention: the layers run a token alone; each sublayer scaled by scale_depth / sqrt(L))
    replace(_LLAMA, name="up_down", model_types=("arcee", "nemotron", "jais2"), inputs=("mlp.up_proj.weight",)),
    replace(
        _LLAMA,
        name="apertus",
        model_types=("apertus", "apertus1p5_text"),
        mlp_norm="feedforward_layernorm",
        inputs=("mlp.up_proj.weight",),
    ),
    replace(_LLAMA, name="nanochat", model_types=("nanochat",), inputs=("mlp.fc1.weight",), down="mlp.fc2"),
    replace(_LLAMA, name="vaultgemma", model_types=("vaultgemma",), mlp_norm="pre_feedforward_layernorm"),
    replace(
        _LLAMA,
        name="minicpm3",
        model_types=("minicpm3",),
        lone_zero=(),
        value=None,
        out_scale=lambda c: c.scale_depth / math.sqrt(c.num_hidden_layers),
    ),
    _PERSIMMON,
    # GPT-Neo: GPT-2's block and positions with linear layers (global and local attention layers)
    replace(
        _GPT2,
        name="gpt_neo",
        model_types=("gpt_neo",),
        lone_zero=("attn.attention.q_proj", "attn.attention.k_proj"),
        o_proj="attn.attention.out_proj",
        value="attn.attention.v_proj",
    ),
    # CodeGen: GPT-J's parallel block with a fused query, key and value
    replace(_GPTJ, name="codegen", model_types=("codegen",), lone_zero=(), o_proj="attn.out_proj", value=None),
    *RENAMED,
    *ROUTED_EXPERTS,
    *SHARED_EXPERTS,
    *MOE_BLOCKS,
    *HYBRIDS,
    *RECURRENT,
]

# Multimodal models run on text: their decoder's record (by its ``model_type``), its layers under
# ``language_model``; every field read from the text config inside (``hf_modules.text_config``)
MULTIMODAL = {
    "gemma3": "gemma3_text",  # Gemma 3 4B and up (Gemma3ForConditionalGeneration)
    "fuyu": "persimmon",
    "got_ocr2": "qwen2",  # GOT-OCR 2
    "moss_transcribe_diarize": "qwen3",  # MOSS transcribe
}
FAMILIES += [
    replace(
        next(f for f in FAMILIES if text in f.model_types),
        name=kind,
        model_types=(kind,),
        layers="language_model.layers",
    )
    for kind, text in MULTIMODAL.items()
]
