"""A rehearsal at pod size: the train step compiled (never run) for meshes of up to 256 devices.

For each device count the script starts itself again with that many fake CPU devices
(`--xla_force_host_platform_device_count`), builds the Trainer of each model from abstract
shapes only (`jax.eval_shape`: nothing is allocated), lowers and compiles its train step with
the mesh's shardings, and reads from the compiled program:

- per-device state: the bytes of the state's shards that one device holds (params, optimizer
  state, loss scale), from the shardings;
- per-device temporaries: `compiled.memory_analysis().temp_size_in_bytes` (activations and
  everything else the step needs while it runs, as XLA:CPU plans it);
- collective bytes per step by op and dtype: `mptrain.inspect.audit.collectives`, the logical
  size of every tensor each all-reduce / reduce-scatter / all-gather handles.

XLA:CPU plans memory and collectives much as XLA:GPU/TPU do for the same sharded program, but
not identically: GPU compilers fuse, rematerialise and overlap differently, so read the
temporaries as an order of magnitude and the state and collective bytes as exact.

    python scripts/plan_scale.py                        # 8, 64 and 256 devices, both models
    python scripts/plan_scale.py --devices=8 --models=lm_bf16

Writes the table to stdout and JSON to --out (default runs/plan_scale.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the mptrain of this checkout

from mptrain import files  # noqa: E402
from mptrain.record import log_totals  # noqa: E402

# name: (config overrides of configs/lm_bf16.py, sequences per device, meshes as fsdp sizes)
MODELS = {
    # configs/lm_bf16.py itself: 3.2M params, d_model 256, 4 layers, 256 bytes a sequence
    "lm_bf16": ({}, 4, ("1",)),
    # about 1.2B params: d_model 2048, 24 layers, d_ff 8192, 1024 bytes a sequence
    "lm_1b": (
        {"d_model": 2048, "num_layers": 24, "num_heads": 16, "d_ff": 8192, "max_len": 1024},
        1,
        ("8", "all"),
    ),
}


def _config(model: str, devices: int, fsdp: str):
    import runpy

    config = runpy.run_path(str(ROOT / "configs" / "lm_bf16.py"))["get_config"](None)
    overrides, per_device, _ = MODELS[model]
    config.model.update(overrides)
    config.data.seq_len = config.model.max_len
    config.batch_size = per_device * devices
    config.mesh.fsdp = devices if fsdp == "all" else min(int(fsdp), devices)
    config.mesh.data = devices // config.mesh.fsdp
    return config


def _plan(model: str, fsdp: str) -> dict:
    """Compiles one model's train step on all of this process's devices; returns the figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mptrain.inspect import audit
    from mptrain.parallel import layout
    from mptrain.train import trainer as trainer_lib

    devices = jax.device_count()
    config = _config(model, devices, fsdp)
    trainer = trainer_lib.Trainer(config, "/nonexistent")  # nothing is written
    sample = {k: np.zeros((1, config.data.seq_len), np.int32) for k in ("inputs", "targets")}
    init, args = trainer.make_init(sample)
    state = jax.eval_shape(init, *args)  # abstract: shapes, dtypes and shardings
    batch_sharding = layout.batch_sharding(trainer.mesh)
    batch = {
        k: jax.ShapeDtypeStruct((config.batch_size, config.data.seq_len), jnp.int32,
                                sharding=batch_sharding)
        for k in ("inputs", "targets")
    }  # fmt: skip
    totals = jax.eval_shape(log_totals.LogTotals.zeros)
    started = time.monotonic()
    step = jax.jit(trainer.make_train_step(), donate_argnums=0)
    compiled = step.lower(state, batch, totals).compile()
    seconds = time.monotonic() - started
    shard_bytes = 0
    for leaf in jax.tree.leaves(state):
        shape = leaf.sharding.shard_shape(leaf.shape)
        shard_bytes += int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize
    memory = compiled.memory_analysis()
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    return {
        "model": model,
        "devices": devices,
        "mesh": dict(trainer.mesh.shape),
        "params": int(n_params),
        "batch": config.batch_size,
        "seq_len": config.data.seq_len,
        "state_bytes_per_device": shard_bytes,
        "temp_bytes_per_device": int(memory.temp_size_in_bytes),
        "collectives": audit.collectives(compiled.as_text()),
        "compile_seconds": round(seconds, 1),
    }


def _worker(models: list[str]) -> None:
    import jax

    for model in models:
        sizes = {min(jax.device_count(), 10**9 if f == "all" else int(f)) for f in MODELS[model][2]}
        for fsdp in sorted(sizes):  # "8" and "all" are one mesh on 8 devices
            print(json.dumps(_plan(model, str(fsdp))), flush=True)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}" if n < 2**30 else f"{n / 2**30:.2f}"


def _print_table(rows: list[dict]) -> None:
    head = f"{'model':<8} {'params':>7} {'devices':>7} {'mesh d x f':>10} {'state GiB/dev':>13}"
    head += f" {'temp GiB/dev':>12}  collective bytes per step by dtype (MiB)"
    print(head)
    for r in rows:
        moved = []
        for op, by_dtype in sorted(r["collectives"].items()):
            parts = ", ".join(f"{d} {b / 2**20:.1f}" for d, b in sorted(by_dtype.items()))
            moved.append(f"{op}: {parts}")
        mesh = f"{r['mesh']['data']} x {r['mesh']['fsdp']}"
        print(
            f"{r['model']:<8} {r['params'] / 1e6:>6.1f}M {r['devices']:>7} {mesh:>10} "
            f"{_gib(r['state_bytes_per_device']):>13} {_gib(r['temp_bytes_per_device']):>12}  "
            + "; ".join(moved)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="8,64,256", help="comma-separated device counts")
    parser.add_argument("--models", default=",".join(MODELS), help="from: " + ", ".join(MODELS))
    parser.add_argument("--out", default="runs/plan_scale.json", help="JSON results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models.split(",")
    if args.worker:
        _worker(models)
        return
    rows, started = [], time.monotonic()
    for devices in (int(d) for d in args.devices.split(",")):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        command = [sys.executable, __file__, "--worker", f"--models={args.models}"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"{devices} devices failed:\n{done.stderr[-3000:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        print(f"... {devices} devices compiled ({time.monotonic() - started:.0f} s)", flush=True)
    _print_table(rows)
    files.write_json(args.out, rows)
    print(f"wrote {args.out} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
