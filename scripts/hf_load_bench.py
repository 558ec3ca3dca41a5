"""Time and peak host memory of `mptrain.hf.load_params` on a HuggingFace Llama folder: every
param built in fp32 straight into an FSDP sharding over all the devices, the way a run's
`init_from` loads it. One process, one measurement (peak memory is the process's own):

    python tests/hf/make_fixture.py --size=1b --out=/tmp/llama1b   # in its venv: see there
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python scripts/hf_load_bench.py /tmp/llama1b [--dtype=bfloat16] [--whole]

`--whole` times `mptrain.hf.load` instead (every param whole on the host, in numpy), for
contrast. Prints one JSON line: the folder's bytes, params, seconds, and the peak resident
memory (`ru_maxrss`, which counts the memory-mapped safetensors pages the kernel can drop),
the peak of its anonymous part (arrays: sampled every 10 ms), and both parts at the end.
"""

import argparse
import json
import resource
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from mptrain import hf
from mptrain.parallel import sharding


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


class PeakAnon(threading.Thread):
    """Samples the process's anonymous resident memory (its arrays, not the file pages the
    kernel may drop) every 10 ms; `peak` is the largest seen."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _status().get("RssAnon", 0))
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args()
    folder_bytes = sum(p.stat().st_size for p in args.folder.glob("*.safetensors"))
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config = hf.read_config(args.folder)
    devices = jax.devices()
    mesh = Mesh(
        np.asarray(devices).reshape(1, len(devices), 1, 1, 1), sharding.AXES
    )  # FSDP over all
    sampler = PeakAnon()
    sampler.start()
    start = time.perf_counter()
    if args.whole:
        _, params = hf.load(args.folder)
    else:
        declared, shapes = hf.declared(config)
        shapes = jax.tree.map(lambda s: s.update(dtype=np.dtype(args.dtype)), shapes)
        where = sharding.state_shardings(mesh, shapes, declared)
        target = jax.tree.map(lambda s, w: s.update(sharding=w), shapes, where)
        params = jax.block_until_ready(hf.load_params(args.folder, target))
    seconds = time.perf_counter() - start
    sampler.running = False
    leaves = jax.tree.leaves(params)
    status = _status()
    print(
        json.dumps(
            {
                "folder": str(args.folder),
                "folder_bytes": folder_bytes,
                "params": int(sum(x.size for x in leaves)),
                "param_bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
                "mode": "load (host numpy)" if args.whole else f"load_params ({args.dtype})",
                "devices": len(devices),
                "seconds": round(seconds, 2),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "peak_rss_anon_bytes": sampler.peak,
                "rss_before_bytes": start_rss,
                "end_rss_file_bytes": status.get("RssFile"),
                "end_rss_anon_bytes": status.get("RssAnon"),
            }
        )
    )


if __name__ == "__main__":
    main()
