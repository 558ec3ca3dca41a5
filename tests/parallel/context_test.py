"""A sequence split over a `context` mesh axis: the attention alone and whole runs, against the
unsplit sequence on fake CPU devices; a layout that cannot work refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    LLAMA_SCALING,
    ROOT,
    cudnn_as_xla,
    load_config,
    needs_devices,
    normal,
    plain_orbax_state,
    pretend_gpu,
    start_processes,
    tiny_config,
    wait_for_processes,
)
from jax.sharding import Mesh, PartitionSpec

import mptrain
from mptrain.inspect import hlo
from mptrain.inspect import program as prog_lib
from mptrain.models import attention, segments, splash
from mptrain.models.decoder import blocks, context_attention, rope
from mptrain.parallel import layout, view
from mptrain.train import trainer as trainer_lib


def test_the_balanced_order_gives_each_device_a_head_and_a_tail_chunk():
    order = layout.balanced_order(16, 4)  # chunks of 2: device i holds chunks i and 7 - i
    assert order.reshape(4, 4).tolist() == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9],
    ]  # fmt: skip
    batch = layout.balanced({"inputs": np.arange(16)[None], "segment_lengths": np.ones((1, 3))}, 4)
    assert batch["inputs"].tolist() == batch["positions"].tolist() == [order.tolist()]
    assert batch["segment_lengths"].shape == (1, 3)  # not along the sequence: as it was
    with pytest.raises(ValueError, match="a sequence of 12 tokens: mesh.context=4 .* 8 equal"):
        layout.balanced_order(12, 4)


def _packed(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Two rows' segment ids and positions: three examples of 10, 13 and 7 32nds of the row and
    padding, crossing the chunks' boundaries; one example the whole row."""
    lengths = [tuple(length * n // 32 for n in (10, 13, 7)), (length,)]
    ids = np.zeros((2, length), np.int32)
    positions = np.zeros((2, length), np.int32)
    for row, parts in enumerate(lengths):
        start = 0
        for n, size in enumerate(parts, 1):
            ids[row, start : start + size] = n
            positions[row, start : start + size] = np.arange(size)
            start += size
    return ids, positions


@needs_devices(4)
def test_attention_split_over_context_equals_the_whole_sequence_forward_and_backward():
    """GQA (4 query heads over 2), packed rows, Llama 3's RoPE scaling, fp32: outputs and dQ, dK,
    dV under a context axis of 4 equal the whole sequence's; and those of the fused kernels'
    split (`context_attention`: two calls a chunk merged by their log-sum-exps, FlashAttention-2's
    backward), run with its jnp kernel, on whole rows. One compiled program."""
    batch, length, heads, kv, depth = 2, 32, 4, 2, 16
    q, k, v = (normal(i, (batch, length, n, depth)) for i, n in enumerate((heads, kv, kv)))
    weights = normal(3, (batch, length, heads, depth))
    ids, positions = _packed(length)
    inv_freq = rope.rope_frequencies(depth, 10_000.0, LLAMA_SCALING)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 1, 1, 4, 1), layout.AXES)

    def attend(q, k, v, weights, positions, ids, fused=False):
        q, k = (rope.apply_rope(x, positions, inv_freq) for x in (q, k))
        local = view.current()  # in the shard_map below, the context split; else None
        split = local and local.sequence()
        if fused and split is None:
            out = attention.causal_attention(q, k, v, "materialized")
        elif fused:
            index = jax.lax.axis_index(split.axis)
            kernel = context_attention.REFERENCE
            out = context_attention.split_attention(q, k, v, index, 4, split.gather, kernel)
        else:
            k, v, keys = blocks._keys(k, v, positions, segments.Segments(ids))
            out = attention.causal_attention(q, k, v, "materialized", **keys)
        return jnp.sum(out * weights), out

    def grads(*args):
        with_grads = jax.value_and_grad(attend, (0, 1, 2), has_aux=True)
        return [with_grads(*args, fused=fused) for fused in (False, True)]

    def split(*args):
        return [(out, dqkv) for (_, out), dqkv in grads(*args)]

    along = PartitionSpec(None, "context")
    split = jax.shard_map(
        split, mesh=mesh, in_specs=along, out_specs=along, check_vma=False
    )  # fmt: skip
    order = layout.balanced_order(length, 4)
    both = jax.jit(lambda *a: (grads(*a), split(*(x[:, order] for x in a))))
    wants, gots = both(q, k, v, weights, positions, ids)
    program = both.lower(q, k, v, weights, positions, ids).compile().as_text()
    by_axis = hlo.by_axis(prog_lib.Program(program), dict(mesh.shape))
    assert set(by_axis) == {"context"} and by_axis["context"] > 0  # the keys' gathers
    for ((_, want), want_grads), (got, got_grads), path in zip(
        wants, gots, ("mask", "fused"), strict=True
    ):
        np.testing.assert_allclose(got, want[:, order], rtol=1e-5, atol=1e-6, err_msg=path)
        for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
            message = f"{path}: d{name}"
            np.testing.assert_allclose(g, w[:, order], rtol=1e-5, atol=1e-6, err_msg=message)


def _run(arg: str, mesh: dict, tmp_path, **overrides):
    """`configs/llama3.py:<arg>` for 3 steps on `mesh`: the per-step losses, the evaluation's
    (split as the training is: `sharding.forward_fn`) and the params.
    SGD with momentum, whose update is proportional to its gradient: AdamW's first steps turn a
    gradient of rounding size into a step of the learning rate, so they compare the roundings
    of two summation orders, not the two layouts."""
    keys = {
        "precision": "fp32", "num_train_steps": 3, "log_every_steps": 1, "eval_every_steps": 3,
        "eval_steps": 1, "checkpoint_every_steps": 3, "model.attention": "materialized",
        "optimizer.schedule": "constant", "optimizer.name": "sgd", "optimizer.momentum": 0.9,
        "optimizer.learning_rate": 0.3, "optimizer.weight_decay": 0.0, "data.seq_len": 64,
        "optimizer.warmup_steps": 0,
    }  # fmt: skip
    mesh = {f"mesh.{k}": v for k, v in mesh.items()}
    config = load_config("llama3", arg, **{**keys, **mesh, **overrides})
    state = trainer_lib.Trainer(config, tmp_path).train_and_evaluate()
    rows = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    losses = [r[k] for r in rows for k in ("loss", "eval_loss") if k in r]  # the eval's too
    return losses, jax.device_get(state.params)


def _assert_same_run(got, want, rtol: float):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    for x, y in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert np.max(np.abs(x - y)) <= rtol * np.max(np.abs(y)), np.max(np.abs(x - y))


@pytest.mark.slow
@needs_devices(8)
@pytest.mark.parametrize("arg", ["tiny", "sft_tiny"])  # sft_tiny: packed rows
def test_a_run_split_over_context_trains_as_fsdp(arg, tmp_path):
    """fp32: fsdp 2 x context 4 and context 8 train as fsdp 8, step by step, to 1e-5 of the
    largest param; packed rows whose examples cross the chunks' boundaries too (on fsdp 2 x
    context 4, where each row's 4 chunks already cut examples: context 8 alone is tiny's)."""
    want = _run(arg, {"data": 1, "fsdp": 8}, tmp_path / "fsdp")
    meshes = {"2x4": {"data": 1, "fsdp": 2, "context": 4}, "8": {"data": 1, "context": 8}}
    for name, mesh in meshes.items() if arg == "tiny" else [("2x4", meshes["2x4"])]:
        _assert_same_run(_run(arg, mesh, tmp_path / name), want, 1e-5)


@pytest.mark.slow
@needs_devices(8)
def test_bf16_mixed_split_over_context_stays_within_its_band(tmp_path):
    """bf16-mixed: fsdp 2 x context 4 against fsdp 8, the same 3 steps (bf16 keys and values,
    sums in another order): losses and params within a bf16 ulp (2^-8) of the largest."""
    want = _run("tiny", {"data": 1, "fsdp": 8}, tmp_path / "fsdp", precision="bf16-mixed")
    mesh = {"data": 1, "fsdp": 2, "context": 4}
    _assert_same_run(_run("tiny", mesh, tmp_path / "cp", precision="bf16-mixed"), want, 2**-8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"data.seq_len": 60},
            "mesh.context=4: data.seq_len=60 tokens, which 8 equal chunks",
        ),
        (
            {
                "model.attention": "auto",
                "model.rope_scaling": ("longrope", (1.0,) * 16, (2.0,) * 16, 32, 1.2),
            },
            "mesh.context=4: model.rope_scaling is longrope",
        ),
        (
            {"mesh.fsdp": 4},
            "mesh.data=1, mesh.fsdp=4, mesh.expert=1, mesh.context=4, mesh.tensor=1: a mesh of 16",
        ),
    ],
)
@needs_devices(8)
def test_a_layout_that_cannot_work_is_refused_by_name(overrides, message):
    config = load_config(
        "llama3", "tiny", **{"mesh.data": 1, "mesh.context": 4, "batch_size": 8, **overrides}
    )
    with pytest.raises(mptrain.config.ConfigError, match=message):
        mptrain.config.validate(config)


@needs_devices(2)
def test_a_model_or_attention_that_cannot_take_a_split_sequence_is_refused(monkeypatch):
    config = tiny_config(**{"mesh.data": 1, "mesh.context": 2})
    with pytest.raises(mptrain.config.ConfigError, match="model.name='transformer_lm' does not"):
        mptrain.config.validate(config)
    pretend_gpu(monkeypatch)  # where "auto" picks cuDNN: its split attention takes whole rows
    cudnn_as_xla(monkeypatch)  # the config's abstract init traces it; no cuDNN here
    mesh = {"mesh.data": 1, "mesh.context": 2}
    mptrain.config.validate(load_config("llama3", "tiny", **mesh))
    for arg, what, window in (("sft_tiny", "packed rows", None), ("tiny", "a sliding window", 16)):
        config = load_config("llama3", arg, **mesh, **{"model.sliding_window": window})
        with pytest.raises(mptrain.config.ConfigError, match=f"runs cuDNN here, .* take {what}"):
            mptrain.config.validate(config)


@pytest.mark.slow
@needs_devices(8)
def test_a_checkpoint_of_fsdp_8_resumes_split_over_context(tmp_path):
    """3 steps under fsdp 8, then 3 more under fsdp 2 x context 4 from its checkpoint: the
    6-step run of fsdp 8 alone, step by step, to 1e-5 of the largest param."""
    straight = _run("tiny", {"data": 1, "fsdp": 8}, tmp_path / "straight", num_train_steps=6)
    _run("tiny", {"data": 1, "fsdp": 8}, tmp_path / "resumed")
    mesh = {"data": 1, "fsdp": 2, "context": 4}
    resumed = _run("tiny", mesh, tmp_path / "resumed", num_train_steps=6)
    assert len(resumed[0]) == 6 + 2  # six steps and two evaluations
    _assert_same_run(resumed, straight, 1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")  # its processes compete for the same 2 cores
@needs_devices(4)
def test_two_processes_split_each_sequence_over_context_as_one_process_does(tmp_path):
    """Two processes of 2 devices each, mesh fsdp 2 x context 2 (a process holds whole
    sequences, split over its own two devices): the run of one process on fsdp 4."""
    keys = {
        "precision": "fp32", "num_train_steps": 3, "checkpoint_every_steps": 3,
        "eval_every_steps": 3, "eval_steps": 1, "model.attention": "materialized",
        "optimizer.schedule": "constant", "optimizer.name": "sgd", "optimizer.momentum": 0.9,
        "optimizer.learning_rate": 0.3, "optimizer.weight_decay": 0.0, "data.seq_len": 64,
        "optimizer.warmup_steps": 0,
        "mesh.data": 1,
    }  # fmt: skip
    flags = [f"--config.{k}={v}" for k, v in keys.items()]
    llama = f"--config={ROOT / 'configs' / 'llama3.py'}:tiny"
    procs = start_processes(
        tmp_path / "two", *flags, "--config.mesh.fsdp=2", "--config.mesh.context=2", config=llama
    )
    results = wait_for_processes(procs)
    assert [code for code, _ in results] == [0, 0], "\n".join(e[-3000:] for _, e in results)
    _run("tiny", {"data": 1, "fsdp": 4}, tmp_path / "one")
    got = plain_orbax_state(tmp_path / "two", 3)["params"]
    one = plain_orbax_state(tmp_path / "one", 3)["params"]
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        assert np.max(np.abs(x - y)) <= 1e-5 * np.max(np.abs(y))


@pytest.mark.slow  # Pallas's interpret mode
@needs_devices(4)
def test_the_tpu_kernel_on_a_split_sequence_equals_the_whole_sequence():
    """The splash kernel (`splash.split_attention`, Pallas's interpret mode) on a context axis
    of 4: packed rows crossing the chunks, GQA, a sliding window of 200; outputs and dQ, dK, dV
    equal the whole sequence's materialised attention, to 1e-5 in fp32."""
    from jax.experimental.pallas import tpu as pltpu

    batch, length, heads, kv, depth = 2, 1024, 4, 2, 16  # chunks of 128: the kernel's tile
    q, k, v = (normal(i, (batch, length, n, depth)) for i, n in enumerate((heads, kv, kv)))
    weights = normal(3, (batch, length, heads, depth))
    ids, _ = _packed(length)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 1, 1, 4, 1), layout.AXES)

    def attend(q, k, v, weights, ids):
        local = view.current()
        split = local and local.sequence()
        if split is None:
            out = attention.causal_attention(q, k, v, "materialized", segment_ids=ids, window=200)
        else:
            index = jax.lax.axis_index(split.axis)
            out = splash.split_attention(q, k, v, index, 4, split, ids, window=200)
        return jnp.sum(out * weights), out

    grads = jax.value_and_grad(attend, (0, 1, 2), has_aux=True)

    def split(*args):
        (_, out), dqkv = grads(*args)
        return out, dqkv

    along = PartitionSpec(None, "context")
    split = jax.shard_map(split, mesh=mesh, in_specs=along, out_specs=along, check_vma=False)
    order = layout.balanced_order(length, 4)
    with pltpu.force_tpu_interpret_mode():
        (_, want), want_grads = jax.jit(grads)(q, k, v, weights, ids)
        got, got_grads = jax.jit(split)(*(x[:, order] for x in (q, k, v, weights, ids)))
    np.testing.assert_allclose(got, want[:, order], rtol=1e-5, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w[:, order], rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
