"""A Trainer whose large-vocabulary embedding is a plain gather, as `layers.embed` was before its
gradient became a one-hot matmul: the gather's gradient is a scatter-add, which the plan's
scatter check must find (`tests/plan/plan_test.py`).
`--config.trainer=scatter_trainer:GatherTrainer` with `tests/train/` importable."""

import contextlib

import jax.numpy as jnp

import mptrain
from mptrain.models import layers


def _gather(table, ids, dtype):  # its gradient: a scatter-add into the table, in its dtype
    return jnp.take(table, ids, axis=0).astype(dtype)


@contextlib.contextmanager
def _gathering():
    matmul_gradient, layers._gathered = layers._gathered, _gather
    try:
        yield
    finally:
        layers._gathered = matmul_gradient


class GatherTrainer(mptrain.Trainer):
    def loss_fn(self, params, model_state, batch, rng):
        with _gathering():  # the step is traced here: its program has the gather's scatter
            return super().loss_fn(params, model_state, batch, rng)
