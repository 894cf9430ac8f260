"""Thought patches: one static weight update that stands in for a prompt (``docs/thought-patches.md``).

* ``front``: ``thought_patch`` (its arguments checked), ``evaluate_thought_patch``;
* ``engine``: the fit, layer by layer over the adapter's named sites, one for every model (``lm_output``:
  the output side through the output kind; ``through_norm``: through a norm after the MLP);
* ``lstsq``: streamed ridge least squares in float64;
* ``calibration``: calibration the prompted model writes itself, cut into its demonstrations;
* ``held_out``: the ridge chosen without labels, by the KL to the prompted model on held-out queries;
* ``distill``: context distillation, the gradient baseline.
"""

from tokenpatch.thought.distillation import Distilled, distill
from tokenpatch.thought.front import LayerFit, ThoughtPatch, compress, evaluate_thought_patch, thought_patch
from tokenpatch.thought.lstsq import ThoughtWarning

__all__ = [
    "thought_patch",
    "ThoughtPatch",
    "LayerFit",
    "ThoughtWarning",
    "evaluate_thought_patch",
    "compress",
    "distill",
    "Distilled",
]
