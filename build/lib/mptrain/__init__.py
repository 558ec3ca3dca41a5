"""mptrain: a Flax training loop for mixed-precision training done right.

The names below load on first use (PEP 562), so that `import mptrain` costs milliseconds and the
command line catches SIGTERM and Ctrl-C before jax and flax are imported (see `runtime`).
"""

import importlib

# public name -> the module that defines it
_WHERE = {
    "run": "mptrain.launch",
    "DynamicLossScale": "mptrain.loss_scale",
    "NoOpLossScale": "mptrain.loss_scale",
    "StaticLossScale": "mptrain.loss_scale",
    "all_finite": "mptrain.loss_scale",
    "create_loss_scale": "mptrain.loss_scale",
    "select_tree": "mptrain.loss_scale",
    "Policy": "mptrain.precision",
    "get_policy": "mptrain.precision",
    "make_eval_step": "mptrain.step",
    "make_train_step": "mptrain.step",
    "TrainState": "mptrain.train_state",
    "Trainer": "mptrain.trainer",
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
