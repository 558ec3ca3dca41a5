"""A trace of a few train steps, and the kernel table read from it.

    python -m mptrain.profile WORKDIR [--top=10]

`config.profile.num_steps = n` (from `profile.start_step` on) makes a run trace those steps
with `jax.profiler` (`Tracer`, one of the run's hooks) into `<workdir>/plugins/profile/<run>/`,
where TensorBoard's profile plugin lists it (`<host>.xplane.pb`); beside it go the same events
as Chrome trace JSON (`<host>.trace.json.gz`) and `mptrain.json` (the steps traced and their
wall time). The tracer waits for the steps before the first traced one and for the last one,
so the trace holds those steps exactly; it reads nothing and changes no value of the run.

The command reads the trace JSON (no TensorBoard plugin needed) and prints, per train step of
the train step's program on the first device: device time by group (matmuls, attention, other
fusions, collectives, copies, and on a GPU the CUDA graphs XLA launches whole) and the host
gaps between kernels (the step's period less the device-busy time), the busy fraction, and the
top kernels with their share. Kernels that run at once (XLA:CPU runs independent ones on
several threads) share the busy time in proportion to their own durations, so the groups add
up to it. `table(workdir)` returns the same as a dict.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import jax
from absl import logging

from mptrain import errors, files

# Groups by kernel or HLO op name, the first match wins; "other fusions" takes the rest.
GROUPS = (
    ("collectives", r"all-reduce|all-gather|reduce-scatter|all-to-all|collective|nccl|"
                    r"send|recv|\bar\b"),
    ("attention", r"attention|flash|fmha|\bmha\b|sdpa|cudnn.*(fprop|bprop)"),
    ("matmuls", r"\bdot|gemm|matmul|convolution|\bconv(?!ert)|cublas|cutlass|nvjet|xmma|wgmma|"
                r"ynn_fusion|xnn_|onednn"),
    ("copies", r"copy|transpose|memcpy|memset|dynamic-update-slice|dynamic_update_slice|"
               r"concatenate|\bpad\b"),
    # XLA's GPU runs runs of kernels as CUDA graphs, which a trace shows as one event each
    ("CUDA graphs", r"^command_buffer"),
)  # fmt: skip
# How to see the kernels inside the CUDA graphs (`render`'s note when the step has some).
GRAPHS_NOTE = (
    "note: XLA ran {share:.0%} of the step's device time as CUDA graphs (command buffers), "
    "which the trace shows as one event each, their kernels unnamed; to see them, trace a run "
    "started with XLA_FLAGS=--xla_gpu_enable_command_buffer= (each kernel then launched on its "
    "own: the step can be slower where its kernels are short)"
)
GAPS = "host gaps"
META = "mptrain.json"
DATA = "data waits"  # `loop.Prefetcher`'s section of the run's clock
PROFILING = "profiling"  # starting and writing a trace: not train time


def group_of(name: str) -> str:
    """The group of a kernel called `name` (its HLO op, else its own name)."""
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other fusions"


class Tracer:
    """A run's hook (`hook(step_no)` after each step's dispatch) that traces the steps
    `config.profile` names into the workdir and marks them in the record."""

    section = None  # its waits are for the train steps: train time (`Clock`); not its trace's

    def __init__(self, run: Any):
        cfg = run.config.profile
        self.run, self.num = run, int(cfg.num_steps)
        self.first, self.k = int(cfg.start_step), run.config.steps_per_call
        self.warming: int | None = None  # the step before the warm-up call, once tracing
        self.began: tuple | None = None  # the step before the trace, the time, clock.outside
        self.done = self.num == 0

    def __call__(self, step_no: int) -> None:
        if self.done or step_no % self.k:  # calls of k steps: a trace holds whole calls
            return
        last = self.run.config.num_train_steps
        if self.warming is None and step_no >= self.first - 1 - self.k and step_no < last - self.k:
            # One call more is traced first and left out of the table: the profiler's first
            # dispatch under trace took 7 ms here, the others 0.3 ms.
            jax.block_until_ready(self.run.state)  # the steps before the trace are done
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # Python calls would fill the trace's 1M events
            with self.run.clock.section(PROFILING):
                jax.profiler.start_trace(
                    str(self.run.workdir), create_perfetto_trace=True, profiler_options=options
                )
            self.warming = step_no
        elif self.began is None and self.warming is not None:
            jax.block_until_ready(self.run.state)  # the warm-up call is done
            self.began = (step_no, time.monotonic(), self.run.clock.outside(DATA))
        elif self.began is not None and (step_no >= self.began[0] + self.num or step_no == last):
            jax.block_until_ready(self.run.state)  # the last traced step is done
            # the wall time of the traced steps, less evaluations and checkpoints among them (the
            # batches a CPU makes between steps are in the trace's host gaps: kept)
            outside = self.run.clock.outside(DATA) - self.began[2]
            seconds = time.monotonic() - self.began[1] - outside
            with self.run.clock.section(PROFILING):  # writing the trace: 0.3 s here
                jax.profiler.stop_trace()
                self.done = True
                self.mark(self.began[0] + 1, step_no, seconds)

    def mark(self, first: int, last: int, seconds: float) -> None:
        """Writes `mptrain.json` beside the trace and `profiled` = 1 at each traced step."""
        steps = last - first + 1
        folder = newest(self.run.workdir)
        meta = {"first_step": first, "last_step": last, "steps": steps}
        meta |= {"steps_per_call": self.k, "wall_s_per_step": seconds / steps, "warmup_calls": 1}
        meta["module"] = self.run.train_step.as_text().split(",", 1)[0].split()[-1]
        if jax.process_index() == 0:
            files.write_json(folder / META, meta)
            for step_no in range(first, last + 1):
                self.run.writer.write_scalars(step_no, {"profiled": 1.0})
        logging.info(
            "mptrain: traced steps %d-%d (%.1f ms a step) into %s; python -m mptrain.profile %s",
            first, last, 1e3 * seconds / steps, folder, self.run.workdir,
        )  # fmt: skip


def newest(workdir: str | Path) -> Path:
    """The newest trace folder `<workdir>/plugins/profile/<run>`; a `WorkdirError` if none."""
    runs = sorted(Path(workdir, "plugins", "profile").glob("*/*.xplane.pb"))
    if not runs:
        raise errors.WorkdirError(
            f"{Path(workdir, 'plugins', 'profile')}: no trace; run with "
            "--config.profile.num_steps=N (and profile.start_step) to take one"
        )
    return max((p.parent for p in runs), key=lambda p: p.name)


def _events(folder: Path) -> list[dict]:
    paths = [p for p in folder.glob("*.trace.json.gz") if not p.name.startswith("perfetto")]
    if not paths:
        raise errors.WorkdirError(f"{folder}: no *.trace.json.gz beside the xplane.pb")
    data = _read_json(paths[0], gzip.open)
    return data["traceEvents"] if isinstance(data, dict) else data


def _read_json(path: Path, opener=open) -> Any:
    """A trace's JSON (or its `mptrain.json`); a `WorkdirError` naming the file if it is not
    readable, as a run killed while writing its trace leaves it (0 bytes, or cut off)."""
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise errors.WorkdirError(
            f"{path}: not a readable trace file ({type(e).__name__}: {errors.first_line(e)}); "
            "a run stopped while tracing leaves one: trace again"
        ) from None


def _device_kernels(events: list[dict]) -> list[dict]:
    """The kernels of the first device: on a GPU or TPU the events of its process (named
    `/device:GPU:0...`), on a CPU the thunks with `device_ordinal` 0."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    kernels = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    devices = sorted(p for p, n in names.items() if re.match(r"/device:(GPU|TPU):0\b", n))
    if devices:
        return [e for e in kernels if e["pid"] == devices[0]]
    return [e for e in kernels if str(e["args"].get("device_ordinal", "0")) == "0"]


def _busy(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `(start, end)` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _calls(kernels: list[dict], module: str, meta: dict) -> dict[Any, list[dict]]:
    """`module`'s kernels by call: by their `run_id` (XLA:CPU's); where the trace has none, by
    cutting the time-ordered kernels at the largest gaps into the calls `meta` counts."""
    own = sorted((e for e in kernels if e["args"].get("hlo_module", "?") == module), key=_ts)
    if all("run_id" in e["args"] for e in own):
        runs = collections.defaultdict(list)
        for e in own:
            runs[e["args"]["run_id"]].append(e)
        return runs
    count = meta.get("steps", 1) // meta.get("steps_per_call", 1) + meta.get("warmup_calls", 0)
    gaps = sorted(range(1, len(own)), key=lambda i: own[i]["ts"] - own[i - 1]["ts"])
    cuts = sorted(gaps[len(gaps) - count + 1 :]) if count > 1 else []
    bounds = [0, *cuts, len(own)]
    return {i: own[a:b] for i, (a, b) in enumerate(itertools.pairwise(bounds))}


def _ts(event: dict) -> float:
    return event["ts"]


def table(workdir: str | Path, top: int = 10) -> dict[str, Any]:
    """The kernel table of the newest trace (see the module doc), times in seconds per step."""
    folder = newest(workdir)
    meta_path = folder / META
    meta = _read_json(meta_path) if meta_path.exists() else {}
    kernels = _device_kernels(_events(folder))
    if not kernels:
        raise errors.WorkdirError(f"{folder}: the trace holds no device kernels")
    by_module = collections.Counter()
    for e in kernels:
        by_module[e["args"].get("hlo_module", "?")] += e["dur"]
    # the train step's program, as the run named it; else the one with the most device time
    module = (
        meta.get("module") if meta.get("module") in by_module else by_module.most_common(1)[0][0]
    )
    runs = _calls(kernels, module, meta)
    # each call's first kernel start and last kernel end, in order; the warm-up call's too
    spans = sorted(
        (min(e["ts"] for e in r), max(e["ts"] + e["dur"] for e in r)) for r in runs.values()
    )
    warmups = min(int(meta.get("warmup_calls", 0)), len(spans) - 1)
    for start, _ in spans[:warmups]:  # left out of the table (Tracer), but for the period
        del runs[next(r for r, es in runs.items() if min(e["ts"] for e in es) == start)]
    if not runs:
        raise errors.WorkdirError(f"{folder}: the trace holds no traced call of {module}")
    calls, steps_per_call = len(runs), int(meta.get("steps_per_call", 1))
    steps = calls * steps_per_call
    # the other programs' kernels (an evaluation's): a gap with one is not the step's
    others = sorted(e["ts"] for e in kernels if e["args"].get("hlo_module", "?") != module)
    busy = sum(_busy([(e["ts"], e["ts"] + e["dur"]) for e in run]) for run in runs.values())
    # a call's period: from its first kernel to the next call's where no other program's
    # kernel came between them; else (an evaluation came, or it is the last call) its own span
    # and the median host gap between calls
    clean = [
        bisect.bisect(others, a) == bisect.bisect(others, b)
        for (a, _), (b, _) in itertools.pairwise(spans)
    ]
    gaps = sorted(
        b - e for ((_, e), (b, _)), ok in zip(itertools.pairwise(spans), clean, strict=True) if ok
    )
    gap = (gaps[len(gaps) // 2] + gaps[~(len(gaps) // 2)]) / 2 if gaps else 0.0
    period = 0.0
    for i, (start, end) in enumerate(spans[warmups:], warmups):
        ok = i + 1 < len(spans) and clean[i]
        period += spans[i + 1][0] - start if ok else end - start + gap
    period /= calls
    per_step_busy = busy / calls / steps_per_call * 1e-6
    per_step = max(period / steps_per_call * 1e-6, per_step_busy)
    own = collections.Counter()  # kernel -> summed duration over the calls (us)
    for run in runs.values():
        for e in run:
            own[e["args"].get("hlo_op") or e["name"]] += e["dur"]
    scale = busy / max(sum(own.values()), 1e-9) / calls / steps_per_call * 1e-6
    groups = dict.fromkeys([g for g, _ in GROUPS] + ["other fusions"], 0.0)
    for name, dur in own.items():
        groups[group_of(name)] += dur * scale
    groups[GAPS] = per_step - per_step_busy
    kernels_top = [
        {"name": n, "group": group_of(n), "seconds": d * scale, "share": d * scale / per_step}
        for n, d in own.most_common(top)
    ]
    return {
        "folder": str(folder),
        "module": module,
        "steps": steps,
        "step_s": per_step,
        "busy": per_step_busy / per_step,
        "groups": groups,
        "top": kernels_top,
        "wall_s_per_step": meta.get("wall_s_per_step"),
    }


def render(found: dict[str, Any]) -> str:
    """The table as text."""
    ms = lambda s: f"{1e3 * s:9.3f}"
    step = found["step_s"]
    lines = [
        f"{found['folder']}: {found['steps']} steps of {found['module']}, first device",
        f"{'group':<16}{'ms/step':>9}  share",
    ]
    for group, seconds in found["groups"].items():
        lines.append(f"{group:<16}{ms(seconds)}  {seconds / step:6.1%}")
    wall = found["wall_s_per_step"]
    lines.append(
        f"{'total':<16}{ms(step)}  device busy {found['busy']:.1%}"
        + (f"; wall time while traced {1e3 * wall:.3f} ms/step" if wall else "")
    )
    lines.append(f"top kernels{'':<34}{'ms/step':>9}  share  group")
    for k in found["top"]:
        lines.append(f"  {k['name'][:42]:<43}{ms(k['seconds'])}  {k['share']:5.1%}  {k['group']}")
    if found["groups"].get("CUDA graphs"):
        lines.append(GRAPHS_NOTE.format(share=found["groups"]["CUDA graphs"] / step))
    return "\n".join(lines)
