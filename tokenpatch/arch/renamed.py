"""The sequential form (a norm before the MLP, ``arch.families``) under other module names: OPT (no MLP
module; BioGPT, and OPT-350m's norms after each add), Bloom and MPT (modules that add the residual
themselves), CTRL and XGLM
(GPT-2's and OPT's blocks with sinusoidal absolute positions), GPT-NeoX Japanese and the ModernBERT
decoder; and Doge, Llama's names with learned per-channel weights of the residual stream at each add.

Sinusoidal positions are absolute, as GPT-2's learned table: a token alone at position ``p`` is not the
same token at position 0, so these records name their table (``Family.position_table``) and the patch's
forward must be given the plan's position ids (``HFInputs.check_positions``); CTRL's is a buffer of
``n_positions`` rows, XGLM's grows to any position (no limit).
"""

from __future__ import annotations

from dataclasses import replace

from tokenpatch.arch.family import SELF_ATTN_QK, Family

__all__ = ["RENAMED"]

_OPT = Family(  # no MLP module (fc1, fc2 run on [batch * positions, d]); learned positions offset by 2
    name="opt",
    model_types=("opt",),
    layers="decoder.layers",
    mlp_norm="final_layer_norm",
    inputs=("fc1.weight",),
    down="fc2",
    mlp="fc1",
    matrices_out=True,
    lone_zero=SELF_ATTN_QK,
    o_proj="self_attn.out_proj",
    position_table="decoder.embed_positions",
    value="self_attn.v_proj",
    when=lambda config: config.do_layer_norm_before,
)
# Bloom: the attention and the MLP modules add the residual themselves (their contributions are
# o_proj's and down's outputs); ALiBi positions; fused query, key and value. Configs whose residual is
# the norm's output, or whose MLP bypasses its modules (pretraining_tp > 1, slow_but_exact), are refused.
_BLOOM = Family(
    name="bloom",
    model_types=("bloom",),
    layers="h",
    mlp_norm="post_attention_layernorm",
    attn="self_attention",
    inputs=("mlp.dense_h_to_4h.weight",),
    down="mlp.dense_4h_to_h",
    o_proj="self_attention.dense",
    matrices_out=True,
    when=lambda c: not c.apply_residual_connection_post_layernorm and not (c.pretraining_tp > 1 and c.slow_but_exact),
)
RENAMED: list[Family] = [
    # MPT: the MLP module adds the residual itself (its contribution: down_proj's output); ALiBi
    Family(
        name="mpt",
        model_types=("mpt",),
        layers="blocks",
        mlp_norm="norm_2",
        attn="attn",
        inputs=("ffn.up_proj.weight",),
        down="ffn.down_proj",
        mlp="ffn",
        matrices_out=True,
        o_proj="attn.out_proj",
    ),
    _BLOOM,
    _OPT,
    replace(
        _OPT,
        name="biogpt",
        model_types=("biogpt",),
        layers="layers",
        position_table="embed_positions",
        when=lambda c: True,
    ),
    replace(
        _OPT,
        name="opt_post",
        mlp_norm=None,
        post_add_norms=("self_attn_layer_norm", "final_layer_norm"),
        when=lambda config: not config.do_layer_norm_before,
    ),
    # CTRL: GPT-2's pre-norm block with linear layers (Wq, Wk, Wv, dense), an MLP that is an
    # nn.Sequential (Linear, ReLU, Linear), sinusoidal positions in a buffer
    Family(
        name="ctrl",
        model_types=("ctrl",),
        layers="h",
        attn="multi_head_attention",
        o_proj="multi_head_attention.dense",
        lone_zero=("multi_head_attention.Wq", "multi_head_attention.Wk"),
        value="multi_head_attention.Wv",
        mlp="ffn",
        mlp_norm="layernorm2",
        inputs=("ffn.0.weight",),
        down="ffn.2",
        position_table="pos_encoding",
    ),
    # XGLM: OPT's block (fc1 and fc2 loose in the layer, no MLP module; learned positions replaced by
    # sinusoids offset by 2, scaled embeddings), eager attention only
    Family(
        name="xglm",
        model_types=("xglm",),
        mlp="fc1",
        mlp_norm="final_layer_norm",
        inputs=("fc1.weight",),
        down="fc2",
        matrices_out=True,
        lone_zero=SELF_ATTN_QK,
        o_proj="self_attn.out_proj",
        value="self_attn.v_proj",
        position_table="embed_positions",
    ),
    # GPT-NeoX Japanese: NeoX's sequential block (fused query, key and value; no biases but the last
    # layer's attention bias, which the layer adds after the attention module, attn_bias), eager attention only
    Family(
        name="gpt_neox_japanese",
        model_types=("gpt_neox_japanese",),
        attn="attention",
        o_proj="attention.dense",
        attn_bias="attention.dense_bias",
        mlp_norm="post_attention_layernorm",
        inputs=("mlp.dense_h_to_4h.weight",),
        down="mlp.dense_4h_to_h",
    ),
    # ModernBERT decoder: Llama's block with LayerNorms (the first layer's attention norm an Identity),
    # its own names (attn.Wo; a fused GLU input mlp.Wi, mlp.Wo) and local attention layers
    Family(
        name="modernbert_decoder",
        model_types=("modernbert-decoder",),
        attn="attn",
        o_proj="attn.Wo",
        lone_zero=("attn.q_proj", "attn.k_proj"),
        value="attn.v_proj",
        mlp_norm="mlp_norm",
        inputs=("mlp.Wi.weight",),
        down="mlp.Wo",
    ),
    # Doge (dense, is_moe=False): m = a * h + A(N(h)), out = c * m + MLP(N'(m)) with a, c [d] weights of the
    # layer (input_residual, post_attention_residual): the output shift is c * (m_C - m_0), per channel.
    # Its attention adds a mask computed from the values (dt_proj) to the scores: a token alone, one key,
    # still weighs its value by 1. Doge's mixture of experts (is_moe) routes each token on logits split
    # across tokens (router_gate(x).view(2, B * T, K): its experts depend on other, later tokens): refused.
    Family(
        name="doge",
        model_types=("doge",),
        when=lambda config: not config.is_moe,
        mlp_norm="post_attention_layernorm",
        inputs=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        down="mlp.down_proj",
        lone_zero=SELF_ATTN_QK,
        value="self_attn.v_proj",
        residual_weights=("input_residual", "post_attention_residual"),
    ),
]
