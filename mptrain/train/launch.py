"""`mptrain.run(config, workdir)`: what `python -m mptrain.main` does, from Python.

It starts the backend (XLA's flags, then jax.distributed, before anything touches a device),
validates the config, imports the Trainer class that `config.trainer` names and trains. The
drivers (`main`, `export`) import the Trainer class the same way, through `import_trainer`.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path

from absl import logging

from mptrain import buckets, errors, mirror, runtime
from mptrain import config as config_lib
from mptrain.train import trainer

# where the Trainer lived before the sub-packages: configs and workdirs that name it still run
_MOVED = {"mptrain.trainer": "mptrain.train.trainer"}


def import_trainer(spec: str):
    """The `Trainer` subclass named `"package.module:Class"`; `ConfigError`s name the spec."""
    module_name, sep, class_name = spec.partition(":")
    module_name = _MOVED.get(module_name, module_name)
    if not sep or not module_name or not class_name:
        raise errors.ConfigError(
            f"config.trainer={spec!r}: expected 'package.module:Class', e.g. "
            "'mptrain.train.trainer:Trainer'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a missing module, or one that fails as it loads
        raise errors.ConfigError(
            f"config.trainer={spec!r}: cannot import {module_name}: {type(e).__name__}: "
            f"{errors.first_line(e)}"
        ) from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, trainer.Trainer)):
        raise errors.ConfigError(
            f"config.trainer={spec!r}: {module_name} has no Trainer subclass {class_name!r}"
        )
    return cls


def run(config, workdir: str | os.PathLike):
    """What `python -m mptrain.main` does, from Python: validate, build the trainer, train.

    `workdir` may be `s3://BUCKET/PATH` or `gs://BUCKET/PATH` (`mptrain.mirror`). Returns the
    final `TrainState`; raises `errors.ConfigError` for a bad config and the
    `errors.StopTraining` family when a run ends early.
    """
    with errors.config_errors():
        runtime.start_backend(config)
    resolved = config_lib.validate(config)  # the run's parts, built once: the Trainer takes them
    trainer_cls = import_trainer(config.trainer)
    started = time.monotonic()
    if buckets.scheme(workdir) is None:
        state = trainer_cls(config, Path(workdir), resolved=resolved).train_and_evaluate()
    else:  # s3:// or gs://: the run writes a local stage that a mirror uploads
        with mirror.staged(os.fspath(workdir)) as stage:
            state = trainer_cls(config, stage, resolved=resolved).train_and_evaluate()
    logging.info("mptrain: done in %.1f s", time.monotonic() - started)
    return state
