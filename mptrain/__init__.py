"""mptrain: a Flax training loop for mixed-precision training done right."""

from mptrain.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    create_loss_scale,
    select_tree,
)
from mptrain.precision import Policy, get_policy
from mptrain.runtime import run
from mptrain.step import make_eval_step, make_train_step
from mptrain.train_state import TrainState
from mptrain.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "TrainState",
    "Trainer",
    "__version__",
    "all_finite",
    "create_loss_scale",
    "get_policy",
    "make_eval_step",
    "make_train_step",
    "run",
    "select_tree",
]
