"""Per-step cost of mptrain's train loop against the same model written by hand in flax + optax.

docs/design.md promises that a loop built with mptrain costs at most a few per cent more per step
than the hand-written one. This script measures both in one process, alternating them (mptrain,
hand, mptrain, hand, ...), and reports the median of the per-pair ratios mptrain / hand.

- mptrain: the real loop, `Trainer(config, workdir).train_and_evaluate()` on a fresh temp workdir,
  with eval and checkpoints only at the last step (outside the timed window).
- hand: the same `create_model(config.model, bf16)` module with fp32 params, clip + AdamW with
  the config's warmup + cosine schedule, and a jitted step (state donated) that casts the params
  to bf16 inside the differentiated function and takes the loss from fp32 logits.

Both loops are timed the same way, at the calls of the train source's `get_batch(i)`: the device
is drained (every live array made ready) when batch `warm` and batch `steps - 1` are asked for,
so the window holds exactly steps `warm .. steps - 2`, from an idle device to their completion.
Draining matters: jax dispatches asynchronously and, on CPU, the host runs arbitrarily far ahead,
so bare timestamps would measure dispatch, not the steps. Setup, compilation, the first `warm`
steps, the final eval and the checkpoint are outside the window.

  python scripts/bench_overhead.py                      # full default model, 5 pairs of 60 steps
  python scripts/bench_overhead.py --config_arg=tiny --steps=12 --warmup=3 --pairs=2   # smoke
  python scripts/bench_overhead.py --dynamic_scale      # mptrain with dynamic loss scaling
  PYTHONPATH=/path/to/other/checkout python scripts/bench_overhead.py   # measure other code

The config file defaults to `configs/default.py` beside the measured `mptrain` package.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import runpy
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import ml_collections

import mptrain
from mptrain import data as data_lib
from mptrain import files, runtime
from mptrain.train import trainer as trainer_lib


class TimedSource:
    """Wraps a batch source: stamps each `get_batch(i)`, draining the device first at `sync`."""

    def __init__(self, source, sync: tuple[int, ...]):
        self.source, self.sync, self.stamps = source, sync, {}

    def get_batch(self, i):
        if i in self.sync:
            jax.block_until_ready([a for a in jax.live_arrays() if not a.is_deleted()])
        self.stamps[i] = time.perf_counter()  # the last call wins (setup may ask for batch 0)
        return self.source.get_batch(i)

    def __getattr__(self, name):
        return getattr(self.source, name)

    def ms_per_step(self) -> float:
        first, last = self.sync
        return 1e3 * (self.stamps[last] - self.stamps[first]) / (last - first)


def time_mptrain(config, sync) -> float:
    timed = []

    class TimedTrainer(trainer_lib.Trainer):
        def build_datasets(self):
            train, evaluation = super().build_datasets()
            timed.append(TimedSource(train, sync))
            return timed[-1], evaluation

    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as workdir:
        TimedTrainer(config, workdir).train_and_evaluate()
    return timed[-1].ms_per_step()


def make_hand_loop(config):
    """The hand-written equivalent (`make_hand` of bench.py, jitted once): `run(sync) ->
    ms/step`, a fresh state per run; `run.blocks` for the alternated blocks."""
    train, _ = data_lib.create_sources(config)
    make_hand = runpy.run_path(str(Path(__file__).with_name("bench.py")))["make_hand"]
    step, fresh, _ = make_hand(config, train)

    def blocks():
        """A generator: send it a range of batch indices, it trains on them and answers with
        the seconds they took (the device drained at both ends)."""
        state = fresh()
        indices = yield
        while True:
            jax.block_until_ready(state)
            start = time.perf_counter()
            for i in indices:
                state, loss = step(state, jax.device_put(train.get_batch(i)))
            jax.block_until_ready((state, loss))
            indices = yield time.perf_counter() - start

    def run(sync) -> float:
        source, state = TimedSource(train, sync), fresh()
        for i in range(config.num_train_steps):
            state, loss = step(state, jax.device_put(source.get_batch(i)))
        jax.block_until_ready((state, loss))
        return source.ms_per_step()

    run.blocks = blocks
    return run


@contextlib.contextmanager
def trainer_blocks(config, workdir):
    """`run(indices) -> seconds`: the real `Trainer.train` loop on those batches, after one
    `Trainer.setup`; each block ends with the report of its last step (a read of the metrics,
    as a hand block ends with `block_until_ready`)."""
    config = config.copy_and_resolve_references()
    config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 10**9
    trainer = trainer_lib.Trainer(config, workdir)
    with runtime.PreemptionFlag() as flag, trainer.setup(*trainer.build_datasets()) as run:

        def blocks(indices) -> float:
            jax.block_until_ready(run.state)
            start = time.perf_counter()
            run.start, config.num_train_steps = indices.start, indices.stop
            trainer.train(run, flag)
            jax.block_until_ready(run.state)
            return time.perf_counter() - start

        yield blocks


def interleaved(config, other, blocks: int, block_steps: int) -> list[dict]:
    """Alternates blocks of `block_steps` steps of mptrain's loop and of `other` (the hand loop,
    or a second mptrain config) in one process, which goes first alternating too, so drift of
    the machine cancels. Rows keep the names `mptrain_ms` and `hand_ms` for the two sides."""
    rows = []
    with contextlib.ExitStack() as stack:
        ours = stack.enter_context(trainer_blocks(config, stack.enter_context(_tempdir())))
        if isinstance(other, ml_collections.ConfigDict):
            theirs = stack.enter_context(trainer_blocks(other, stack.enter_context(_tempdir())))
        else:
            hand = other.blocks()
            next(hand)
            theirs = hand.send
        for side in (ours, theirs):
            side(range(0, block_steps))  # warm up both sides
        for b in range(blocks):
            indices = range((b + 1) * block_steps, (b + 2) * block_steps)
            sides = [("mptrain", ours), ("hand", theirs)]
            times = {name: fn(indices) for name, fn in sides[:: 1 if b % 2 else -1]}
            ms = {k: 1e3 * v / block_steps for k, v in times.items()}
            rows.append({"mptrain_ms": ms["mptrain"], "hand_ms": ms["hand"]})
            rows[-1]["ratio"] = rows[-1]["mptrain_ms"] / rows[-1]["hand_ms"]
    return rows


def _tempdir():
    return tempfile.TemporaryDirectory(prefix="bench_overhead_")


def git_info(directory: Path) -> dict:
    def git(*args):
        cmd = ["git", "--no-optional-locks", "-C", str(directory), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return result.stdout.rstrip() if result.returncode == 0 else ""

    changed = git("status", "--porcelain", "--", ".").splitlines()  # the measured package only
    return {"git_commit": git("rev-parse", "HEAD") or None, "git_changes": changed}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="train steps per measurement")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed window")
    p.add_argument("--pairs", type=int, default=5, help="(mptrain, hand) measurements")
    p.add_argument("--config_arg", default=None, help="argument to get_config, e.g. 'tiny'")
    p.add_argument("--config", default=None, help="config file (default: configs/default.py)")
    p.add_argument("--out", default="runs/bench_overhead.json", help="JSON results")
    p.add_argument("--dynamic_scale", action="store_true", help="mptrain: dynamic loss scaling")
    p.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="instead of whole runs, alternate this many blocks of --block_steps steps of the "
        "Trainer's own loop and the hand loop in one process (needs Trainer.setup)",
    )
    p.add_argument("--block_steps", type=int, default=5, help="steps per block (--blocks)")
    p.add_argument(
        "--per_layer",
        action="store_true",
        help="with --blocks: mptrain with config.numerics.per_layer against mptrain without it, "
        "instead of against the hand loop",
    )
    args = p.parse_args(argv)
    if not 1 <= args.warmup < args.steps - 1:
        p.error(f"need 1 <= --warmup < --steps - 1; got {args.warmup} and {args.steps}")

    package_dir = Path(mptrain.__file__).resolve().parent
    beside = package_dir.parent / "configs/default.py"  # the config of the measured code
    here = Path(__file__).resolve().parents[1] / "configs/default.py"
    config_path = args.config or str(beside if beside.exists() else here)
    get_config = runpy.run_path(config_path)["get_config"]
    config = get_config(args.config_arg)
    config.num_train_steps = args.steps
    config.eval_every_steps = config.checkpoint_every_steps = args.steps
    config.log_every_steps = min(get_config(None).log_every_steps, args.steps)
    # A cosine decay needs steps after warmup; the schedule's values do not change the cost.
    config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, args.steps // 2)
    hand_config = config.copy_and_resolve_references()
    if args.dynamic_scale:
        config.loss_scale.kind = "dynamic"
    sync = (args.warmup, args.steps - 1)
    device = f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}"
    print(f"mptrain.__file__: {mptrain.__file__}\nconfig: {config_path}:{args.config_arg or ''}")
    print(f"jax {jax.__version__}, device {device}")

    hand_loop = make_hand_loop(hand_config)
    rows = []
    if args.blocks:
        other = hand_loop
        if args.per_layer:
            other = config.copy_and_resolve_references()
            config.numerics.per_layer = True
        rows = interleaved(config, other, args.blocks, args.block_steps)
    for pair in range(0 if args.blocks else args.pairs):
        gc.collect()
        ours = time_mptrain(config, sync)
        gc.collect()
        hand = hand_loop(sync)
        rows.append({"mptrain_ms": ours, "hand_ms": hand, "ratio": ours / hand})
        print(f"pair {pair}: mptrain {ours:.3f} ms/step, hand {hand:.3f} ms/step", flush=True)

    ratios = [r["ratio"] for r in rows]
    summary = {
        "median_mptrain_ms": statistics.median(r["mptrain_ms"] for r in rows),
        "median_hand_ms": statistics.median(r["hand_ms"] for r in rows),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }
    print(f"\n{'pair':>4}  {'mptrain ms/step':>15}  {'hand ms/step':>12}  {'ratio':>7}")
    for pair, r in enumerate(rows):
        print(f"{pair:>4}  {r['mptrain_ms']:>15.3f}  {r['hand_ms']:>12.3f}  {r['ratio']:>7.4f}")
    print(
        f"{'med':>4}  {summary['median_mptrain_ms']:>15.3f}  {summary['median_hand_ms']:>12.3f}"
        f"  {summary['median_ratio']:>7.4f}  (min {summary['min_ratio']:.4f}, "
        f"max {summary['max_ratio']:.4f}; contract: <= 1.02)"
    )

    result = {
        "jax_version": jax.__version__,
        "device": device,
        "config": config_path,
        "config_arg": args.config_arg,
        "steps": args.steps,
        "warmup": args.warmup,
        "timed_steps": sync[1] - sync[0],
        "pairs": len(rows),
        "blocks_of": args.block_steps if args.blocks else None,
        "dynamic_scale": args.dynamic_scale,
        "versus": "mptrain without per-layer numerics" if args.per_layer else "hand-written",
        "mptrain_file": mptrain.__file__,
        **git_info(package_dir),
        **summary,
        "per_pair": rows,
    }
    files.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
