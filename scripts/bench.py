"""Speed and memory of each precision preset: mptrain against the same model written by hand.

For the default LM (`configs/default.py`, or `--lm_config`) and the ResNet
(`configs/cifar10_resnet.py`, synthetic images: speed does not depend on the pixels) and for
each preset, in one process:

- compile time of the train step (trace, lower and compile of a fresh jit), mptrain and hand;
- median step time of three sides, alternated in blocks so that drift of the machine cancels:
  `loop`, mptrain's own `Trainer.train` (host hooks, metrics, SIGTERM checks included);
  `bare`, the same compiled mptrain step called in a plain Python loop; `hand`, the model written
  in plain flax + optax, jitted with its state donated;
- ratios per block, then their median: loop/hand, bare/hand, and bare/loop (the loop's steps/s
  as a fraction of the bare step's);
- tokens or images per second of the loop; model FLOPs a step (3x the forward pass: the LM's
  counted from its config, other models' from their traced forward pass; see
  `bench_report.py`), the TFLOP/s they make and the MFU against the device's dense peak for the
  row's matmul dtype; XLA's own FLOP count, labelled (it misses cuDNN's work on a GPU);
- state bytes per param (params + optimizer state), `memory_analysis()` of both compiled steps
  (arguments and temporaries) and, on a GPU or TPU, the devices' peak bytes in use.

The table's header and the JSON name the device, the jax version and the date. Both sides run
under the same XLA flags: XLA's deterministic GPU kernels, as a run of the configs (whose
`deterministic` is True) gets them, or its default ones with `--nondeterministic`.

The hand-written side (`bench_hand.py`) does what each preset means, as a careful user would
write it; what mptrain does beyond it is what the ratio costs.

Sizes: `full` runs the configs as they are; `small` shrinks the ResNet (width 16, one block a
stage, 64 images) and runs an LM whose step needs over a TFLOP (configs/lm_gpt2s.py) at its
:tiny size; `auto` is small on a CPU, full on an accelerator. `tiny` runs both models' :tiny
variants: host-bound steps of a millisecond or two, as small steps are on a GPU, where the loop's
own cost shows most (30 blocks of 40 steps by default). On a CPU bf16 and fp16 are emulated, so
compare ratios, never absolute times.

  python scripts/bench.py                     # every row: about 16 minutes on 2 CPU cores
  python scripts/bench.py --size=tiny         # the loop's overhead on host-bound steps
  python scripts/bench.py --models=lm --cases=bf16-mixed,bf16-mixed+dyn --blocks=30 --block_steps=8
  python scripts/bench.py --lm_config=configs/lm_gpt2s.py --models=lm --out=runs/bench_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import importlib.util
import os
import runpy
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import mptrain
from mptrain import config as config_lib
from mptrain import data as data_lib
from mptrain import files, runtime
from mptrain.inspect import audit
from mptrain.train import trainer as trainer_lib

ROOT = Path(__file__).resolve().parents[1]


def _sibling(name: str):
    """A module beside this script, found as well when this file runs through `runpy`."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _sibling("bench_report")
make_hand = _sibling("bench_hand").make_hand  # bench_overhead.py and the tests take it from here

# (row name, precision preset, loss-scale kind); the dynamic rows scale in both mptrain and hand.
CASES = {
    "fp32": ("fp32", "none"),
    "bf16-mixed": ("bf16-mixed", "none"),
    "bf16-mixed+dyn": ("bf16-mixed", "dynamic"),
    "fp16-mixed+dyn": ("fp16-mixed", "dynamic"),
    "bf16-pure": ("bf16-pure", "none"),
}
MODELS = {"lm": "configs/default.py", "resnet": "configs/cifar10_resnet.py"}
# On a CPU: ResNet-18's shape at a quarter of the width, one block per stage, 64 images a step.
CPU_RESNET = {"model.width": 16, "model.stage_sizes": (1, 1, 1, 1), "batch_size": 64}
# --size=small runs an LM whose step needs more model FLOPs than this at its :tiny size
# (configs/lm_gpt2s.py's needs 10 TFLOP: minutes a step on a CPU; configs/lm_bf16.py's 0.2).
SMALL_MAX_LM_FLOPS = 1e12


class SyntheticImages:
    """CIFAR-shaped batches from a small pool made once: `get_batch(i)` costs the host nothing."""

    def __init__(self, config, pool: int = 4):
        rng = np.random.default_rng(config.seed)
        n, classes = config.batch_size, config.model.num_classes
        self.batches = [
            {
                "inputs": rng.standard_normal((n, 32, 32, 3), np.float32),
                "targets": rng.integers(0, classes, n).astype(np.int32),
            }
            for _ in range(pool)
        ]

    def get_batch(self, index: int) -> dict[str, np.ndarray]:
        return self.batches[index % len(self.batches)]


def resolve_size(model: str, size: str, path: str | None = None) -> str:
    """The variant `model` runs at under `--size` (auto resolved): "full", "small" or "tiny"."""
    if size != "small":
        return size
    if model == "resnet":
        return "small"
    config = runpy.run_path(path or str(ROOT / MODELS[model]))["get_config"](None)
    too_big = config.model.name == "transformer_lm" and report.lm_flops(config) > SMALL_MAX_LM_FLOPS
    return "tiny" if too_big else "full"


def load_config(model: str, case: str, size: str, path: str | None = None):
    """`path` (default: the model's config file) under `case`'s preset, at `size` (a
    `resolve_size` result): "tiny" is the file's :tiny variant, "small" the shrunk ResNet."""
    path = path or str(ROOT / MODELS[model])
    config = runpy.run_path(path)["get_config"]("tiny" if size == "tiny" else None)
    preset, scale = CASES[case]
    overrides = {"precision": preset, "loss_scale.kind": scale}
    if model == "resnet" and size == "small":
        overrides |= CPU_RESNET
    config_lib.override(config, overrides)
    # No eval, checkpoint or end of the schedule inside a timed block, and one log step: its
    # last (see `mptrain_sides`), more often than any config logs (the :tiny ones' every 2 steps
    # are for tests).
    config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 10**9
    config.log_every_steps = 10**9
    return config


def sources(config):
    if config.model.name == "resnet":
        return SyntheticImages(config), SyntheticImages(config)
    return data_lib.create_sources(config)


@contextlib.contextmanager
def mptrain_sides(config, workdir):
    """The `loop` and `bare` sides over one `Trainer.setup`: each is `fn(indices) -> seconds`;
    `info` holds the compile time, the compiled step's memory, bytes/param, the model FLOPs (see
    `bench_report`), the audit's and XLA's counts of the step, the mesh's devices and the `Run`."""
    trainer = trainer_lib.Trainer(config, workdir)
    train, evaluation = sources(config)
    info = {}
    with runtime.PreemptionFlag() as flag, trainer.setup(train, evaluation) as run:
        jitted = jax.jit(trainer.make_train_step(), donate_argnums=0)
        started = time.perf_counter()  # a fresh jit: setup compiled its own already
        traced = jitted.trace(run.state, trainer.device_batch(train, 0), run.totals)
        compiled = traced.lower().compile()
        info["compile_s"] = time.perf_counter() - started
        step_report = audit.make_report(traced.jaxpr, compiled, (run.state,))
        info["audit_step_flops"] = report.traced_flops(step_report)
        forward = functools.partial(  # the loss, traced apart from the step only where needed
            audit.precision_report,
            trainer.loss_fn,
            *(run.state.params, run.state.model_state, trainer.device_batch(train, 0)),
            jax.random.key(0),
            policy=run.state.policy,
        )
        info["flops"], info["flop_source"] = report.model_flops(config, forward)
        info["memory"] = run.train_step.memory_analysis()
        costs = run.train_step.cost_analysis()  # XLA's count: no cuDNN convolutions on a GPU
        costs = costs[0] if isinstance(costs, list) else costs or {}
        info["xla_flops"] = costs.get("flops", float("nan"))
        info["bytes_per_param"] = audit.state_bytes_per_param(run.state.params, run.state.opt_state)
        info["devices"] = list(trainer.mesh.devices.flat)
        info["run"] = run

        def loop(indices) -> float:
            started = time.perf_counter()
            run.start, config.num_train_steps = indices.start, indices.stop
            trainer.train(run, flag)  # its last step is a log step: it ends with a metrics read
            jax.block_until_ready(run.state)
            return time.perf_counter() - started

        def bare(indices) -> float:
            started = time.perf_counter()
            state, totals = run.state, run.totals
            for i in indices:
                state, metrics, totals = run.train_step(
                    state, trainer.device_batch(train, i), totals
                )
            jax.device_get(metrics["loss"])
            run.state, run.totals = state, totals
            jax.block_until_ready(run.state)
            return time.perf_counter() - started

        yield loop, bare, info, train


def measure(model: str, case: str, args) -> dict:
    path = getattr(args, f"{model}_config")
    size = resolve_size(model, args.size, path)
    config = load_config(model, case, size, path)
    config.matmul_precision = args.matmul_precision
    workdir = tempfile.TemporaryDirectory(prefix="bench_")
    with workdir, mptrain_sides(config, workdir.name) as (loop, bare, info, train):
        hand_step, fresh, hand_compile = make_hand(config, train)
        hand_state = fresh()
        hand_bytes = audit.state_bytes_per_param(hand_state["params"], hand_state["opt_state"])
        box = [hand_state]

        def hand(indices) -> float:
            started = time.perf_counter()
            state = box[0]
            for i in indices:
                state, loss = hand_step(state, jax.device_put(train.get_batch(i)))
            jax.device_get(loss)
            box[0] = state
            return time.perf_counter() - started

        sides = {"loop": loop, "bare": bare, "hand": hand}
        n, blocks = args.block_steps, []
        for b in range(args.blocks + 1):  # block 0 warms every side up and is dropped
            names = list(sides)[b % 3 :] + list(sides)[: b % 3]  # rotate who goes first
            indices = range((b + 1) * n, (b + 2) * n)
            ms = {k: 1e3 * sides[k](indices) / n for k in names}
            if b:
                blocks.append(ms)
        hand_memory = hand_step.memory_analysis()
        devices, peak = info["devices"], report.device_peak_bytes(info["devices"])
    median = lambda f: statistics.median(f(r) for r in blocks)
    step_ms = median(lambda r: r["loop"])
    items = config.batch_size * (config.data.seq_len if model == "lm" else 1)
    memory = lambda m: {
        "argument_mib": m.argument_size_in_bytes / 2**20,
        "temp_mib": m.temp_size_in_bytes / 2**20,
        "output_mib": m.output_size_in_bytes / 2**20,
        "alias_mib": m.alias_size_in_bytes / 2**20,
    }
    return {
        "model": model,
        "case": case,
        "size": size,
        "precision": config.precision,
        "loss_scale": config.loss_scale.kind,
        # what float32 matmuls ran at, on both sides (the policy's; "default" is JAX's)
        "matmul_precision": config_lib.policy_of(config).matmul_precision,
        "params": int(sum(x.size for x in jax.tree.leaves(hand_state["params"]))),
        "batch_size": config.batch_size,
        "compile_s": info["compile_s"],
        "hand_compile_s": hand_compile,
        "loop_ms": step_ms,
        "bare_ms": median(lambda r: r["bare"]),
        "hand_ms": median(lambda r: r["hand"]),
        "loop_over_hand": median(lambda r: r["loop"] / r["hand"]),
        "bare_over_hand": median(lambda r: r["bare"] / r["hand"]),
        "loop_steps_per_s_over_bare": median(lambda r: r["bare"] / r["loop"]),
        ("tokens" if model == "lm" else "images") + "_per_s": items / step_ms * 1e3,
        "model_gflop_per_step": info["flops"] / 1e9,
        "flop_source": info["flop_source"],
        **report.flop_figures(config, info["flops"], step_ms, devices),
        "audit_step_gflop_per_step": info["audit_step_flops"] / 1e9,
        "xla_gflop_per_step": info["xla_flops"] / 1e9,
        "bytes_per_param": info["bytes_per_param"],
        "hand_bytes_per_param": hand_bytes,
        "memory": memory(info["memory"]),
        "hand_memory": memory(hand_memory),
        "device_peak_mib": None if peak is None else peak / 2**20,
        "blocks_ms": blocks,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="lm,resnet", help=f"comma-separated of {list(MODELS)}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {list(CASES)}")
    p.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="timed blocks per side, after a warm one (default: 30 with --size=tiny, else 10)",
    )
    p.add_argument(
        "--block_steps", type=int, default=None, help="steps per block (default: 40 tiny, else 5)"
    )
    p.add_argument(
        "--size",
        choices=("auto", "small", "full", "tiny"),
        default="auto",
        help="full: the configs as they are; small: the ResNet shrunk for a CPU (width 16, one "
        "block a stage, batch 64) and an LM of over a TFLOP a step at its :tiny size; auto: "
        "small on a CPU, full on an accelerator; tiny: the configs' :tiny variants "
        "(host-bound steps: the loop's own cost)",
    )
    p.add_argument(
        "--matmul_precision",
        choices=("auto", "default", "high", "highest"),
        default="auto",
        help="config.matmul_precision of both sides; auto: highest for fp32 rows (strict fp32), "
        "default (TF32 on NVIDIA, one bf16 pass on a TPU) for 16-bit ones",
    )
    for model, path in MODELS.items():
        p.add_argument(f"--{model}_config", default=None, help=f"config file (default: {path})")
    p.add_argument(
        "--nondeterministic",
        action="store_true",
        help="XLA's default GPU kernels, some of which add with atomics; without it both sides "
        "run XLA's deterministic ones, as a run of a config with deterministic=True does",
    )
    p.add_argument("--out", default="runs/bench.json", help="JSON results")
    args = p.parse_args(argv)
    # Before anything touches a device: XLA reads its flags once, and they hold for both sides.
    try:
        runtime.set_determinism({"deterministic": not args.nondeterministic})
    except ValueError as e:  # XLA_FLAGS turn them off
        p.error(f"{e}; or pass --nondeterministic")
    models, cases = args.models.split(","), args.cases.split(",")
    for name, valid in (("models", MODELS), ("cases", CASES)):
        if bad := [x for x in locals()[name] if x not in valid]:
            p.error(f"--{name}: unknown {bad}; valid: {', '.join(valid)}")
    device = jax.devices()[0]
    if args.size == "auto":
        args.size = "small" if device.platform == "cpu" else "full"
    tiny = args.size == "tiny"
    args.blocks = args.blocks or (30 if tiny else 10)
    args.block_steps = args.block_steps or (40 if tiny else 5)
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    deterministic = runtime.DETERMINISTIC_FLAG in os.environ.get("XLA_FLAGS", "")
    header = (
        f"{jax.device_count()} x {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"{date}; --size={args.size}, {args.blocks} blocks of {args.block_steps} steps a side"
        + ("; deterministic GPU kernels" if deterministic and device.platform == "gpu" else "")
    )
    print(header)
    rows = []
    for model in models:
        for case in cases:
            rows.append(measure(model, case, args))
            r = rows[-1]
            print(
                f"{model} {report.case_label(r)}: loop {r['loop_ms']:.2f} ms, "
                f"hand {r['hand_ms']:.2f} ms, loop/hand {r['loop_over_hand']:.3f}",
                flush=True,
            )
    report.print_tables(header, rows)
    result = {
        "date": date,
        "jax_version": jax.__version__,
        "device": f"{device.platform}: {device.device_kind}",
        "device_kind": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "size": args.size,
        "configs": {m: getattr(args, f"{m}_config") or MODELS[m] for m in models},
        "blocks": args.blocks,
        "block_steps": args.block_steps,
        "mptrain_file": mptrain.__file__,
        **runpy.run_path(str(ROOT / "scripts/bench_overhead.py"))["git_info"](ROOT),
        "rows": rows,
    }
    files.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
