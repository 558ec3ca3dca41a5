"""fp8-mixed on a scanned Llama: the scaling state stacked on the layer axis, carried through the
scan (and the remat of each block), equal layer by layer to the unrolled model's."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ROOT,
    assert_trees_bytes_equal,
    kill_9_and_resume,
    load_config,
    needs_devices,
    plain_orbax_state,
)

import mptrain
from mptrain.parallel import sharding
from mptrain.recipe import fp8, fp8_names

# steps compared one by one: delayed scaling (make test-slow) reads 20 of them back from its
# histories; current scaling (make test) only logs them, and 8 show every layer's row filled
STEPS = {"current": 8, "delayed": 20}


def _config(scaling, scan, **overrides):
    return load_config(
        "llama3",
        "tiny",
        **{
            "precision": "fp8-mixed",
            "fp8.scaling": scaling,
            "fp8.bf16_layers": 0,  # both of tiny's blocks in fp8
            "fp8.min_size": 0,  # its matmuls are far below the size filter
            "optimizer.schedule": "constant",
            "model.scan_layers": scan,
            **overrides,
        },
    )


def unstack(tree):
    """A scanned model's variables as the unrolled model names them: `stacked_layers` (params)
    and `stacked_layers/layers_<a>-<b>` (fp8 state) become `layers_<i>`."""
    if not isinstance(tree, dict):
        return tree
    out = {k: unstack(v) for k, v in tree.items() if k != sharding.STACKED}
    if sharding.STACKED in tree:
        stack = tree[sharding.STACKED]
        spans = {0: stack}
        if all(k.startswith("layers_") and "-" in k for k in stack):
            spans = {int(k.removeprefix("layers_").split("-")[0]): v for k, v in stack.items()}
        for first, layers in spans.items():
            count = jax.tree.leaves(layers)[0].shape[0]
            for i in range(count):
                out[f"layers_{first + i}"] = jax.tree.map(lambda a, i=i: a[i], layers)
    return out


def _pair(tmp_path, scaling):
    """The scanned and the unrolled tiny Llama in fp8, from the same params, computing in fp32
    around the fp8 matmuls: the fp8 quantization of equal values is then equal, and scan and
    unrolled layers differ by fp32 rounding at most. (In bf16 the two programs round a few
    values differently, which an e4m3 rounding then amplifies: the second test.)"""
    trainers, states = [], []
    for scan in (True, False):
        trainer = mptrain.Trainer(_config(scaling, scan), tmp_path / str(scan))
        state = trainer.init_state()
        trainer.model = trainer.model.clone(dtype=jnp.float32)
        policy = dataclasses.replace(state.policy, compute_dtype=jnp.float32, keep_fp32="")
        trainers.append(trainer)
        states.append(state.replace(policy=policy))
    scanned, unrolled = states
    assert_trees_bytes_equal(
        jax.device_get(unrolled.model_state), unstack(jax.device_get(scanned.model_state))
    )
    states[1] = unrolled.replace(params=unstack(scanned.params))
    return trainers, states


@pytest.mark.parametrize(
    "scaling",
    # a variant: make test keeps current scaling, the Llama's default
    ["current", pytest.param("delayed", marks=pytest.mark.slow)],
)
def test_the_scanned_fp8_llama_trains_as_the_unrolled_one(scaling, tmp_path):
    trainers, states = _pair(tmp_path, scaling)
    steps_taken = STEPS[scaling]
    batches = [trainers[0].build_datasets()[0].get_batch(i) for i in range(steps_taken)]
    # same params, same batch: loss and gradients (the fp8 backward) to fp32 rounding
    rng = jax.random.key(0)

    def grads(trainer, state):
        loss = lambda p: trainer.loss_fn(p, state.model_state, batches[0], rng)[0]
        return jax.jit(jax.value_and_grad(loss))(state.params)

    (loss_a, grads_a), (loss_b, grads_b) = map(grads, trainers, states)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    jax.tree.map(close, unstack(grads_a), grads_b)
    # the steps of the scanned run, each also taken by the unrolled model from the same state:
    # the fp8 state each produces, layer by layer, to fp32 rounding. (Two runs left to
    # themselves part by fp32 rounding of the updates, which now and then puts a value on the
    # other side of an e5m2 rounding boundary: a few 1e-2 in a gradient's amax by step 20.)
    steps = [jax.jit(mptrain.make_train_step(t.loss_fn)) for t in trainers]
    state = states[0]
    for batch in batches:
        other = states[1].replace(**{k: unstack_tree(getattr(state, k)) for k in FIELDS})
        state, metrics = steps[0](state, batch)
        new, want = steps[1](other, batch)
        np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-6)
        got = unstack(jax.device_get(state.model_state[fp8.META]))
        assert sorted(got) == ["layers_0", "layers_1"]
        close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5)
        jax.tree.map(close, got, jax.device_get(new.model_state[fp8.META]))
    history = got["layers_1"]["mlp"]["down"]["DotGeneral_0"]["meta"]["amax_history"]
    assert (history[:, :steps_taken] > 0).all() and (history[:, steps_taken:] == 0).all()


@pytest.mark.slow  # a second variant: the stack's spans with layers of two kinds
def test_fp8_spans_over_layers_of_two_kinds_compute_as_the_unrolled_layers(tmp_path):
    """Four layers, sliding and full in turn, the first and last in bf16: the scan's three
    spans each take their own period of blocks (one, two, one), with the fp8 state of the
    middle two; loss and gradients are the unrolled model's to fp32 rounding."""
    kinds = {
        "model.num_layers": 4,
        "model.sliding_window": 3,
        "model.layer_types": ("sliding_attention", "full_attention") * 2,
        "fp8.bf16_layers": 1,
    }
    trainers, states = [], []
    for scan in (True, False):
        trainer = mptrain.Trainer(_config("current", scan, **kinds), tmp_path / str(scan))
        state = trainer.init_state()
        trainer.model = trainer.model.clone(dtype=jnp.float32)
        policy = dataclasses.replace(state.policy, compute_dtype=jnp.float32, keep_fp32="")
        trainers.append(trainer)
        states.append(state.replace(policy=policy))
    states[1] = states[1].replace(params=unstack(states[0].params))
    batch, rng = trainers[0].build_datasets()[0].get_batch(0), jax.random.key(0)

    def grads(trainer, state):
        loss = lambda p: trainer.loss_fn(p, state.model_state, batch, rng)[0]
        return jax.jit(jax.value_and_grad(loss))(state.params)

    (loss_a, grads_a), (loss_b, grads_b) = map(grads, trainers, states)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    jax.tree.map(close, unstack(grads_a), grads_b)
    assert sorted(unstack(jax.device_get(states[0].model_state[fp8.META]))) == [
        "layers_1",
        "layers_2",
    ]


FIELDS = ("params", "opt_state", "model_state")


def unstack_tree(tree):
    """`unstack` applied to every dict of `tree` (an optimizer state holds the params' dicts)."""
    stacked = lambda x: isinstance(x, dict) and sharding.STACKED in x
    return jax.tree.map(lambda x: unstack(x) if stacked(x) else x, tree, is_leaf=stacked)


def test_the_llamas_fp8_defaults_are_current_scaling_bf16_ends_and_the_size_filter():
    from mptrain import config as config_lib

    llama = config_lib.policy_of(load_config("llama3", "8b", precision="fp8-mixed")).fp8
    assert (llama.current, llama.bf16_layers, llama.min_size) == (True, 1, 1024)
    other = config_lib.policy_of(load_config("default", precision="fp8-mixed")).fp8
    assert other == fp8.Recipe()  # transformer_lm: every dense layer, delayed scaling
    # Llama 3 8B's kernels [in, out]: the filter drops k and v (1,024 outputs), keeps the rest
    d, kv, ff = 4096, 1024, 14_336
    kernels = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "gate": (d, ff)}
    kernels |= {"up": (d, ff), "down": (ff, d)}
    kept = [name for name, shape in kernels.items() if fp8.selected(llama, *shape)]
    assert kept == ["q", "o", "gate", "up", "down"]
    assert fp8.fp8_layers(llama, 32) == (1, 31) and fp8.fp8_layers(llama, 2) == (1, 1)


def test_a_skipped_step_leaves_every_layers_fp8_state_bit_identical(tmp_path):
    """A NaN in a norm's scale: every gradient non-finite, the step skipped; the stacked
    scaling state (and the rest) as it was, bit for bit, though the amaxes it measured were
    NaN."""
    trainer = mptrain.Trainer(_config("delayed", True), tmp_path)
    state = trainer.init_state()
    batch = trainer.build_datasets()[0].get_batch(0)
    step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    state, _ = step(state, batch)  # calibrated: scales and a history entry to keep
    params = {**state.params, "final_norm": {"scale": state.params["final_norm"]["scale"] * np.nan}}
    poisoned = state.replace(params=params)
    new, metrics = step(poisoned, trainer.build_datasets()[0].get_batch(1))
    assert not bool(metrics["applied"]) and int(new.skipped_steps) == 1
    before = jax.device_get(poisoned.model_state)
    assert jax.tree.leaves(before[fp8.META])[0].shape[0] == 2  # both layers, one stack
    assert_trees_bytes_equal(jax.device_get(new.model_state), before)
    assert_trees_bytes_equal(jax.device_get(new.opt_state), jax.device_get(poisoned.opt_state))


def _command(workdir):
    return [
        sys.executable,
        "-m",
        "mptrain.main",
        f"--config={ROOT / 'configs' / 'llama3.py'}:tiny",
        f"--workdir={workdir}",
        "--config.precision=fp8-mixed",
        "--config.fp8.bf16_layers=0",
        "--config.fp8.min_size=0",
        "--config.num_train_steps=12",
        "--config.checkpoint_every_steps=3",
        "--config.log_every_steps=3",
        "--config.eval_every_steps=12",
        "--config.eval_steps=2",
    ]


@pytest.mark.slow  # three runs: 12 steps, 6 and 6
def test_kill_9_then_resume_equals_the_uninterrupted_scanned_fp8_run(tmp_path):
    """The tiny Llama as shipped (scanned, remat on) in fp8 with both blocks fp8: killed once
    its checkpoint 6 is down, run again, it ends with the uninterrupted run's bytes."""
    config = load_config("llama3", "tiny")
    assert config.model.scan_layers and config.model.remat != "none"
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    kill_9_and_resume(_command, straight, crashed, 6)
    want, got = plain_orbax_state(straight, 12), plain_orbax_state(crashed, 12)
    assert jax.tree.leaves(got["model_state"][fp8.META])[0].shape[0] == 2
    assert_trees_bytes_equal(want, got)


def test_the_precision_report_names_the_fp8_matmuls_by_layer(tmp_path):
    """What `fp8_names.describe` reads from the scaling state, which the precision report and
    the start-up log print with the fp8 share of the FLOPs."""
    state = mptrain.Trainer(_config("current", True), tmp_path / "a").init_state()
    matmuls = "attn/k, attn/o, attn/q, attn/v, mlp/down, mlp/gate, mlp/up"
    assert fp8_names.describe(state.model_state) == f"{matmuls} in layers 0-1 (14 matmuls)"
    # tiny's width is 128: the filter at 256 leaves none, scanned or not, and no fp8 state
    for scan in (True, False):
        filtered = _config("current", scan, **{"fp8.min_size": 256})
        none = mptrain.Trainer(filtered, tmp_path / f"filtered_{scan}").init_state().model_state
        assert fp8_names.describe(none).startswith("none") and fp8.META not in none
    names = fp8_names.counter_names(state.model_state)
    first = ["layers_0/attn/k x", "layers_0/attn/k kernel", "layers_0/attn/k grad"]
    assert names[:4] == [*first, "layers_1/attn/k x"]  # a stack's layers, one after the other


def test_a_resume_that_would_change_which_matmuls_run_in_fp8_is_refused_naming_the_key():
    """The checkpoint's config against the new one, as the recipe resolves them: an unset key
    and its default are the same; a layout key changed is one line naming it."""
    from mptrain import errors
    from mptrain.train import checkpoint_meta

    policy = "params=float32,compute=bfloat16,output=float32,fp8"
    saved = {"model": {"name": "llama"}, "fp8": {"bf16_layers": None}}
    meta = {"step": 4, "config": saved, "policy": policy}
    same = {"model": {"name": "llama"}, "fp8": {"bf16_layers": 1}, "num_train_steps": 8}
    checkpoint_meta.check_resumable(meta, policy, same, "in runs/x")  # 1 is the default
    changed = {**same, "fp8": {"bf16_layers": 0}}
    with pytest.raises(
        errors.ConfigError, match=r"config\.fp8\.bf16_layers=0: .* fp8\.bf16_layers=1;"
    ):
        checkpoint_meta.check_resumable(meta, policy, changed, "in runs/x")
    other = {**same, "fp8": {"scaling": "delayed"}}  # the same state, scaled another way
    checkpoint_meta.check_resumable(meta, policy, other, "in runs/x")


@pytest.mark.slow  # a second variant: make test keeps one device, no accumulation
@needs_devices(8)
def test_the_scanned_fp8_state_trains_on_a_4x2_mesh_with_accumulation_and_resumes_on_one(
    tmp_path,
):
    """Delayed scaling, both blocks fp8, 2 micro-batches an update on a data 4 x fsdp 2 mesh:
    one history entry an update, every layer's; the checkpoint resumes on one device."""
    mesh = {"mesh.data": 4, "mesh.fsdp": 2, "optimizer.accumulation_steps": 2, "batch_size": 8}
    wide = mptrain.Trainer(_config("delayed", True, num_train_steps=4, **mesh), tmp_path)
    wide.train_and_evaluate()
    saved = plain_orbax_state(tmp_path, 4)
    history = jax.tree.leaves(saved["model_state"][fp8.META])[0]
    assert history.shape == (2, 3, fp8.Recipe().history)  # both layers, stacked
    assert (history[:, :, :2] > 0).all() and (history[:, :, 2:] == 0).all()  # 2 updates
    one = {"mesh.data": 1, "mesh.fsdp": 1, "optimizer.accumulation_steps": 2, "batch_size": 8}
    resumed = mptrain.Trainer(_config("delayed", True, num_train_steps=8, **one), tmp_path)
    final = resumed.train_and_evaluate()
    assert int(final.step) == 8 and np.isfinite(resumed.last_eval["eval_loss"])
