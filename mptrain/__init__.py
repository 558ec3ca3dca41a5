"""mptrain: a Flax training loop for mixed-precision training done right."""

from mptrain.launch import run
from mptrain.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    create_loss_scale,
    select_tree,
)
from mptrain.precision import Policy, get_policy
from mptrain.step import make_eval_step, make_train_step
from mptrain.train_state import TrainState
from mptrain.trainer import Trainer
from mptrain.version import __version__

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
