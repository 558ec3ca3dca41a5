"""A GRU that forecasts noisy sine waves: a model, data and loss the zoo does not have.

Three hooks make the Trainer train it: `build_model` and `build_datasets` (host-side, run once)
and `loss_fn` (traced under jit). Precision, loss scaling, checkpoints, resuming, evaluation and
TensorBoard come with the base class. Run it with `examples/custom_trainer/config.py`.
"""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import mptrain


class SineWaves:
    """Batch ``i``: sine waves of random frequency and phase plus noise, a pure fn of (seed, i).

    ``inputs`` is ``float32[B, length, 1]``; ``targets`` is ``float32[B, length]``, each step's
    next value. ``stream`` keeps the train (0) and eval (1) waves apart.
    """

    def __init__(self, batch_size, length, seed, stream, noise=0.05):
        self.batch_size, self.length, self.seed, self.stream = batch_size, length, seed, stream
        self.noise = noise

    def get_batch(self, i):
        rng = np.random.default_rng([self.seed, self.stream, i])
        freq = rng.uniform(0.2, 0.8, (self.batch_size, 1))
        phase = rng.uniform(0, 2 * np.pi, (self.batch_size, 1))
        wave = np.sin(freq * np.arange(self.length + 1) + phase)
        wave += self.noise * rng.standard_normal(wave.shape)
        wave = wave.astype(np.float32)
        return {"inputs": wave[:, :-1, None], "targets": wave[:, 1:]}


class Forecaster(nn.Module):
    """A GRU over the sequence, then a linear read-out of the next value at every step."""

    hidden: int
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, *, train=False):  # `train` is what the default init passes
        h = nn.RNN(nn.GRUCell(self.hidden, dtype=self.dtype))(x)
        return nn.Dense(1, dtype=self.dtype)(h)[..., 0]


class ForecastTrainer(mptrain.Trainer):
    loss_unit = "mean squared error"  # of the next value, as the run summary names it

    def build_model(self):  # host-side
        return Forecaster(self.config.model.hidden, dtype=self.policy.compute_dtype)

    def build_datasets(self):  # host-side: (train, eval)
        c = self.config
        return tuple(SineWaves(c.batch_size, c.data.length, c.seed, s) for s in (0, 1))

    def loss_fn(self, params, model_state, batch, rng):  # traced: pure, compute-dtype inputs
        pred = self.model.apply({"params": params}, batch["inputs"]).astype(jnp.float32)
        error = pred - batch["targets"].astype(jnp.float32)  # the loss is computed in fp32
        return jnp.mean(error**2), (model_state, {"mae": jnp.mean(jnp.abs(error))})
