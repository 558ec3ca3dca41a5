"""Speed and memory of each precision preset: mptrain against the same model written by hand.

For the default LM (`configs/default.py`) and the ResNet (`configs/cifar10_resnet.py`, synthetic
images: speed does not depend on the pixels) and for each preset, in one process:

- compile time of the train step (trace, lower and compile of a fresh jit), mptrain and hand;
- median step time of three sides, alternated in blocks so that drift of the machine cancels:
  `loop`, mptrain's own `Trainer.train` (host hooks, metrics, SIGTERM checks included);
  `bare`, the same compiled mptrain step called in a plain Python loop; `hand`, the model written
  in plain flax + optax, jitted with its state donated;
- tokens or images per second of the loop, the step's FLOPs (XLA's cost analysis) and the
  TFLOP/s they make, state bytes per param (params + optimizer state);
- `memory_analysis()` of both compiled steps (arguments and temporaries);
- ratios per block, then their median: loop/hand, bare/hand, and bare/loop (the loop's steps/s
  as a fraction of the bare step's).

The hand-written side does what each preset means, as a careful user would write it: the params
cast to the compute dtype inside the differentiated function, fp32 logits and loss, the optax
optimizer of the config (clip + adamw for the LM, nesterov SGD + weight decay for the ResNet),
params rounded to nearest (stochastically for bf16-pure, as mptrain does by default), and a
dynamic loss scale written out (scale, unscale, all-finite test, select, grow/back off) where the
row asks for one. It has no skipping without a scale, no metrics besides the loss, no
checkpoints: what mptrain does beyond it is what the ratio costs.

On a CPU (this repository's CI machine) bf16 and fp16 are emulated, so compare ratios, never
absolute times; the ResNet is shrunk there (`--size=auto`). On a GPU or TPU `--size=auto` runs
the configs as they are. Nothing else changes.

  python scripts/bench.py                     # every row: about 16 minutes on 2 CPU cores
  python scripts/bench.py --models=lm --cases=bf16-mixed,bf16-mixed+dyn --blocks=30 --block_steps=8
  python scripts/bench.py --lm_config=configs/lm_bf16.py --out=runs/bench_gpu.json   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import runpy
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mptrain
from mptrain import audit, files, precision, runtime
from mptrain import config as config_lib
from mptrain import data as data_lib
from mptrain import trainer as trainer_lib

ROOT = Path(__file__).resolve().parents[1]
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


def load_config(model: str, case: str, size: str, path: str | None = None):
    """`path` (default: the model's config file) under `case`'s preset; `size` "tiny" is the
    file's :tiny variant."""
    path = path or str(ROOT / MODELS[model])
    config = runpy.run_path(path)["get_config"]("tiny" if size == "tiny" else None)
    preset, scale = CASES[case]
    overrides = {"precision": preset, "loss_scale.kind": scale}
    if model == "resnet" and size == "small":
        overrides |= CPU_RESNET
    config_lib.override(config, overrides)
    # No eval, checkpoint or end of the schedule inside a timed block; each block's last step
    # is a log step (see `mptrain_sides`).
    config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 10**9
    return config


def sources(config):
    if config.model.name == "resnet":
        return SyntheticImages(config), SyntheticImages(config)
    return data_lib.create_sources(config)


def make_hand(config, train_source):
    """`(compiled step, fresh, compile seconds)` for `config`'s model and preset written in plain
    flax + optax; `fresh()` is a new step-0 state (the step donates the one it is given)."""
    policy = precision.get_policy(config.precision)
    compute, param_dtype = policy.compute_dtype, policy.param_dtype
    dynamic = config.loss_scale.kind == "dynamic"
    model = importlib.import_module(f"mptrain.models.{config.model.name}")
    model = model.create_model(config.model, compute)
    opt = config.optimizer
    if opt.schedule != "cosine":
        raise ValueError(
            f"the hand-written step mirrors only a cosine schedule, not {opt.schedule!r}"
        )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.learning_rate, opt.warmup_steps, config.num_train_steps
    )
    if opt.name == "adamw":
        tx = optax.adamw(schedule, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay)
    else:  # what mptrain's sgd computes: momentum first, then decoupled weight decay
        tx = optax.chain(
            optax.trace(opt.momentum, opt.nesterov),
            optax.add_decayed_weights(opt.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
    if opt.grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip_norm), tx)
    cast = lambda tree, dtype: jax.tree.map(lambda x: x.astype(dtype), tree)

    def init(rng, inputs):
        variables = dict(model.init({"params": rng, "dropout": rng}, inputs, train=False))
        params = variables.pop("params")
        return {
            "params": cast(params, param_dtype),
            "opt_state": tx.init(params),
            "model_state": variables,  # BatchNorm statistics, fp32
            "scale": jnp.float32(config.loss_scale.init_scale if dynamic else 1.0),
            "good_steps": jnp.int32(0),
            "step": jnp.int32(0),
        }

    def round_params(new, step):
        if param_dtype != jnp.bfloat16:
            return cast(new, param_dtype)
        key = jax.random.fold_in(jax.random.key(config.seed), step)
        leaves, treedef = jax.tree.flatten(new)
        out = []
        for x, k in zip(leaves, jax.random.split(key, len(leaves)), strict=True):
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32)  # add noise below bf16's last bit
            bits = (bits + (jax.random.bits(k, x.shape, jnp.uint32) >> 16)) & jnp.uint32(0xFFFF0000)
            out.append(jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16))
        return treedef.unflatten(out)

    def step(state, batch):
        inputs = batch["inputs"]  # tokens stay integers, images go to the compute dtype
        inputs = inputs.astype(compute) if jnp.issubdtype(inputs.dtype, jnp.floating) else inputs
        mutable = list(state["model_state"]) or False

        def loss_fn(params):
            variables = {"params": cast(params, compute), **state["model_state"]}
            out = model.apply(variables, inputs, train=True, mutable=mutable)
            logits, model_state = out if mutable else (out, state["model_state"])
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"]
            ).mean()
            return (loss * state["scale"] if dynamic else loss), (loss, model_state)

        grads, (loss, model_state) = jax.grad(loss_fn, has_aux=True)(state["params"])
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if dynamic:  # without a scale, no pass over the gradients to unscale them
            grads = jax.tree.map(lambda g: g / state["scale"], grads)
        params32 = cast(state["params"], jnp.float32)
        updates, opt_state = tx.update(grads, state["opt_state"], params32)
        new = {
            "params": round_params(optax.apply_updates(params32, updates), state["step"]),
            "opt_state": opt_state,
            "model_state": model_state,
            "scale": state["scale"],
            "good_steps": state["good_steps"] + 1,
            "step": state["step"] + 1,
        }
        if dynamic:
            finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
            grow = finite & (new["good_steps"] >= config.loss_scale.growth_interval)
            new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
            new["scale"] = jnp.where(grow, state["scale"] * 2, new["scale"])
            new["scale"] = jnp.where(finite, new["scale"], jnp.maximum(state["scale"] / 2, 1.0))
            new["good_steps"] = jnp.where(finite & ~grow, new["good_steps"], 0)
            new["step"] = state["step"] + 1
        return new, loss

    sample = train_source.get_batch(0)
    init_rng, _ = jax.random.split(jax.random.key(config.seed))  # as mptrain splits it
    fresh = functools.partial(jax.jit(init), init_rng, sample["inputs"][:1])
    started = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(fresh(), jax.device_put(sample)).compile()
    return compiled, fresh, time.perf_counter() - started


@contextlib.contextmanager
def mptrain_sides(config, workdir):
    """The `loop` and `bare` sides over one `Trainer.setup`: each is `fn(indices) -> seconds`;
    `info` holds the compile time, the compiled step's memory, bytes/param and the `Run`."""
    trainer = trainer_lib.Trainer(config, workdir)
    train, evaluation = sources(config)
    info = {}
    with runtime.PreemptionFlag() as flag, trainer.setup(train, evaluation) as run:
        jitted = jax.jit(trainer.make_train_step(), donate_argnums=0)
        started = time.perf_counter()  # a fresh jit: setup compiled its own already
        jitted.lower(run.state, trainer.device_batch(train, 0), run.totals).compile()
        info["compile_s"] = time.perf_counter() - started
        info["memory"] = run.train_step.memory_analysis()
        costs = run.train_step.cost_analysis()  # XLA's count of the compiled program
        costs = costs[0] if isinstance(costs, list) else costs or {}
        info["gflop"] = costs.get("flops", float("nan")) / 1e9
        info["bytes_per_param"] = audit.state_bytes_per_param(run.state.params, run.state.opt_state)
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
    config = load_config(model, case, args.size, getattr(args, f"{model}_config"))
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
        "precision": config.precision,
        "loss_scale": config.loss_scale.kind,
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
        "gflop_per_step": info["gflop"],
        "achieved_tflop_per_s": info["gflop"] / step_ms,
        "bytes_per_param": info["bytes_per_param"],
        "hand_bytes_per_param": hand_bytes,
        "memory": memory(info["memory"]),
        "hand_memory": memory(hand_memory),
        "blocks_ms": blocks,
    }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':<6} {'case':<15} {'compile s':>11} {'loop ms':>8} {'bare ms':>8} "
        f"{'hand ms':>8} {'loop/hand':>9} {'bare/hand':>9} {'loop/bare':>9} {'per s':>9} "
        f"{'TFLOP/s':>7} {'B/param':>8} {'temp MiB':>13} {'args MiB':>13}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        rate = r.get("tokens_per_s") or r.get("images_per_s")
        mem, hand = r["memory"], r["hand_memory"]
        print(
            f"{r['model']:<6} {r['case']:<15} {r['compile_s']:>5.1f}/{r['hand_compile_s']:<5.1f} "
            f"{r['loop_ms']:>8.1f} {r['bare_ms']:>8.1f} {r['hand_ms']:>8.1f} "
            f"{r['loop_over_hand']:>9.3f} {r['bare_over_hand']:>9.3f} "
            f"{r['loop_steps_per_s_over_bare']:>9.3f} {rate:>9.0f} "
            f"{r['achieved_tflop_per_s']:>7.3f} {r['bytes_per_param']:>8.2f} "
            f"{mem['temp_mib']:>6.1f}/{hand['temp_mib']:<6.1f} "
            f"{mem['argument_mib']:>6.1f}/{hand['argument_mib']:<6.1f}"
        )
    print(
        "compile, temp and args: mptrain/hand. loop/hand, bare/hand: medians of per-block ratios "
        "(lower is faster for mptrain); loop/bare: the loop's steps/s as a fraction of the bare "
        "step's. per s: tokens (lm) or images (resnet) per second of the loop; TFLOP/s: XLA's "
        "FLOP count of the step over the loop's step time."
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="lm,resnet", help=f"comma-separated of {list(MODELS)}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {list(CASES)}")
    p.add_argument(
        "--blocks", type=int, default=10, help="timed blocks per side (after a warm one)"
    )
    p.add_argument("--block_steps", type=int, default=5, help="steps per block")
    p.add_argument(
        "--size",
        choices=("auto", "small", "full", "tiny"),
        default="auto",
        help="small: the ResNet shrunk for a CPU (width 16, one block a stage, batch 64); "
        "full: the configs as they are; auto: small on a CPU, full on an accelerator; "
        "tiny: the configs' :tiny variants (a smoke test)",
    )
    for model, path in MODELS.items():
        p.add_argument(f"--{model}_config", default=None, help=f"config file (default: {path})")
    p.add_argument("--out", default="runs/bench.json", help="JSON results")
    args = p.parse_args(argv)
    models, cases = args.models.split(","), args.cases.split(",")
    for name, valid in (("models", MODELS), ("cases", CASES)):
        if bad := [x for x in locals()[name] if x not in valid]:
            p.error(f"--{name}: unknown {bad}; valid: {', '.join(valid)}")
    device = jax.devices()[0]
    if args.size == "auto":
        args.size = "small" if device.platform == "cpu" else "full"
    print(f"jax {jax.__version__}, {jax.device_count()} x {device.platform}: {device.device_kind}")
    rows = []
    for model in models:
        for case in cases:
            rows.append(measure(model, case, args))
            r = rows[-1]
            print(
                f"{model} {case}: loop {r['loop_ms']:.1f} ms, hand {r['hand_ms']:.1f} ms, "
                f"loop/hand {r['loop_over_hand']:.3f}",
                flush=True,
            )
    print_table(rows)
    result = {
        "jax_version": jax.__version__,
        "device": f"{device.platform}: {device.device_kind}",
        "device_count": jax.device_count(),
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
