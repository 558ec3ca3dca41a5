"""The memory a planned run will have, and what XLA's own rematerialisation did to fit it.

A run's compile gets the memory JAX gives it: on a GPU its allocator takes 75% of the device
unless `config.memory_fraction` or, first, `XLA_PYTHON_CLIENT_MEM_FRACTION` says otherwise
(`share`, as `runtime.set_memory_fraction` gives the run), and the plan says which. When a
step does not fit the memory XLA's GPU compiler aims for, XLA recomputes on its own until it fits
(or gives up), and says so only in a log line on stderr: `compile_logged` keeps that line,
`logged_remat` reads it, and `recompute` compiles the step once more with the pass off, for the
memory before it and the FLOPs it added. The plan reports both; the fit search
(`mptrain.plan.search`) counts the recomputed FLOPs in the floor of the candidate that needed them.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Any

from mptrain import errors, runtime
from mptrain.inspect import program
from mptrain.plan import roofline

PREALLOCATED = 0.75  # JAX's default share of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION)
MEM_FRACTION = runtime.MEM_FRACTION
# XLA's log line when its own rematerialisation could not reach the memory it was given
_XLA_REMAT = re.compile(
    r"below [\d.]+\w+ \((\d+) bytes\) by rematerialization; only reduced to [\d.]+\w+ "
    r"\((\d+) bytes\), down from [\d.]+\w+ \((\d+) bytes\)"
)


def share(chip, config=None) -> dict[str, Any]:
    """The memory a run on `chip` will have: on a GPU, JAX's allocator takes 75% of it unless
    `XLA_PYTHON_CLIENT_MEM_FRACTION` (in this process's environment: the user's own, which the
    run keeps too) or else `config.memory_fraction` says otherwise; a TPU's run has all of it.
    `{"fraction", "why", "device"}`; a `ConfigError` for a bad fraction."""
    if chip.platform != "gpu":
        return {"fraction": 1.0, "why": "all of a TPU's memory", "device": chip.memory_bytes}
    asked = os.environ.get(MEM_FRACTION, "").strip()
    if not asked:
        with errors.config_errors():
            fraction = runtime.memory_fraction(config) if config is not None else None
        if fraction is not None:
            why = f"config.memory_fraction={fraction:g}"
            return {"fraction": fraction, "why": why, "device": chip.memory_bytes}
        why = f"the {100 * PREALLOCATED:.0f}% JAX takes of a GPU, memory_fraction unset"
        return {"fraction": PREALLOCATED, "why": why, "device": chip.memory_bytes}
    try:
        fraction = float(asked)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise errors.ConfigError(f"{MEM_FRACTION}={asked!r}: a fraction in (0, 1], e.g. 0.9")
    why = f"{MEM_FRACTION}={asked} (the environment's)"
    return {"fraction": fraction, "why": why, "device": chip.memory_bytes}


# XLA's SPMD partitioner's words where it resharded a tensor by gathering it whole (jax#21562)
INVOLUNTARY = "Involuntary full rematerialization"


def compile_logged(lowered) -> tuple[Any, str]:
    """`lowered.compile()`, and what XLA wrote to this process's stderr meanwhile (its log
    lines: the rematerialisation's among them), passed on to stderr as well."""
    import tempfile

    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            compiled = lowered.compile()
        finally:  # a compile that fails has its log passed on too
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            text = log.read().decode(errors="replace")
            kept = [
                s
                for s in text.splitlines(keepends=True)
                if "rematerialization" not in s or INVOLUNTARY in s
            ]
            sys.stderr.write("".join(kept))
    return compiled, text


def logged_remat(log: str) -> dict[str, int]:
    """`{"limit", "before", "after"}` bytes from XLA's log line of a rematerialisation that
    could not reach its limit, {} without one."""
    found = _XLA_REMAT.search(log)
    if not found:
        return {}
    limit, after, before = map(int, found.groups())
    return {"limit": limit, "before": before, "after": after}


def recompute(result, lowered, trainer) -> dict[str, Any]:
    """`result.xla_remat` (a `plan.Plan`'s) completed from a compile of `lowered` with XLA's
    rematerialisation pass off: the memory before it and the FLOPs it added; {} where it
    recomputed nothing and logged nothing."""
    compiled = lowered.compile(compiler_options={"xla_disable_hlo_passes": "rematerialization"})
    k = trainer.config.steps_per_call
    prog = program.Program(compiled.as_text())
    flops = sum(roofline.matmul_flops(prog, trainer.policy.compute_dtype.name, k)["flops"].values())
    recompute = sum(result.matmul_flops.values()) - flops
    if recompute <= 0.001 * flops and not result.xla_remat:
        return {}
    stats = compiled.memory_analysis()
    before = result.memory["total"] - result.memory["temporaries"] + stats.temp_size_in_bytes
    found = {"limit": 0, "before": before, "after": result.memory["total"]} | result.xla_remat
    return found | {"recompute_flops": recompute, "recompute_share": recompute / flops}


def bases(frozen: Any) -> list:
    """The frozen base's tensors, an 8-bit one (`q8.Q8`) as the one tensor it stands for."""
    import jax

    from mptrain.optim import q8

    return jax.tree.leaves(
        jax.tree.map(lambda x: x.codes if q8.is_q8(x) else x, frozen, is_leaf=q8.is_q8)
    )


def global_bytes(tree: Any) -> int:
    """Bytes of an abstract tree, all devices' shards together."""
    import jax
    import numpy as np

    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def shard_bytes(tree: Any) -> int:
    """Bytes of one device's shards of an abstract tree."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total
