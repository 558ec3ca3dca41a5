"""How long a checkpoint takes to reach a bucket, against local disk.

Saves a state of `--mb` MB of fp32 arrays (as many arrays as `--arrays`) with mptrain's
`checkpoint.Checkpointer` into a local stage, then uploads that checkpoint with the mirror a
workdir in a bucket uses (`mptrain.mirror`: its files, then its marker) to moto's S3 server and
to gcp-storage-emulator, both started here on localhost (`tests/servers.py`). Each repeat saves
a new step and uploads it to both, in turn; prints the minimum and median of each part, and one
JSON line (`--out`: also to a file).

The emulators are single Python processes holding the objects in memory: their rate is this
machine's, not S3's or GCS's; the local save is the yardstick beside it.

  python scripts/bench_bucket_save.py --mb=64 --repeats=3 --out=/tmp/bucket_save.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--arrays", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import servers

    from mptrain import buckets, mirror
    from mptrain.train import checkpoint

    rng = np.random.default_rng(0)
    size = int(args.mb * 2**20 / 4 / args.arrays)
    draw = lambda: jnp.asarray(rng.standard_normal(size, np.float32))
    state = {f"w{i}": draw() for i in range(args.arrays)}
    times: dict[str, list[float]] = {"local save": [], "s3 upload": [], "gs upload": []}
    with tempfile.TemporaryDirectory() as tmp, servers.s3() as s3, servers.gcs() as gcs:
        stage = Path(tmp, "stage")
        mirrors = {}
        for scheme, env in (("s3", s3), ("gs", gcs)):
            servers.make_bucket(env, "bench")
            os.environ.update(env)
            mirrors[scheme] = mirror.Mirror(buckets.open(f"{scheme}://bench/run"), stage)
        with checkpoint.Checkpointer(stage / "checkpoints", max_to_keep=1) as ckpt:
            for step in range(1, args.repeats + 1):
                started = time.perf_counter()
                ckpt.save(step, state, {"config": {}, "policy": "fp32"})
                times["local save"].append(time.perf_counter() - started)
                for scheme in ("s3", "gs"):
                    started = time.perf_counter()
                    mirrors[scheme].sync()
                    times[f"{scheme} upload"].append(time.perf_counter() - started)
        stored = sum(p.stat().st_size for p in (stage / "checkpoints").rglob("*") if p.is_file())
    rows = {
        part: {"min_s": min(t), "median_s": statistics.median(t), "mb_per_s": stored / 1e6 / min(t)}
        for part, t in times.items()
    }
    print(f"checkpoint of {stored / 1e6:.1f} MB ({args.arrays} fp32 arrays), {args.repeats} saves")
    print(f"{'part':<12} {'min s':>8} {'median s':>9} {'MB/s':>8}  vs local")
    for part, row in rows.items():
        ratio = row["min_s"] / rows["local save"]["min_s"]
        print(f"{part:<12} {row['min_s']:>8.3f} {row['median_s']:>9.3f} {row['mb_per_s']:>8.1f}"
              f"  {ratio:.1f}x")  # fmt: skip
    result = {"stored_bytes": stored, "arrays": args.arrays, "repeats": args.repeats, **rows}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
