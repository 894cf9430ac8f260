"""``Family``: where a Hugging Face block design keeps what a patch needs, as names relative to a
decoder layer. The records, one per design, are in ``arch.families``; ``arch.hf_modules`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Family"]


@dataclass(frozen=True)
class Family:
    """Where a block design keeps what the patch needs, as names relative to a decoder layer.

    ``layers``: the decoder layers' ``ModuleList`` under the base model (a dotted path). ``when``:
    which configs of the ``model_types`` have this design (the first record whose ``when`` holds is
    the model's: Falcon and StableLM have several). ``mlp_norm``: the norm whose output is the
    MLP input ``s``; in a sequential block its input is ``m``; ``None``: the MLP reads the residual
    stream itself (norms after the sublayers: OLMo 2/3, EXAONE 4), ``s = m``. ``attn``: the attention
    module; a parallel block's ``m`` is the layer input plus its output. ``inputs``: the parameters
    reading ``s`` (changed together through the input change of ``mlp``). ``mlp``: the module whose
    input is ``s`` and whose output is the MLP's contribution. ``down``: the
    MLP output matrix (its input is ``hidden``). ``out_norm``: a norm between the MLP and the
    residual add (Gemma 2/3, OLMo 2/3, EXAONE 4), patched in its scale. ``down_gate``: a module whose sigmoid
    scales ``down``'s output (a shared expert's gate). ``out_scale``: a constant the block multiplies
    each sublayer's output by before the residual add (Granite's ``residual_multiplier``).
    ``sum_norm``: a norm of the residual stream after the MLP's add (OPT-350m: the layer's output is
    ``N(m + MLP(s))``); a token patch needs nothing of it (the output shift makes the sum it
    normalises the with-context one), a thought patch fits the sum before it.
    ``residual_inside``: the attention and MLP modules add the residual themselves (Bloom): a
    sublayer's contribution is the output of ``o_proj`` and of ``down``.
    ``mlp_out``: the module whose output is the MLP's contribution, if not ``mlp`` (OPT's MLP is no
    module: ``fc1`` reads ``s``, ``fc2`` gives the output). ``add_norm``: a norm of the residual
    stream right after the attention's add (OPT-350m's post-norm block: ``m = N(h + a)``).
    ``parallel``: whether a model of this family (its config) has a parallel block. ``dense``: the
    family of the layers that lack ``down`` (the plain MLP layers of a mixture-of-experts model).
    ``lone_zero``: projections whose outputs a token alone does not need (its own query and key:
    one attention weight, 1), skipped in the no-context pass. ``o_proj``: the attention's output
    matrix, whose input is the heads' outputs side by side (per-head baselines read and patch it).
    ``attn_out``: the module whose output is the attention's contribution to the residual stream,
    if not ``attn`` (a norm after it: Gemma 2/3, OLMo 2). ``position_table``: the learned position
    embedding under the base model (GPT-2's ``wpe``), whose size bounds the position ids; ``None``
    for rotary positions. ``value``: the attention's own value projection, where the attention
    output of a token alone is ``o_proj`` of its values (each key-value head repeated for the query
    heads sharing it): the no-context pass of each query alone is then computed from the values
    the with-context pass recorded (``HFAdapter.anchors``); ``None`` (fused projections, attentions
    that do more than mix values): it runs the layers.
    """

    name: str
    model_types: tuple[str, ...]
    layers: str
    mlp_norm: str | None
    attn: str
    inputs: tuple[str, ...]
    down: str
    out_norm: str | None = None
    parallel: Callable[[Any], bool] = field(default=lambda config: False)
    mlp: str = "mlp"
    down_gate: str | None = None
    dense: str | None = None
    lone_zero: tuple[str, ...] = ()
    o_proj: str = "self_attn.o_proj"
    attn_out: str | None = None
    position_table: str | None = None
    when: Callable[[Any], bool] = field(default=lambda config: True)
    out_scale: Callable[[Any], float] | None = None
    experts: bool = False
    value: str | None = None
    mlp_out: str | None = None
    residual_inside: bool = False
    add_norm: str | None = None
    sum_norm: str | None = None
