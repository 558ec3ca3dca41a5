"""The CPU's collectives each with a channel id of their own (`parallel.cpu_channels`), and XLA's
CPU thread pool sized for fake devices (`runtime.cpu_threads`): without either, steps over
several fake CPU devices crashed or timed out (sweep 2026-12-06, M34; CI's stop 76)."""

import re
import sys
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from helpers import ROOT, fake_cpu_env, needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mptrain.parallel  # noqa: F401  (installs the CPU's lowering, as every step's import does)
from mptrain import runtime


@needs_devices(8)
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's lowering")
def test_two_all_gathers_over_one_group_get_two_channel_ids():
    """JAX lowers both with channel id 1; XLA's CPU runtime would meet device 2's first with
    device 3's second at one rendezvous, each taking the other's buffer."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    spec = P("data", "tensor")

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    def gather_both(a, b):
        x = jax.lax.all_gather(a, "tensor", axis=1, tiled=True)
        y = jax.lax.all_gather(b * 2, "tensor", axis=1, tiled=True)
        return (x + y)[:, : a.shape[1]]

    a = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, spec))
    program = gather_both.lower(a, a).compile().as_text()
    ids = re.findall(r"all-gather\(.*?channel_id=(\d+)", program)
    assert len(ids) == 2 and len(set(ids)) == 2, ids


@pytest.mark.parametrize(
    "flags, nproc, want",
    [
        ("", None, None),
        ("--xla_force_host_platform_device_count=1", None, None),
        ("--xla_force_host_platform_device_count=8", None, 32),
        ("--xla_force_host_platform_device_count=2 --xla_cpu_enable_fast_math=false", None, 8),
        ("--xla_force_host_platform_device_count=8", "6", None),  # the user's own
    ],
)
def test_fake_cpu_devices_get_threads_enough_and_one_device_keeps_xla_s_count(flags, nproc, want):
    env = {"XLA_FLAGS": flags} | ({"NPROC": nproc} if nproc else {})
    assert runtime.cpu_threads(env) == want


@pytest.mark.slow  # a CLI run on 8 devices
def test_packed_sft_on_data_4_x_tensor_2_trains(tmp_path):
    """M34: `sft_tiny` at seq_len 128 (packed rows) on data 4 x tensor 2 died in its first step in
    each of 6 runs (heap corruption, SIGSEGV, rendezvous timeouts); it trains."""
    import subprocess

    command = [
        sys.executable, "-m", "mptrain.main", f"--config={ROOT / 'configs' / 'llama3.py'}:sft_tiny",
        f"--workdir={tmp_path}", "--config.data.seq_len=128", "--config.mesh.data=4",
        "--config.mesh.tensor=2", "--config.num_train_steps=4", "--config.eval_every_steps=4",
        "--config.checkpoint_every_steps=4", "--config.eval_steps=1",
    ]  # fmt: skip
    env = fake_cpu_env(8)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "4").is_dir()
