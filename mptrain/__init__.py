"""mptrain: a Flax training loop for mixed-precision training done right.

The names below load on first use (PEP 562), so that `import mptrain` costs milliseconds and the
command line catches SIGTERM and Ctrl-C before jax and flax are imported (see `runtime`).
"""

import importlib

# public name -> the module that defines it
_WHERE = {
    "run": "mptrain.train.launch",
    "DynamicLossScale": "mptrain.recipe.loss_scale",
    "NoOpLossScale": "mptrain.recipe.loss_scale",
    "StaticLossScale": "mptrain.recipe.loss_scale",
    "all_finite": "mptrain.recipe.loss_scale",
    "create_loss_scale": "mptrain.recipe.loss_scale",
    "select_tree": "mptrain.recipe.loss_scale",
    "Policy": "mptrain.recipe.precision",
    "get_policy": "mptrain.recipe.precision",
    "make_eval_step": "mptrain.recipe.step",
    "make_train_step": "mptrain.recipe.step",
    "TrainState": "mptrain.recipe.train_state",
    "Trainer": "mptrain.train.trainer",
    "__version__": "mptrain.version",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'mptrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
