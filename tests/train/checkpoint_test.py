"""Tests for mptrain.train.checkpoint: exact round trips, plain-orbax reads, pruning, and falling
back past corrupt, truncated, non-finite and half-written checkpoints."""

import gc
import glob
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

# orbax is imported here only to read checkpoints the way a user without mptrain would, and to
# interrupt a save the way a crash would.
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_bytes_equal, needs_devices, normal

import mptrain
from mptrain import files
from mptrain.train import checkpoint, fingerprints

# When a read fails, orbax abandons its other reads, and their errors surface later as
# "exception ignored" reports (coroutines never awaited, callbacks on a closed event loop). They
# are orbax's noise after a failure that `restore` has already caught and logged.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_orbax_leftovers():
    yield
    gc.collect()  # report them now, inside this test and its filter, not at interpreter exit


N = 64  # params["w"] is N x N random normals: the one array too random for zstd to shrink


def _loss_fn(params, model_state, batch, rng):
    del rng
    y = batch["x"] @ params["w"] + params["b"]
    loss = jnp.mean((y.astype(jnp.float32) - batch["y"]) ** 2)
    if model_state:
        model_state = {
            "count": model_state["count"] + 1,
            "ema": 0.9 * model_state["ema"] + 0.1 * y.mean(),
        }
    return loss, (model_state, {})


def _train(state, num_steps):
    """`num_steps` jitted train steps; returns the state after each of them."""
    step_fn = jax.jit(mptrain.make_train_step(_loss_fn))
    batch = {"x": jnp.ones((2, N)), "y": jnp.zeros((2, N))}
    states = []
    for _ in range(num_steps):
        state, _ = step_fn(state, batch)
        states.append(state)
    return states


def _params():
    return {"w": normal(0, (N, N)), "b": jnp.zeros((N,))}


def _mixed_state(loss_scale=None):
    return mptrain.TrainState.create(
        apply_fn=None,
        params=_params(),
        tx=optax.adamw(1e-3),
        policy=mptrain.get_policy("bf16-mixed"),
        loss_scale=loss_scale or mptrain.DynamicLossScale(min_scale=4.0, hysteresis=2),
    )


@pytest.fixture(scope="module")
def states():
    """The bf16-mixed TrainState after steps 1..4: model_state and param_compensation are {}."""
    return _train(_mixed_state(), 4)


@pytest.fixture(scope="module")
def bf16_state():
    """A bf16-pure Kahan state: bf16 params and compensation, a bf16/int32 model_state,
    no loss scaling (an empty scaler node) and a non-zero uint32 rng."""
    state = mptrain.TrainState.create(
        apply_fn=None,
        params=_params(),
        tx=optax.adamw(1e-3, mu_dtype=jnp.float32),  # optax's default follows the params: bf16
        policy="bf16-pure",
        param_rounding="kahan",
        rng=7,
        model_state={"count": jnp.asarray(0, jnp.int32), "ema": jnp.zeros((), jnp.bfloat16)},
    )
    return _train(state, 2)[-1]


def _save(directory, states, **kwargs):
    ckpt = checkpoint.Checkpointer(directory, **kwargs)
    for state in states:
        ckpt.save(int(state.step), state, {"config": {"lr": 1e-3}, "policy": str(state.policy)})
    return ckpt


def _restore(directory, target, **kwargs):
    """Restores with a fresh Checkpointer, as a resumed run would."""
    with checkpoint.Checkpointer(directory) as ckpt:
        return ckpt.restore(jax.eval_shape(lambda: target), **kwargs)


def _by_path(tree):
    """{"opt_state/0/mu/w": array, ...}: TrainState and plain nested dicts, keyed alike."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out["/".join(parts)] = np.asarray(leaf)
    return out


def _data_file(directory, step):
    """The largest OCDBT data file of a checkpoint's state item.

    orbax keeps arrays in OCDBT `d/<hash>` files, zstd-compressed; small arrays are inlined in the
    B-tree nodes. The 64x64 random params["w"] (16 KiB that do not compress) is by far the largest
    value, so the largest `d/` file is the one holding its bytes.
    """
    files = glob.glob(os.path.join(directory, str(step), "state", "**", "d", "*"), recursive=True)
    return max(files, key=os.path.getsize)


def _skipped(caplog):
    return [r.getMessage() for r in caplog.records if "Skipping checkpoint" in r.getMessage()]


def _restore_falls_back_to_step_1(directory, states, caplog):
    """Restores `directory` (holding steps 1 and 2, step 2 damaged): step 1 comes back, bit for
    bit, and one warning names step 2. Returns that warning."""
    with caplog.at_level(logging.WARNING):
        restored, meta = _restore(directory, states[1])
    assert meta["step"] == 1
    assert_trees_bytes_equal(restored, states[0])
    (message,) = _skipped(caplog)
    assert "step 2" in message
    return message


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["eval_shape", "fresh"])
def test_round_trip_is_bit_identical(tmp_path, states, target):
    state = states[1]
    _save(tmp_path, [state]).close()
    if target == "eval_shape":
        abstract = jax.eval_shape(lambda: state)
    else:  # a fresh state whose scaler has other settings: the checkpoint's must win
        abstract = _mixed_state(mptrain.DynamicLossScale())
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        restored, meta = ckpt.restore(abstract)

    assert jax.tree.structure(restored) == jax.tree.structure(abstract)  # a fresh `tx` too
    assert_trees_bytes_equal(restored, state)
    assert isinstance(restored, mptrain.TrainState)
    assert isinstance(restored.opt_state[0], optax.ScaleByAdamState)
    assert isinstance(restored.opt_state[1], optax.EmptyState)
    assert restored.model_state == {} and restored.param_compensation == {}
    assert restored.policy == state.policy
    scaler = restored.loss_scale
    assert isinstance(scaler, mptrain.DynamicLossScale)
    assert float(scaler.min_scale) == 4.0 and int(scaler.hysteresis) == 2
    assert int(scaler.counter) == 2 and scaler.counter.dtype == jnp.int32
    assert restored.rng.dtype == jnp.uint32 and restored.step.dtype == jnp.int32

    assert meta["step"] == 2
    assert meta["config"] == {"lr": 1e-3}
    assert meta["policy"] == "params=float32,compute=bfloat16,output=float32"
    assert meta["mptrain_version"] == mptrain.__version__
    assert meta["fingerprint"] == fingerprints.fingerprint(state)


@pytest.mark.slow  # its own programs: make test keeps the other states' round trips
def test_bf16_kahan_state_round_trips(tmp_path, bf16_state):
    state = bf16_state
    assert state.params["w"].dtype == jnp.bfloat16
    assert state.param_compensation["w"].dtype == jnp.bfloat16
    assert np.asarray(state.param_compensation["w"]).any()  # non-trivial values
    assert int(state.model_state["count"]) == 2
    assert np.asarray(state.rng).any()
    _save(tmp_path, [state]).close()

    restored, _ = _restore(tmp_path, state)

    assert_trees_bytes_equal(restored, state)
    assert isinstance(restored.loss_scale, mptrain.NoOpLossScale)
    assert restored.model_state["ema"].dtype == jnp.bfloat16


def test_plain_orbax_reads_state_as_numpy(tmp_path, bf16_state):
    state = bf16_state
    _save(tmp_path, [state]).close()
    path = str(tmp_path / "2" / "state")

    # The recipe in mptrain/train/checkpoint.py's docstring, verbatim: orbax only, no mptrain types.
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    plain = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))

    assert isinstance(plain, dict) and isinstance(plain["params"], dict)
    # the fields of every mptrain version's checkpoints: a LoRA run's frozen base is never in
    # one, so checkpoints from before it existed restore, and those after into older versions
    fields = {"step", "params", "opt_state", "loss_scale", "rng", "skipped_steps"}
    assert set(tree) == fields | {"model_state", "param_compensation"}
    got, want = _by_path(plain), _by_path(state)
    assert sorted(got) == sorted(want)
    for name, array in got.items():
        assert type(array) is np.ndarray, name
        assert array.dtype == want[name].dtype, name
        assert array.tobytes() == want[name].tobytes(), name
    assert got["params/w"].dtype == jnp.bfloat16

    # StandardCheckpointer needs no arguments at all, and gives jax arrays with the same data.
    standard = _by_path(ocp.StandardCheckpointer().restore(path))
    assert sorted(standard) == sorted(want)
    for name, array in standard.items():
        assert array.tobytes() == want[name].tobytes(), name


@needs_devices(2)
def test_sharded_state_restores_onto_target_shardings(tmp_path, states):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = states[1].replace(params=jax.device_put(states[1].params, rows))
    _save(tmp_path, [state]).close()

    for sharding in (rows, replicated):
        abstract = jax.eval_shape(lambda: state)
        abstract = abstract.replace(
            params=jax.tree.map(
                lambda x, s=sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract.params,
            )
        )
        with checkpoint.Checkpointer(tmp_path) as ckpt:
            restored, _ = ckpt.restore(abstract)
        assert_trees_bytes_equal(restored, state)
        assert restored.params["w"].sharding == sharding


@needs_devices(8)
def test_one_process_writes_each_replicated_shard_whole_without_slicing_it(tmp_path, states):
    """Params split 4 ways and held twice (data 2 x fsdp 4): the save compiles no slice of
    them (orbax's replica-parallel writing, off on one process), and restores byte for byte."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    state = states[1].replace(params=jax.device_put(states[1].params, split))
    traced = []
    listener = lambda event, secs, **kw: traced.append(kw.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        _save(tmp_path, [state]).close()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert "slice" not in traced, traced
    abstract = jax.eval_shape(lambda: state)
    abstract = abstract.replace(
        params=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split), abstract.params
        )
    )
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(abstract)
    assert_trees_bytes_equal(restored, state)


def test_async_save(tmp_path, states):
    with checkpoint.Checkpointer(tmp_path, async_save=True) as ckpt:
        for state in states[:2]:
            ckpt.save(int(state.step), state, {})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    restored, meta = _restore(tmp_path, states[1])
    assert_trees_bytes_equal(restored, states[1])
    assert meta["step"] == 2


# --- step bookkeeping --------------------------------------------------------------------------


def test_empty_directory(tmp_path, states):
    with checkpoint.Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.all_steps() == []
        assert ckpt.latest_step() is None
        assert ckpt.restore(jax.eval_shape(lambda: states[0])) is None


def test_max_to_keep_prunes_oldest(tmp_path, states):
    with _save(tmp_path / "two", states, max_to_keep=2) as ckpt:
        assert ckpt.all_steps() == [3, 4]
        assert ckpt.latest_step() == 4
    assert sorted(os.listdir(tmp_path / "two")) == ["3", "4"]
    with _save(tmp_path / "all", states, max_to_keep=None) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3, 4]
    restored, meta = _restore(tmp_path / "two", states[0])
    assert meta["step"] == 4
    assert_trees_bytes_equal(restored, states[3])


def test_restore_given_step(tmp_path, states):
    _save(tmp_path, states[:3]).close()
    restored, meta = _restore(tmp_path, states[0], step=2)
    assert meta["step"] == 2
    assert_trees_bytes_equal(restored, states[1])
    with pytest.raises(FileNotFoundError, match="step 7"):
        _restore(tmp_path, states[0], step=7)


def test_saving_a_step_again_replaces_it(tmp_path, states):
    bad = states[1].replace(params=jax.tree.map(lambda p: p * jnp.nan, states[1].params))
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, bad, {})
        ckpt.save(2, states[1], {})
        assert ckpt.all_steps() == [2]
    restored, _ = _restore(tmp_path, states[1])
    assert_trees_bytes_equal(restored, states[1])


def test_mismatched_target_raises(tmp_path, states):
    _save(tmp_path, states[:1]).close()
    other = mptrain.TrainState.create(
        apply_fn=None,
        params={"w": jnp.zeros((N, 2 * N)), "b": jnp.zeros((2 * N,))},
        tx=optax.adamw(1e-3),
        policy="bf16-mixed",
        loss_scale=mptrain.DynamicLossScale(),
    )
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"\.params\['w'\]"):
        _restore(tmp_path, other)


# --- validation and fallback -------------------------------------------------------------------


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("where", ["zstd_header", "payload"])
def test_flipped_byte_falls_back(tmp_path, states, caplog, where):
    _save(tmp_path, states[:2]).close()
    # The file holding params["w"] is one zstd frame. A flip in its first bytes breaks the frame
    # header and orbax raises; a flip in the middle decodes without complaint into different
    # numbers (orbax 0.12 verifies a CRC on the OCDBT manifest, none on array data), which only
    # the fingerprint catches.
    path = _data_file(tmp_path, 2)
    _flip_byte(path, 0 if where == "zstd_header" else os.path.getsize(path) // 2)
    message = _restore_falls_back_to_step_1(tmp_path, states, caplog)
    if where == "payload":
        assert "fingerprint" in message


@pytest.mark.parametrize("damage", ["delete", "truncate", "delete_meta"])
def test_missing_or_truncated_file_falls_back(tmp_path, states, caplog, damage):
    _save(tmp_path, states[:2]).close()
    if damage == "delete":
        os.remove(_data_file(tmp_path, 2))
    elif damage == "truncate":
        path = _data_file(tmp_path, 2)
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        shutil.rmtree(tmp_path / "2" / "meta")
    _restore_falls_back_to_step_1(tmp_path, states, caplog)


def test_stale_arrays_caught_by_fingerprint(tmp_path, states, caplog):
    # A well-formed state item with the wrong contents (here step 1's arrays under step 2):
    # orbax reads it happily, only the fingerprint saved in step 2's meta tells.
    _save(tmp_path, states[:2]).close()
    shutil.rmtree(tmp_path / "2" / "state")
    shutil.copytree(tmp_path / "1" / "state", tmp_path / "2" / "state")

    with caplog.at_level(logging.WARNING):
        _, meta = _restore(tmp_path, states[1])

    assert meta["step"] == 1
    (message,) = _skipped(caplog)
    assert "step 2" in message and "fingerprint" in message


def test_nonfinite_params_rejected(tmp_path, states, caplog):
    bad = states[1].replace(
        params={**states[1].params, "b": states[1].params["b"].at[3].set(jnp.inf)}
    )
    _save(tmp_path, [states[0], bad]).close()

    with caplog.at_level(logging.WARNING):
        restored, meta = _restore(tmp_path, states[1])

    assert meta["step"] == 1
    assert_trees_bytes_equal(restored, states[0])
    (message,) = _skipped(caplog)
    assert "step 2" in message and "non-finite" in message and "['b']" in message


def test_every_checkpoint_invalid_raises(tmp_path, states):
    _save(tmp_path, states[:2]).close()
    for step in (1, 2):
        shutil.rmtree(tmp_path / str(step) / "meta")
    with pytest.raises(checkpoint.InvalidCheckpointError, match="none of the 2 checkpoints"):
        _restore(tmp_path, states[0])
    with pytest.raises(checkpoint.InvalidCheckpointError, match="step 1 is unusable"):
        _restore(tmp_path, states[0], step=1)


def test_interrupted_save_is_not_listed_and_only_its_owner_cleans_it(tmp_path, states, monkeypatch):
    ckpt = _save(tmp_path, states[:2])

    # Die where a killed process would: every file written, the final rename not yet done.
    async def crash(self):
        raise RuntimeError("simulated crash before the rename")

    monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ckpt.save(3, states[2], {})
    monkeypatch.undo()
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("3.")]
    assert leftovers == ["3" + checkpoint.TMP_SUFFIX]
    assert ckpt.all_steps() == [1, 2]

    ckpt.close()
    # To a reader, and to anyone who just opens the directory, it may be a save in progress:
    # only the owner's explicit call removes it.
    with checkpoint.Checkpointer(tmp_path, read_only=True) as reader:
        _, meta = reader.restore(jax.eval_shape(lambda: states[2]))
        assert meta["step"] == 2
        with pytest.raises(ValueError, match="read-only"):
            reader.save(3, states[2], {})
    with checkpoint.Checkpointer(tmp_path) as reopened:
        assert sorted(os.listdir(tmp_path)) == ["1", "2", *leftovers]
        assert reopened.remove_leftovers() == leftovers
        assert sorted(os.listdir(tmp_path)) == ["1", "2"]
        assert reopened.all_steps() == [1, 2]
        reopened.save(3, states[2], {})
        assert reopened.all_steps() == [1, 2, 3]


def test_a_reader_creates_nothing(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "absent", read_only=True) as reader:
        assert reader.all_steps() == []
    assert not (tmp_path / "absent").exists()


# --- helpers -----------------------------------------------------------------------------------


def test_fingerprint_sees_every_bit_dtype_shape_and_path():
    tree = {"a": np.arange(6, dtype=np.int32), "b": np.ones(3, np.float32)}
    base = fingerprints.fingerprint(tree)
    assert base == fingerprints.fingerprint(jax.tree.map(jnp.asarray, tree))  # device or host
    flipped = tree["b"].copy()
    flipped.view(np.uint32)[1] ^= 1
    assert fingerprints.fingerprint({**tree, "b": flipped}) != base
    assert fingerprints.fingerprint({**tree, "a": tree["a"].view(np.uint32)}) != base
    assert fingerprints.fingerprint({**tree, "a": tree["a"].reshape(2, 3)}) != base
    assert fingerprints.fingerprint({"a": tree["a"], "c": tree["b"]}) != base


def test_meta_is_lenient_json(tmp_path, states):
    class Opaque:
        def __str__(self):
            return "opaque!"

    config = ml_collections.ConfigDict({"lr": 1e-3, "dtype": jnp.bfloat16, "seed": np.int64(3)})
    meta = {"config": config, "thing": Opaque(), "shape": (2, 3), "scale": np.float32(0.5)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, states[0], meta)

    _, restored = _restore(tmp_path, states[0])
    assert restored["config"]["lr"] == 1e-3 and restored["config"]["seed"] == 3
    assert restored["config"]["dtype"] == "bfloat16"
    assert restored["thing"] == "opaque!"
    assert restored["shape"] == [2, 3] and restored["scale"] == 0.5


def test_write_json_is_atomic(tmp_path):
    path = tmp_path / "run" / "config.json"
    files.write_json(path, {"a": 1, "when": object})
    assert json.loads(path.read_text())["a"] == 1
    files.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot print")

    with pytest.raises(RuntimeError, match="cannot print"):
        files.write_json(path, {"a": 3, "bad": Unprintable()})
    assert json.loads(path.read_text()) == {"a": 2}  # the old file, whole
    assert os.listdir(path.parent) == ["config.json"]  # no temporary files left behind


def test_fingerprint_does_not_depend_on_the_sharding_and_sees_positions():
    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    base = fingerprints.fingerprint({"x": x})
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    for spec in (("d",), (None, "d"), ()):
        placed = jax.device_put(
            x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        )
        assert fingerprints.fingerprint({"x": placed}) == base  # summed on the devices, any split
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprints.fingerprint({"x": swapped}) != base
