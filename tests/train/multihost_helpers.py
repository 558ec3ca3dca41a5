"""Trainers that the multi-process tests name in `config.trainer` (`PYTHONPATH=tests`).

Each process of a test's job imports this module before it trains.
"""

import os
import signal

import jax
import numpy as np
from jax.experimental import multihost_utils

import mptrain

_gather = multihost_utils.process_allgather


def _refuse_arrays(tree, *args, **kwargs):
    """Lets barriers through (orbax syncs processes by gathering a few-byte hash), fails on
    any gather of more than 16 elements: none of the state's arrays may reach a host whole."""
    sizes = [int(np.size(x)) for x in jax.tree.leaves(tree)]
    if max(sizes, default=0) > 16:
        raise AssertionError(f"arrays of {sizes} elements were gathered to a host")
    return _gather(tree, *args, **kwargs)


class NoGatherTrainer(mptrain.Trainer):
    """Fails the run if anything gathers an array to a host (a checkpoint save, say)."""

    multihost_utils.process_allgather = _refuse_arrays


class SigtermOnProcess1(mptrain.Trainer):
    """Process 1 sends itself SIGTERM once it has done step 3; process 0 gets no signal."""

    def build_hooks(self, run):
        def sigterm_at_3(step):
            if step == 3 and self.config.distributed.process_id == 1:
                os.kill(os.getpid(), signal.SIGTERM)

        return [*super().build_hooks(run), sigterm_at_3]
