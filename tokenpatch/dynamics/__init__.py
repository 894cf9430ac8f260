"""Implicit learning dynamics, and the explicit fine-tuning they are set beside (``docs/dynamics.md``).

* ``trajectory``: the token patch after every context token, in one pass (``tp.trajectory``);
* ``online_gd``: the online-gradient-descent view of a trajectory (``tp.replay``);
* ``diagnostics``: convergence diagnostics from the factors;
* ``online_sgd``: implicit steps against explicit gradients and online SGD, step by step
  (``tp.online_alignment``);
* ``finetune``: explicit fine-tuning on the context's examples (``tp.finetune``) and the alignment metrics.
"""

from tokenpatch.dynamics import diagnostics
from tokenpatch.dynamics.finetuning import FineTune, finetune, finetuned, simaou
from tokenpatch.dynamics.online_gd import Replay, replay
from tokenpatch.dynamics.online_sgd import OnlineAlignment, online_alignment
from tokenpatch.dynamics.trajectories import Trajectory, trajectory

__all__ = [
    "trajectory",
    "Trajectory",
    "replay",
    "Replay",
    "online_alignment",
    "OnlineAlignment",
    "finetune",
    "finetuned",
    "FineTune",
    "simaou",
    "diagnostics",
]
