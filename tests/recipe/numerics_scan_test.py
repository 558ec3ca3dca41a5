"""`numerics.per_layer` on a scanned Llama: a row per call per layer, named and valued as the
unrolled model's, and a non-finite value traced to the layer it came from."""

import jax
import numpy as np
import pytest
from helpers import load_config
from recipe.fp8_scan_test import unstack

import mptrain
from mptrain.parallel import sharding
from mptrain.recipe import numerics


def _trainer(tmp_path, scan, **more):
    overrides = {"precision": "fp32", "model.scan_layers": scan, "numerics.per_layer": True}
    config = load_config("llama3", "tiny", **overrides, **more)
    return mptrain.Trainer(config, tmp_path / str(scan))


# Layers of two kinds, a period of two and a layer over (Gemma 2's pattern on three layers): the
# stack scans pairs of blocks, then one, and each layer still gets its own rows
KINDS = {
    "model.num_layers": 3,
    "model.sliding_window": 4,
    "model.layer_types": ("sliding_attention", "full_attention", "sliding_attention"),
}


def _pair(tmp_path_factory, **more):
    """The steps of the scanned and the unrolled tiny Llama, from the same params, with their
    calls."""
    tmp_path = tmp_path_factory.mktemp("numerics_scan")
    found = []
    for scan in (True, False):
        trainer = _trainer(tmp_path, scan, **more)
        state = trainer.init_state()
        if found:
            state = state.replace(params=unstack(found[0][0].params))
        batch = trainer.build_datasets()[0].get_batch(0)
        calls = numerics.loss_calls(trainer.loss_fn, state, batch)
        # measured in the step's own gradient (numerics.every_step), one program the less than
        # measuring again on log steps (which numerics_test covers)
        step = mptrain.make_train_step(trainer.loss_fn, per_layer=True)
        found.append((state, batch, calls, jax.jit(step)))
    return found


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _pair(tmp_path_factory)


@pytest.mark.slow
def test_a_stack_of_two_kinds_of_layer_gives_each_layer_its_own_rows(tmp_path_factory):
    (state_a, batch, calls_a, step_a), (state_b, _, calls_b, step_b) = _pair(
        tmp_path_factory, **KINDS
    )
    assert calls_a.paths == calls_b.paths and calls_a.parents == calls_b.parents
    at = calls_a.paths.index("layers_2/mlp/down")
    assert calls_a.scopes[at] == (sharding.STACKED, "mlp", "down") and calls_a.layers[at] == 2
    assert calls_a.layers[calls_a.paths.index("layers_1/attn/q")] == 1
    (_, a), (_, b) = step_a(state_a, batch), step_b(state_b, batch)
    np.testing.assert_allclose(np.asarray(a["numerics"]), np.asarray(b["numerics"]), rtol=1e-6)


def test_each_layer_of_the_stack_gets_the_unrolled_models_rows(pair):
    (state_a, batch, calls_a, step_a), (state_b, _, calls_b, step_b) = pair
    assert calls_a.paths == calls_b.paths and len(calls_a.paths) == 28
    assert calls_a.paths[2:6] == (
        "layers_0",
        "layers_0/attn_norm",
        "layers_0/attn",
        "layers_0/attn/q",
    )
    assert "layers_1/mlp/down" in calls_a.paths
    assert calls_a.parents == calls_b.parents
    # the stacked calls' params: their layer's slice of the stack
    at = calls_a.paths.index("layers_1/mlp/down")
    assert calls_a.scopes[at] == (sharding.STACKED, "mlp", "down") and calls_a.layers[at] == 1
    (_, a), (_, b) = step_a(state_a, batch), step_b(state_b, batch)  # step 0: a log step
    table_a, table_b = np.asarray(a["numerics"]), np.asarray(b["numerics"])
    assert table_a.any() and table_a.shape == table_b.shape
    np.testing.assert_allclose(table_a, table_b, rtol=1e-6)
    amax = numerics.COL["out_amax"]
    rows = [calls_a.paths.index(f"layers_{i}/mlp/down") for i in (0, 1)]
    assert table_a[rows[0], amax] != table_a[rows[1], amax]  # each layer its own values


def test_a_nan_in_one_layers_weights_is_traced_to_that_layer(pair):
    """Layer 1's down projection poisoned: both models name it, forward, and skip the step."""
    found = []
    for state, batch, calls, step in pair:
        params = jax.tree.map(np.array, jax.device_get(state.params))
        if sharding.STACKED in params:
            kernel = params[sharding.STACKED]["mlp"]["down"]["kernel"]
            kernel[1, 0, 0] = np.nan
        else:
            params["layers_1"]["mlp"]["down"]["kernel"][0, 0] = np.nan
        # put back where the state's params were, so the step's own program runs again
        params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, state.params))
        _, metrics = step(state.replace(params=params), batch)
        assert not bool(metrics["applied"])
        index, direction = metrics["numerics_origin"].tolist()
        found.append((calls.paths[index], direction))
    assert found == [("layers_1/mlp/down", 0)] * 2
