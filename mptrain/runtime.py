"""Process plumbing, apart from training logic: start-up, the workdir lock, preemption.

`start_backend(config)` sets XLA's flags and starts JAX's multi-process runtime if the config or
the cluster asks for it, before anything touches a device (`mptrain.run` and the CLI call it
first). The trainer holds the lock and the flag for a whole run::

    with runtime.workdir_lock(workdir), runtime.PreemptionFlag() as preemption:
        ...  # set up; then loop, asking `preemption.reached(step)` before each step

SIGTERM and SIGINT are `preemption`'s (re-exported here: `PreemptionFlag`, `catch_stop_signals`,
`release_stop_signals`, `end_with_on_stop_signals`). jax is imported inside the functions that
use it, so that this module loads in milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
from pathlib import Path

from absl import logging

from mptrain import errors, preemption
from mptrain.preemption import (  # noqa: F401  (re-exported: runtime.PreemptionFlag, ...)
    PreemptionFlag,
    catch_stop_signals,
    end_with_on_stop_signals,
    release_stop_signals,
)

DISTRIBUTED_KEYS = ("coordinator_address", "num_processes", "process_id")


def _cluster_process_count() -> int:
    """How many processes a cluster scheduler JAX knows (Slurm, Open MPI, Cloud TPU, ...) says
    this job has; 1 outside such a cluster. Uses JAX's own detectors."""
    try:
        from jax._src import clusters
    except ImportError:  # a JAX without them: only the explicit keys start several processes
        return 1
    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.get_process_count() or 1
    return 1


def distributed_args(config) -> tuple[str, int, int] | None:
    """`(coordinator_address, num_processes, process_id)` from `config.distributed`, or None when
    all three are unset. Bad or partial settings raise a `ValueError` naming the key."""
    section = config.get("distributed") or {}
    values = {key: section.get(key) for key in DISTRIBUTED_KEYS}
    if all(v is None for v in values.values()):
        return None
    for key, value in values.items():
        if value is None:
            given = ", ".join(f"distributed.{k}" for k, v in values.items() if v is not None)
            raise ValueError(f"distributed.{key}=None: must be set too, since {given} is")
    address = values["coordinator_address"]
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"distributed.coordinator_address={address!r}: must be 'host:port'")
    count = errors.check_integer("distributed.num_processes", values["num_processes"], 1)
    index = errors.check_integer("distributed.process_id", values["process_id"], 0)
    if index >= count:
        raise ValueError(f"distributed.process_id={index}: must be < num_processes={count}")
    return address, count, index


DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # JAX's share of each GPU, read at backend start


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover (a JAX without it: assume the worst)
        return True
    return xla_bridge.backends_are_initialized()


def host_memory() -> int:
    """This machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory() -> int:
    """What JAX's devices hold in all, in bytes: their own memory where they report it (a
    GPU's; each process reads its own and counts every process's the same), else this
    machine's (CPU devices share it)."""
    import jax

    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
    return sum(limits) * jax.process_count() if all(limits) else host_memory()


def set_determinism(config) -> None:
    """With `config.deterministic` (the default), asks XLA for run-to-run deterministic GPU
    kernels, so that on a GPU, too, two runs and a resumed run repeat bit for bit.

    A GPU adds with atomics, in whatever order its threads arrive, where a step scatters (the
    gradient of a gather from a table, or of `nn.max_pool`; the zoo's steps scatter nothing)
    and in the backward pass of cuDNN's fused attention. XLA's flag
    (`--xla_gpu_deterministic_ops`) makes those deterministic, at a cost in speed. XLA reads
    `XLA_FLAGS` once, when JAX starts its backends, so this must run before anything touches a
    device; a GPU backend already up without the flag gets a warning (this run's kernels may
    not repeat), and an XLA_FLAGS that turns the flag off is a `ValueError` naming the key. CPU
    and TPU programs are deterministic as they are.
    """
    if not config.get("deterministic", False):
        return
    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops=false" in flags:
        raise ValueError(
            f"deterministic=True contradicts XLA_FLAGS={flags!r}: drop one of them (or set "
            "config.deterministic=False)"
        )
    if "xla_gpu_deterministic_ops" in flags:
        return
    if not _backends_started():
        os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_FLAG}".strip()
    elif jax.default_backend() == "gpu":
        logging.warning(
            "mptrain: config.deterministic=True, but JAX's GPU backend started before mptrain "
            "could set XLA's flag: this run's GPU kernels may not repeat bit for bit. Start "
            "Python with XLA_FLAGS=%s, or set config.deterministic=False to say so",
            DETERMINISTIC_FLAG,
        )


def start_backend(config) -> None:
    """What must happen before anything touches a device: XLA's flags and JAX's share of each
    GPU, then jax.distributed."""
    set_determinism(config)
    set_memory_fraction(config)
    set_cpu_threads()
    initialize_distributed(config)


# Threads of XLA's CPU pool a fake CPU device (--xla_force_host_platform_device_count): the pool
# is the cores' count unless $NPROC says, and each collective waiting for the other devices holds
# a thread. On 2 cores, the expert mesh's step (4 devices) ran out of threads and XLA aborted it
# after 40 s in one run of 3; at 2 a device it ran 4 of 4. One device keeps XLA's own count:
# 8 threads on 2 cores made a tiny model's steps 15-19% slower.
CPU_THREADS_PER_DEVICE = 4


def cpu_threads(env) -> int | None:
    """The $NPROC for a process with `env`'s fake CPU devices: None for one, or where $NPROC is
    set already."""
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    devices = int(found[1]) if found else 1
    if devices == 1 or env.get("NPROC"):
        return None
    return CPU_THREADS_PER_DEVICE * devices


def set_cpu_threads() -> None:
    """Gives XLA's CPU pool threads for the fake devices XLA_FLAGS asks for, before its CPU
    client is made (`cpu_threads`)."""
    threads = cpu_threads(os.environ)
    if threads is not None and not _backends_started():
        os.environ["NPROC"] = str(threads)


def memory_fraction(config) -> float | None:
    """`config.memory_fraction`, checked: None (JAX's own 75%), or a fraction in (0, 1]; else a
    `ValueError` naming the key."""
    asked = config.get("memory_fraction")
    if asked is None:
        return None
    if isinstance(asked, bool) or not isinstance(asked, int | float) or not 0 < asked <= 1:
        raise ValueError(
            f"memory_fraction={asked!r}: the share of each GPU's memory the run takes, a "
            "fraction in (0, 1] (e.g. 0.85), or None for JAX's 0.75"
        )
    return float(asked)


def set_memory_fraction(config) -> None:
    """The run takes `config.memory_fraction` of each GPU's memory: JAX's allocator reads it as
    `XLA_PYTHON_CLIENT_MEM_FRACTION` once, when its backend starts, so it is set before. A
    variable the user set wins (both are said); a backend already up is a warning."""
    asked = memory_fraction(config)
    if asked is None:
        return
    own = os.environ.get(MEM_FRACTION, "").strip()
    if own:
        logging.info(
            "mptrain: %s=%s from the environment; config.memory_fraction=%g is not applied",
            MEM_FRACTION,
            own,
            asked,
        )
    elif _backends_started():
        logging.warning(
            "mptrain: config.memory_fraction=%g, but JAX's backend started before mptrain could "
            "give it: the run has JAX's share of each GPU (set %s before JAX starts)",
            asked,
            MEM_FRACTION,
        )
    else:
        os.environ[MEM_FRACTION] = f"{asked:g}"
        logging.info("mptrain: the run takes %g of each GPU's memory (memory_fraction)", asked)


def initialize_distributed(config) -> None:
    """Starts `jax.distributed` once, before anything touches a device.

    With `config.distributed.*` set, from those; with none set, JAX's auto-detection when a
    cluster environment it knows reports several processes; otherwise not at all (one
    process). On CPU the processes' collectives go through gloo.
    """
    import jax

    if jax.distributed.is_initialized():
        return
    args = distributed_args(config)
    if args is None and _cluster_process_count() <= 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args is None:
        jax.distributed.initialize()
    else:
        address, count, index = args
        jax.distributed.initialize(address, num_processes=count, process_id=index)
    if jax.process_count() > 1:
        preemption.forward_sigint()  # SIGTERM is JAX's now; SIGINT goes to it too
    logging.info(
        "mptrain: process %d of %d, %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def _rewrite(handle, text: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(text)
    handle.flush()


@contextlib.contextmanager
def workdir_lock(workdir: Path):
    """Holds an exclusive lock on `<workdir>/.lock` for the run; a second run is refused.

    The lock is an flock, so the kernel drops it when the process dies, even under kill -9. Only
    process 0 of a multi-process job takes it (the others write nothing but checkpoint shards).
    """
    import jax

    from mptrain import files  # with jax: not at import, before the stop signals are caught

    if jax.process_index() != 0:
        yield
        return
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        files.check_workdir(workdir)  # a WorkdirError of its own, not an OSError
        handle = open(workdir / ".lock", "a+")  # noqa: SIM115 (held for the whole run)
    except OSError as e:
        raise errors.WorkdirError(f"workdir {workdir} is not writable: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise errors.WorkdirError(
                f"workdir {workdir} is in use by another run ({holder}); wait for it to end "
                "or use another --workdir"
            ) from None
        handle.seek(0)
        previous = handle.read()
        with files.writing(workdir / ".lock"):  # a full disk: one line, exit 1
            _rewrite(handle, f"pid {os.getpid()} on {socket.gethostname()}\n")
        try:
            yield
        except (errors.ConfigError, errors.WorkdirError):
            # Refused (a checkpoint this config cannot resume): the run never ran here, so the
            # lock file names whoever ran last, as before this process came.
            with contextlib.suppress(OSError):
                _rewrite(handle, previous)
            raise
    finally:
        with contextlib.suppress(OSError):  # what a full disk kept unwritten is not ours
            handle.close()  # closing releases the lock
