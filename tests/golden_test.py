"""Golden one-step values per preset: fixed inputs give a fixed loss, grad norm and update.

The tiny default LM (d_model 32, one block) from seed 0, a fixed batch of random bytes, AdamW
at a constant 3e-3 without warmup. Property tests pass as long as the recipe is plausible; these
numbers move when anything in it changes (a cast moved, a reduction reordered, a rounding rule
or a default changed), so a change that moves them must say why. To re-pin after an intended
change, print the four values of each preset and replace the table.
"""

import jax
import numpy as np
import pytest
from conftest import tiny_config

import mptrain

# preset: loss of step 1, its grad norm, loss of step 2 (after one update), sum |params| after 1
GOLDEN = {
    "fp32": (5.9838714599609375, 5.220526218414307, 5.211019992828369, 2546.4013243317604),
    "bf16-mixed": (5.98349666595459, 5.217504978179932, 5.210226535797119, 2546.4641833230853),
    "fp16-mixed": (5.983922004699707, 5.220690727233887, 5.211082458496094, 2546.4300962165),
    "bf16-pure": (5.98349666595459, 5.217504978179932, 5.210954189300537, 2546.420742034912),
}


def _batch():
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.parametrize("preset", list(GOLDEN))
def test_one_step_golden_values(preset, tmp_path):
    config = tiny_config(precision=preset, **{"optimizer.warmup_steps": 0})
    trainer = mptrain.Trainer(config, tmp_path)
    state = trainer.init_state(_batch())
    train_step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    state, first = train_step(state, _batch())
    _, second = train_step(state, _batch())
    magnitude = sum(
        float(np.abs(np.asarray(p, np.float32)).sum()) for p in jax.tree.leaves(state.params)
    )
    found = (float(first["loss"]), float(first["grad_norm"]), float(second["loss"]), magnitude)
    np.testing.assert_allclose(found, GOLDEN[preset], rtol=1e-6)
