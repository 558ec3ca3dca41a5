"""The reductions and gathers of a sharded step, read from the compiled program on 8 devices."""

import jax
import numpy as np
import pytest
from helpers import needs_devices, tiny_config
from jax.sharding import Mesh

import mptrain
from mptrain.inspect import audit
from mptrain.parallel import layout, sharding
from mptrain.recipe import precision as precision_lib


def _compiled_step(precision, data, fsdp, tmp_path):
    """`make_train_step` under a plain `jax.jit` with the mesh's shardings, as a user writes it."""
    # nearest: stochastic rounding (bf16-pure's default) would add its key's u32 all-reduce
    config = tiny_config(
        precision=precision, param_rounding="nearest", **{"mesh.data": data, "mesh.fsdp": fsdp}
    )
    trainer = mptrain.Trainer(config, tmp_path)
    tokens = np.zeros((config.batch_size, config.data.seq_len + 1), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state = trainer.init_state(batch)
    # the user's own mesh of the two axes it splits, as the first releases documented it: the
    # other three are size 1 (the trainer's mesh, the same program)
    mesh = Mesh(np.asarray(jax.devices()[: data * fsdp]).reshape(data, fsdp), ("data", "fsdp"))
    shardings = sharding.state_shardings(mesh, state)
    step = jax.jit(
        mptrain.make_train_step(trainer.loss_fn, mesh=mesh),
        in_shardings=(shardings, layout.batch_sharding(mesh)),
        out_shardings=(shardings, None),
    )
    kept = set(state.policy.kept_fp32_paths(state.params))
    sizes = {precision_lib.path_name(p): x.size for p, x in _leaves(state.params)}
    n_kept = sum(n for path, n in sizes.items() if path in kept)
    return step.lower(state, batch).compile().as_text(), sum(sizes.values()), n_kept


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


@needs_devices(8)
@pytest.mark.parametrize(
    "precision, data, fsdp",
    [
        ("bf16-mixed", 4, 2),
        # the second variants (the same reductions under another dtype or mesh): make test-slow
        pytest.param("fp16-mixed", 8, 1, marks=pytest.mark.slow),
        pytest.param("fp16-mixed", 4, 2, marks=pytest.mark.slow),
        pytest.param("bf16-mixed", 8, 1, marks=pytest.mark.slow),
        pytest.param("bf16-pure", 4, 2, marks=pytest.mark.slow),  # stored in bf16 after
    ],
)
def test_gradients_reduce_in_fp32_and_params_gather_in_16_bits(precision, data, fsdp, tmp_path):
    program, n_params, n_kept = _compiled_step(precision, data, fsdp, tmp_path)
    assert 0 < n_kept < n_params / 2  # the embeddings and norms the casting rule keeps
    found = audit.collectives(program)
    reductions = {**found.get("all-reduce", {}), **found.get("reduce-scatter", {})}
    assert set(reductions) == {"f32"}, found  # no 16-bit sum across devices, no per-leaf preds
    # every gradient is reduced once, in fp32: over `data` whole, or scattered over `fsdp`
    grads = found["reduce-scatter"]["f32"] if fsdp > 1 else found["all-reduce"]["f32"]
    assert grads >= 4 * n_params
    if fsdp > 1:
        # XLA:CPU has no bf16 all-gather; mptrain moves bf16 params as their 16 bits (uint16).
        # Every param is gathered, 2 bytes each, but those the casting rule keeps, in fp32.
        wanted = {"f16" if precision == "fp16-mixed" else "u16": 2 * (n_params - n_kept)}
        assert found["all-gather"] == {**wanted, "f32": 4 * n_kept}, found
    else:
        assert "all-gather" not in found


@needs_devices(2)
@pytest.mark.parametrize(
    "precision, stored", [("bf16-pure", "bfloat16"), ("bf16-mixed", "float32")]
)
def test_gradients_are_stored_at_the_params_width_after_their_fp32_reduction(precision, stored):
    """bf16 params' gradients leave the fp32 reduction as bf16 (2 bytes a parameter until the
    update), as one device's are; fp32 params' stay fp32. Shapes only: nothing compiles."""
    config = tiny_config(precision=precision, **{"mesh.data": 1, "mesh.fsdp": 2})
    trainer = mptrain.Trainer(config, "/nonexistent", devices=jax.devices()[:2])
    batch = trainer.build_datasets()[0].get_batch(0)
    state = jax.eval_shape(lambda: trainer.init_state(batch))
    loss = lambda p, probes, b, rng: (trainer.loss_fn(p, {}, b, rng)[0], None)
    grads_of = sharding.grad_fn(loss, state.policy, trainer.mesh, axes=state.axes)
    grads = jax.eval_shape(lambda p: grads_of(p, None, batch, jax.random.key(0))[0], state.params)
    assert {x.dtype.name for x in jax.tree.leaves(state.params)} == {stored}
    assert {x.dtype.name for x in jax.tree.leaves(grads)} == {stored}


def _state_bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@needs_devices(8)
def test_start_up_under_fsdp_8_holds_an_eighth_of_the_state_per_device(tmp_path):
    peaks = {}
    for fsdp in (1, 8):
        model = {"model.d_model": 128, "model.d_ff": 512, "model.num_heads": 4, "mesh.fsdp": fsdp}
        trainer = mptrain.Trainer(tiny_config(**model), tmp_path)
        init, args = trainer.make_init(trainer.build_datasets()[0].get_batch(0))
        shapes = jax.eval_shape(init, *args)
        memory = init.lower(*args).compile().memory_analysis()  # per device
        peaks[fsdp] = memory.output_size_in_bytes + memory.temp_size_in_bytes
    state, largest = _state_bytes(shapes), max(_state_bytes(x) for x in jax.tree.leaves(shapes))
    assert peaks[1] >= state  # whole, on one device
    assert peaks[8] <= 1.15 * (state / 8 + largest)  # an eighth, plus about one leaf in flight


def test_a_mesh_axis_that_is_none_of_the_five_is_refused_by_name():
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match=r"'model' is none of mptrain's \('data', 'fsdp'"):
        layout.full_mesh(mesh)
    assert layout.full_mesh(Mesh(np.asarray(jax.devices()[:1]), ("fsdp",))).shape == {
        "data": 1,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 1,
    }
