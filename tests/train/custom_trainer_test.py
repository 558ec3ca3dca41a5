"""A user's own model through mptrain.Trainer, subclassed in one screen of code."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import mptrain
from mptrain import config as config_lib


class SineSource:
    """y = sin(3x) on random x; batch i is a pure function of (seed, i)."""

    def __init__(self, batch_size, seed):
        self.batch_size, self.seed = batch_size, seed

    def get_batch(self, i):
        x = np.random.default_rng([self.seed, i]).uniform(-1, 1, (self.batch_size, 1))
        return {"inputs": x.astype(np.float32), "targets": np.sin(3 * x).astype(np.float32)}


class SineTrainer(mptrain.Trainer):
    def build_model(self):
        return nn.Sequential([nn.Dense(64), nn.tanh, nn.Dense(64), nn.tanh, nn.Dense(1)])

    def build_datasets(self):
        return SineSource(self.config.batch_size, 0), SineSource(self.config.batch_size, 1)

    def init_variables(self, rng, batch):
        return self.model.init(rng, batch["inputs"])

    def loss_fn(self, params, model_state, batch, rng):
        pred = self.model.apply({"params": params}, batch["inputs"]).astype(jnp.float32)
        loss = jnp.mean((pred - batch["targets"].astype(jnp.float32)) ** 2)
        return loss, (model_state, {"max_error": jnp.max(jnp.abs(pred - batch["targets"]))})


def test_subclass_trains_a_new_model(tmp_path):
    config = config_lib.base_config()
    config.trainer = f"{__name__}:SineTrainer"
    config.num_train_steps, config.batch_size = 300, 64
    config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = 100
    config.optimizer.learning_rate, config.optimizer.warmup_steps = 1e-2, 10
    trainer = SineTrainer(config, tmp_path)
    state = trainer.train_and_evaluate()
    assert int(state.step) == 300
    assert trainer.last_eval["eval_loss"] < 0.02  # sin(3x) has variance ~0.5 on [-1, 1]
    assert "eval_max_error" in trainer.last_eval
