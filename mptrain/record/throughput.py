"""Speed in the record: step time, tokens (or examples) per second, model TFLOP/s, MFU, goodput.

`Meter.values(step, ...)` gives a log step's figures, measured on the host between two log
steps whose metrics have come back from the devices (so the steps between them are done), less
the time the host spent outside train steps meanwhile (`Clock`): evaluations, checkpoints,
waits for data, profiling. `Clock.summary()` is the run's goodput: the share of its wall time
(set-up included: compiling, restoring) that went to train steps, what MaxText calls goodput.

Model FLOPs are analytic, as PaLM's appendix B counts them, for the language models only: per
token, 6 x the params that take part in matmuls (all but the token and position embedding
tables, which are gathered, not multiplied; a head tied to the embedding counts once) for the
forward and backward pass, plus the attention scores and their product with the values,
6 x layers x width x sequence length (12 x ... for full attention, halved because a causal
mask leaves half of the score matrix unused). MFU is those FLOPs per second per device over
the chip's peak for the compute dtype (the targets' spec files, `mptrain.target`); where the
devices are not of a known kind (a CPU, say) there is no MFU, and the log says so once.

Packed rows (`data.name="sft"`) count only their real tokens, not the padding between
examples: the source's `real_tokens(a, b)` gives those of the batches a step ran, tokens/s and
the FLOPs behind MFU scale by them, and the progress line says "real tokens/s". The attention
term keeps the row's length, an upper bound for rows of several short examples.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from mptrain import errors, models

# jax's `device_kind` -> the target whose spec holds its peak; the first match wins.
_KINDS = (
    (r"h100", "h100"),
    (r"h200", "h200"),
    (r"a100", "a100"),
    (r"b200", "b200"),
    (r"tpu v4", "v4"),
    (r"tpu v5 ?(lite|e)", "v5e"),
    (r"tpu v5", "v5p"),
    (r"tpu v6", "v6e"),
)
# The keys `Meter.values` and `Run` write (for the history's rows: `curves.KEYS`).
KEYS = (
    "step_time_s",
    "steps_per_sec",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "examples_per_s",
    "examples_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "goodput",
)
_EMBEDDINGS = re.compile(r"embed|pos_emb|position", re.IGNORECASE)


def chip_of(device: Any) -> Any:
    """The `target.Target` (spec file) of a jax device's kind, or None for a kind not known
    (CPUs)."""
    from mptrain import target

    targets = target.targets()
    kind = str(getattr(device, "device_kind", "")).lower()
    for pattern, name in _KINDS:
        if re.search(pattern, kind):
            return targets.get(name)
    return None


def peak_dtype(policy: Any) -> str:
    """The peak rate a policy's matmuls run at: its compute dtype's (fp8-mixed computes in
    bf16 outside its fp8 matmuls, so bf16's), `float32_highest` for fp32 at HIGHEST."""
    name = jax.numpy.dtype(policy.compute_dtype).name
    if name == "float32" and str(getattr(policy, "matmul_precision", "")).lower() == "highest":
        return "float32_highest"
    return name


def matmul_params(params: Any) -> int:
    """The params that take part in matmuls: every leaf but embedding tables (by path)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(
        int(x.size) for path, x in leaves if not _EMBEDDINGS.search(jax.tree_util.keystr(path))
    )


def lm_flops_per_token(params: Any, model: Any, seq_len: int) -> float:
    """Training FLOPs per token of a causal LM (the module doc's formula): 6 x matmul params
    (the tied head's table once) + 6 x layers x attention width x `seq_len`."""
    tied = getattr(model, "tie_embeddings", False)
    n = matmul_params(params) + (model.vocab_size * model.d_model if tied else 0)
    head_dim = getattr(model, "head_dim", None) or model.d_model // model.num_heads
    width = model.num_heads * head_dim
    return 6.0 * n + 6.0 * model.num_layers * width * seq_len


def mfu(flops_per_step: float, step_seconds: float, devices: int, peak: float) -> float:
    """Model FLOPs utilization: the FLOPs one device does per second over its `peak`."""
    return flops_per_step / step_seconds / devices / peak


class Clock:
    """Wall time since a run began, and the time spent outside train steps in named sections
    (`section("eval")`); a section inside another is counted once, as the inner one. A hook
    with a `section` attribute is timed under that name (None: as train time, as a hook that
    waits for the steps)."""

    def __init__(self, began: float | None = None):
        self.began = time.monotonic() if began is None else began
        self.spent: dict[str, float] = {}
        self._stack: list[list] = []

    @contextlib.contextmanager
    def section(self, name: str | None):
        """Times what runs inside as `name` (None: train time, not timed)."""
        if name is None:
            yield
            return
        entry = [name, time.monotonic(), 0.0]  # name, start, time of inner sections
        self._stack.append(entry)
        try:
            yield
        finally:
            self._stack.pop()
            took = time.monotonic() - entry[1]
            self.spent[name] = self.spent.get(name, 0.0) + took - entry[2]
            if self._stack:
                self._stack[-1][2] += took

    def outside(self, *but: str) -> float:
        """Seconds spent in sections so far, but those named `but` (a running one not yet
        counted)."""
        return sum(secs for name, secs in self.spent.items() if name not in but)

    def goodput(self) -> float:
        """The share of the wall time so far spent in train steps."""
        return max(0.0, 1.0 - self.outside() / max(time.monotonic() - self.began, 1e-9))

    def summary(self) -> str:
        """The goodput line: the share of wall time in train steps, and where the rest went."""
        wall = time.monotonic() - self.began
        parts = sorted(self.spent.items(), key=lambda kv: -kv[1])
        rest = ", ".join(f"{name} {secs:.1f} s" for name, secs in parts if secs >= 0.05)
        return (
            f"goodput {self.goodput():.1%} of {wall:.1f} s in train steps; outside them: "
            f"{rest or 'nothing'}"
        )


class Meter:
    """A log step's speed figures (the module doc). `work`: tokens per step for an LM, else
    examples; `flops`: model FLOPs per step (None: not known); `peak`: a device's peak FLOP/s
    for the compute dtype (None: not known, so no MFU)."""

    def __init__(self, clock: Clock, start: int, work: tuple[str, int], devices: int,
                 flops: float | None, peak: float | None, total: int | None = None,
                 count: Callable[[int, int], int] | None = None):  # fmt: skip
        self.clock, self.work, self.devices = clock, work, devices
        self.flops, self.peak, self.total = flops, peak, total  # total: the run's steps
        self.count = count  # count(a, b): the real tokens of batches a .. b - 1 (packed rows)
        self._last = (start, time.monotonic(), clock.outside())

    def values(self, step: int) -> dict[str, float]:
        """The figures of the steps since the last call (or the start), ending at `step`."""
        now, outside = time.monotonic(), self.clock.outside()
        first, then, before = self._last
        self._last = (step, now, outside)
        if step <= first:
            return {}
        steps, elapsed = step - first, now - then
        seconds = max(elapsed - (outside - before), 1e-9) / steps
        unit, per_step = self.work
        flops = self.flops
        if self.count is not None:  # packed rows: only their real tokens count, not padding
            real = self.count(first, step) / steps
            flops, per_step = flops and flops * real / per_step, real
        values = {
            "step_time_s": seconds,
            "steps_per_sec": steps / max(elapsed, 1e-9),
            f"{unit}_per_s": per_step / seconds,
            f"{unit}_per_s_per_device": per_step / seconds / self.devices,
        }
        if flops is not None and self.peak:
            values["tflops_per_device"] = flops / seconds / self.devices / 1e12
            values["mfu"] = mfu(flops, seconds, self.devices, self.peak)
        if self.total:  # the log's progress line, for files and pipes (clu's form)
            eta = (self.total - step) / values["steps_per_sec"]
            logging.info(
                "mptrain: %.1f%% (%d/%d), %.2f steps/s, %.0f %s/s, ETA %d min %02d s",
                100 * step / self.total, step, self.total, values["steps_per_sec"],
                values[f"{unit}_per_s"], "real " + unit if self.count else unit,
                eta // 60, eta % 60,
            )  # fmt: skip
        return values


def create_meter(config: Any, state: Any, start: int, clock: Clock, source: Any = None) -> Meter:
    """The `Meter` of a run: what a step processes (tokens of `data.seq_len` for the zoo's
    LMs, else examples; the real tokens only where the train `source` counts them: packed
    rows' padding is no work done), its analytic FLOPs and the devices' peak; logs once why
    there is no MFU where there is none."""
    devices = sorted(jax.tree.leaves(state.params)[0].sharding.device_set, key=lambda d: d.id)
    lm = models.loss_unit(config) != "nats"
    seq_len = errors.setting(config.data, "seq_len", None) if lm else None
    work = ("tokens", config.batch_size * seq_len) if seq_len else ("examples", config.batch_size)
    flops = None
    if seq_len:
        flops = lm_flops_per_token(state.params, config.model, seq_len) * work[1]
    chip, peak = chip_of(devices[0]), None
    if chip is not None:
        peak = chip.peak(peak_dtype(state.policy))
    if flops is None or peak is None:
        why = (
            f"the devices ({devices[0].device_kind}) are of no kind in mptrain/targets/"
            if chip is None
            else f"{chip.name} has no peak for {peak_dtype(state.policy)}"
        )
        if flops is None:
            why = f"{config.model.name} has no analytic FLOP count (the LMs have)"
        logging.info("mptrain: no MFU in the record: %s", why)
    count = getattr(source, "real_tokens", None) if seq_len else None
    return Meter(clock, start, work, len(devices), flops, peak, config.num_train_steps, count)
