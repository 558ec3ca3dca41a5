"""mptrain: a Flax training loop for mixed-precision training done right.

The package's folders are its architecture (docs/design.md): `recipe/` (what a step does to
numbers), `models/`, `data/`, `inspect/` (reading the compiled step), `record/` (what a run writes
down), `hf/` (HuggingFace folders), `train/` (the Trainer, its loop and checkpoints), `plan/` (a run
compiled for a chip that is not here), and the command lines `main`, `export` and `profile`.

The names below load on first use (PEP 562), so that `import mptrain` costs milliseconds and the
command line catches SIGTERM and Ctrl-C before jax and flax are imported (see `runtime`). The
modules outside code imports by name are bound here too: `from mptrain import precision` (or
loss_scale, train_state, step, optim, sharding, numerics, audit) gives the module in its
sub-package.
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

# module name -> where it lives: `from mptrain import precision` keeps working
_MODULES = {
    "audit": "mptrain.inspect.audit",
    "loss_scale": "mptrain.recipe.loss_scale",
    "numerics": "mptrain.recipe.numerics",
    "optim": "mptrain.optim",
    "precision": "mptrain.recipe.precision",
    "sharding": "mptrain.parallel.sharding",
    "step": "mptrain.recipe.step",
    "train_state": "mptrain.recipe.train_state",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module 'mptrain' has no attribute {name!r}")
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE) | set(_MODULES))
