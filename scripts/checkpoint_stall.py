"""How long a checkpoint stops training: a save's stall of the step, foreground against background.

Builds a state with the arrays of `configs/lm_1b.py`'s TrainState (fp32 master params and
AdamW moments; `--layers` of its 24 blocks, since the whole 14.5 GB state needs about 2.6 times
its size in memory while orbax saves it, more than a 24 GiB machine has) on the devices, and a
stand-in step that reads and rewrites every array (donated, as the trainer's step is: an
optimizer update's memory traffic, without the model's FLOPs). It times `--steps` steps
without a save, then, for each mode, the same steps with a `checkpoint.Checkpointer` save
(`async_save` False, then True) after the first of them, `--repeats` times. The stall is
what the steps with a save take beyond those without; for async it splits into the save call
(the state's fingerprint, timed alone too, and the copy to host memory) and the rest (the
write, competing with the steps for the host's cores). `--without_fingerprint` times orbax's
part alone. Prints a table and one JSON line.

  python scripts/checkpoint_stall.py --layers=4 --out=/tmp/stall   # 2.4 GB of state, 1 min
  python scripts/checkpoint_stall.py --layers=4 --without_fingerprint --out=/tmp/stall
"""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def abstract_state(layers: int):
    """`configs/lm_1b.py`'s TrainState as shapes and dtypes, with `layers` blocks."""
    import mptrain

    config = runpy.run_path(str(ROOT / "configs" / "lm_1b.py"))["get_config"]()
    config.model.num_layers = layers
    trainer = mptrain.Trainer(config, Path(tempfile.mkdtemp()))
    length = config.data.seq_len if "seq_len" in config.data else 1024
    tokens = np.zeros((config.batch_size, length), np.int32)
    return jax.eval_shape(trainer.init_state, {"inputs": tokens, "targets": tokens})


def run(args) -> dict:
    from mptrain.train import checkpoint, fingerprints

    abstract = abstract_state(args.layers)
    fill = lambda s: jnp.full(s.shape, 0.5, s.dtype) if s.size > 1 else jnp.zeros(s.shape, s.dtype)
    state = jax.jit(lambda: jax.tree.map(fill, abstract))()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))

    def update(x):
        return x * 0.999 + 1e-3 if jnp.issubdtype(x.dtype, jnp.floating) else x + 1

    step = jax.jit(lambda s: jax.tree.map(update, s), donate_argnums=0)
    state = jax.block_until_ready(step(state))  # compiled

    def steps(state, save=None):
        """`args.steps` steps, `save(state)` after the first; (state, seconds, save call)."""
        start, call = time.perf_counter(), 0.0
        for i in range(args.steps):
            state = jax.block_until_ready(step(state))
            if i == 0 and save is not None:
                before = time.perf_counter()
                save(state)
                call = time.perf_counter() - before
        return state, time.perf_counter() - start, call

    base = []
    for _ in range(args.repeats):
        state, seconds, _ = steps(state)
        base.append(seconds)
    found = {"state_bytes": nbytes, "layers": args.layers, "steps": args.steps}
    found["step_s"] = statistics.median(base) / args.steps
    prints = []
    for _ in range(args.repeats):  # part of every save call: the meta's content hash
        before = time.perf_counter()
        fingerprints.fingerprint(state)
        prints.append(time.perf_counter() - before)
    found["fingerprint_s"] = statistics.median(prints)
    if args.without_fingerprint:  # orbax's part alone (such checkpoints fail their restore)
        fingerprints.fingerprint = lambda tree: "sums-sha256:none"
    found["without_fingerprint"] = args.without_fingerprint
    out = Path(args.out)
    for mode in ("sync", "async"):
        folder = out / f"checkpoints_{mode}"
        shutil.rmtree(folder, ignore_errors=True)
        ckpt = checkpoint.Checkpointer(folder, async_save=mode == "async", max_to_keep=1)
        totals, calls, waits = [], [], []
        for repeat in range(args.repeats):
            save = lambda s, r=repeat, c=ckpt: c.save(r + 1, s, {"config": None, "policy": None})
            state, seconds, call = steps(state, save)
            before = time.perf_counter()
            ckpt.wait()  # what is left of the write after the steps
            waits.append(time.perf_counter() - before)
            totals.append(seconds)
            calls.append(call)
        ckpt.close()
        shutil.rmtree(folder, ignore_errors=True)
        found[mode] = {
            "stall_s": statistics.median(totals) - statistics.median(base),
            "save_call_s": statistics.median(calls),
            "left_after_steps_s": statistics.median(waits),
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="blocks of lm_1b's 24")
    parser.add_argument("--steps", type=int, default=6, help="steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--without_fingerprint",
        action="store_true",
        help="time orbax's part alone: the saves skip the state's fingerprint",
    )
    parser.add_argument("--out", default=tempfile.gettempdir() + "/checkpoint_stall")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    found = run(args)
    print(f"state {found['state_bytes'] / 1e9:.2f} GB ({args.layers} of lm_1b's 24 blocks)")
    print(f"step without a save: {found['step_s']:.3f} s ({jax.devices()[0].platform})")
    print(f"fingerprint of the state (in every save call): {found['fingerprint_s']:.3f} s")
    for mode in ("sync", "async"):
        m = found[mode]
        print(
            f"{mode:5s}  stall {m['stall_s']:.3f} s  save call {m['save_call_s']:.3f} s  "
            f"write left after {args.steps} steps {m['left_after_steps_s']:.3f} s"
        )
    (Path(args.out) / "stall.json").write_text(json.dumps(found) + "\n")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
