"""Metrics: TensorBoard and console writers, the start-up lines, the progress line.

This is the only module that imports `clu.metric_writers`, and every clu import of mptrain goes
through `import_clu`. Training needs no TensorFlow: `EventWriter` writes TensorBoard's event
files with the `tensorboard` package's own record framing and protos, and `import_clu` keeps
clu from importing TensorFlow for its own summary writer.
"""

from __future__ import annotations

import importlib
import io
import itertools
import os
import socket
import struct
import sys
import time
import types
from collections.abc import Mapping
from typing import Any, TextIO

import jax
import numpy as np
from absl import logging
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
from tensorboard.plugins.histogram import metadata as histogram_metadata
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer import record_writer
from tensorboard.util import tensor_util

from mptrain import files
from mptrain.record import curves, loggers

_CLU_TF_WRITER = "clu.metric_writers.tf.summary_writer"


def import_clu(name: str) -> types.ModuleType:
    """`clu.<name>` (e.g. `"periodic_actions"`), imported without importing TensorFlow.

    Importing any part of `clu.metric_writers` (`clu.periodic_actions` does too) runs that
    package's `__init__`, which imports clu's TensorFlow summary writer and so TensorFlow:
    seconds of start-up where it is installed, an ImportError where it is not (GPU images with
    jax[cuda] seldom have it). So, before clu's first import, a stand-in goes under that
    module's name whose `SummaryWriter(logdir)` is an `EventWriter`: clu's own writers then
    write the same events, TensorFlow or not. A module already there (clu's own, imported
    before mptrain, or a stopgap) is left alone; mptrain's writers never go through it.
    """
    if _CLU_TF_WRITER not in sys.modules:
        stand_in = types.ModuleType(_CLU_TF_WRITER, "mptrain's stand-in: no TensorFlow needed")
        stand_in.SummaryWriter = _CluSummaryWriter
        sys.modules[_CLU_TF_WRITER] = stand_in
    return importlib.import_module(f"clu.{name}")


class _CluSummaryWriter:
    """clu's `SummaryWriter` in an mptrain process: building one builds an `EventWriter`.

    A factory, not `EventWriter` itself, because clu binds this name while this module is
    still being imported (`EventWriter` derives from clu's interface), before it exists.
    """

    def __new__(cls, logdir: str) -> EventWriter:
        return EventWriter(logdir)

    def __init_subclass__(cls, **kwargs):
        raise TypeError(
            "clu's SummaryWriter is mptrain.record.metrics.EventWriter here: subclass that"
        )


# At import, so the stand-in is in place before any other clu import (trainer's, a user's).
_interface = import_clu("metric_writers.interface")
_SERIAL = itertools.count()  # tells apart the files of one process opened at once
_PREFIX = "events.out.tfevents."
# The plugin metadata TF2's `tf.summary.scalar`, `.text`, `.histogram` and `.image` attach.
_SCALAR = scalar_metadata.create_summary_metadata(display_name=None, description=None)
_TEXT = text_metadata.create_summary_metadata(display_name=None, description=None)
_HISTOGRAM = histogram_metadata.create_summary_metadata(display_name=None, description=None)
_IMAGE = image_metadata.create_summary_metadata(display_name=None, description=None)
_HISTOGRAM_BUCKETS = 30  # tf.summary.histogram's default


def _value(tag: str, array: np.ndarray, metadata=None) -> summary_pb2.Summary.Value:
    tensor = tensor_util.make_tensor_proto(array)
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)


def _scalar(tag: str, value: Any) -> summary_pb2.Summary.Value:
    """`_value(tag, float32 scalar, _SCALAR)`, the same bytes, built directly: the generic
    `make_tensor_proto` was 8 us a scalar, most of a log step's write."""
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[np.float32(value)])
    tensor.tensor_shape.SetInParent()  # an empty shape: a scalar, written as TF writes it
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=_SCALAR)


def _masked_crc32c(data: bytes) -> int:
    """The record framing's checksum (TFRecord's masked CRC-32C), in C through
    `google_crc32c`: tensorboard's own is a Python loop over the bytes, 80 us for a log step's
    event of 600 bytes, run in the writer's thread while the train loop wants the GIL."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


try:
    from google_crc32c import value as _crc32c
except ImportError:  # a slower checksum, the same files
    _masked_crc32c = record_writer.masked_crc32c


class RecordWriter(record_writer.RecordWriter):
    """tensorboard's `RecordWriter` (length, masked CRC of it, data, masked CRC of the data),
    with the checksum in C."""

    def write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        header_crc = struct.pack("<I", _masked_crc32c(header))
        self._writer.write(header + header_crc + data + struct.pack("<I", _masked_crc32c(data)))


def _histogram(data: Any, buckets: int) -> np.ndarray:
    """`[buckets, 3]` rows of (left edge, right edge, count) over the finite values, with
    equal-width buckets from min to max, as TF2's `tf.summary.histogram` stores them."""
    data = np.asarray(data, np.float64).ravel()
    data = data[np.isfinite(data)]
    if not data.size:
        return np.zeros((buckets, 3))
    low, high = data.min(), data.max()
    if low == high:  # one value: every edge on it, everything counted in the last bucket
        counts, edges = np.zeros(buckets), np.full(buckets + 1, low)
        counts[-1] = data.size
    else:
        counts, edges = np.histogram(data, bins=buckets, range=(low, high))
    return np.stack([edges[:-1], edges[1:], counts], axis=1)


def _png(image: np.ndarray) -> bytes:
    from PIL import Image  # tensorboard depends on Pillow; only images need it

    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format="PNG")
    return buffer.getvalue()


def _file_name(logdir) -> str:
    """A new event file's name, after every one in `logdir` in name order: TensorBoard reads a
    folder's files in that order, and a file read after a later one has its events taken for a
    restarted session's and drops what the later one holds. So its second is now, or one past
    the newest file's where that is now or later (a stop and a resume within one second, a clock
    set back). The serial only tells apart files opened at once (unpadded, `.10` sorts first)."""
    second = int(time.time())
    for name in os.listdir(logdir):
        stamp = name.split(".")[3] if name.startswith(_PREFIX) else ""
        if stamp.isdigit():
            second = max(second, int(stamp) + 1)
    return f"{_PREFIX}{second:010d}.{socket.gethostname()}.{os.getpid()}.{next(_SERIAL)}.v2"


class EventWriter(_interface.MetricWriter):
    """TensorBoard event files in `logdir`, written without TensorFlow, in the form TF2's
    `tf.summary` writes: a scalar is a float32 tensor with the scalar plugin's metadata, so
    TensorBoard and `EventAccumulator(...).Tensors(tag)` read these files as TensorFlow's.

    Every call appends one event and flushes it to the OS: TensorBoard sees a running job's
    values and a killed job loses none (`create_writer` keeps the writes off the train loop).
    Texts, hparams, histograms, images and raw tensor summaries are written too; videos and
    audio are not, and a call with them logs a warning that names them.
    """

    def __init__(self, logdir: str | os.PathLike, restart: int | None = None):
        """`restart`: the first step this writer writes. TensorBoard then drops the events of
        that step and later from the files before this one (what a crash left past the
        checkpoint a run resumes from), as it does for TensorFlow's restarted sessions."""
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, _file_name(logdir))
        self._records = RecordWriter(open(self.path, "wb"))  # noqa: SIM115 (closed in close)
        self._write(event_pb2.Event(file_version="brain.Event:2"))
        if restart is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._write(event_pb2.Event(step=int(restart), session_log=start))

    def _write(self, event: event_pb2.Event) -> None:
        event.wall_time = time.time()
        self._records.write(event.SerializeToString())
        self._records.flush()

    def _write_values(self, step: int, values: list[summary_pb2.Summary.Value]) -> None:
        if values:
            self._write(event_pb2.Event(step=int(step), summary=summary_pb2.Summary(value=values)))

    def write_scalars(self, step: int, scalars: Mapping[str, Any]):
        self._write_values(step, [_scalar(key, value) for key, value in scalars.items()])

    def write_texts(self, step: int, texts: Mapping[str, str]):
        values = [_value(key, np.array(text, dtype=object), _TEXT) for key, text in texts.items()]
        self._write_values(step, values)

    def write_histograms(self, step: int, arrays: Mapping[str, Any], num_buckets=None):
        buckets = num_buckets or {}
        values = [
            _value(key, _histogram(array, buckets.get(key) or _HISTOGRAM_BUCKETS), _HISTOGRAM)
            for key, array in arrays.items()
        ]
        self._write_values(step, values)

    def write_images(self, step: int, images: Mapping[str, Any]):
        """`[N, H, W, C]` or `[H, W, C]` images, C = 1, 3 or 4; uint8, or floats in [0, 1]."""
        values = []
        for key, value in images.items():
            array = np.asarray(value)
            array = array[None] if array.ndim == 3 else array
            if array.ndim != 4 or array.shape[-1] not in (1, 3, 4):
                raise ValueError(f"image {key!r}: want [N, H, W, C], C in 1, 3, 4; {array.shape}")
            if array.dtype.kind == "f":
                array = np.round(np.clip(array, 0.0, 1.0) * 255.0)
            height, width = array.shape[1:3]
            pngs = [_png(image) for image in array.astype(np.uint8)]
            tensor = np.array([str(width).encode(), str(height).encode(), *pngs], dtype=object)
            values.append(_value(key, tensor, _IMAGE))
        self._write_values(step, values)

    def write_summaries(self, step: int, values: Mapping[str, Any], metadata=None):
        """Raw tensors; `metadata[key]` is a `SummaryMetadata` proto or its serialized bytes."""
        protos = []
        for key, value in values.items():
            meta = (metadata or {}).get(key)
            if isinstance(meta, bytes):
                meta = summary_pb2.SummaryMetadata.FromString(meta)
            protos.append(_value(key, np.asarray(value), meta))
        self._write_values(step, protos)

    def write_hparams(self, hparams: Mapping[str, Any]):
        summary = hparams_summary.hparams_pb(loggers.flat(hparams))
        self._write(event_pb2.Event(step=0, summary=summary))

    def _unsupported(self, kind: str, keys) -> None:
        logging.warning("mptrain: EventWriter does not write %s; not written: %s", kind, list(keys))

    def write_videos(self, step: int, videos: Mapping[str, Any]):
        self._unsupported("videos", videos)

    def write_audios(self, step: int, audios: Mapping[str, Any], *, sample_rate: int):
        self._unsupported("audio", audios)

    def flush(self):
        if not self._records.closed:
            self._records.flush()

    def close(self):
        if not self._records.closed:
            self._records.close()


def report_start(workdir, state, compiled_step, mesh, start: int, report) -> None:
    """Writes `<workdir>/precision_report.txt` (process 0) and logs how a run starts: precision,
    loss scale, params, state bytes per param and per device, the compiled step's memory, the
    mesh (`4 devices: data 4 x fsdp 1 x expert 1 x context 1`) and the bytes its collectives
    move a step by the axes they span (`hlo.by_axis`), and the report's warnings (unsafe
    setups, matmuls outside the compute dtype). Settings that cannot take effect are
    `loop.Run`'s to warn of."""
    from mptrain.inspect import audit

    if jax.process_index() == 0:
        files.write_text(os.path.join(workdir, "precision_report.txt"), str(report))
    with jax.transfer_guard("allow"):
        scale = float(state.loss_scale.loss_scale)
    # Kahan's compensation buffer is persistent state per param as much as the moments are
    per_param = audit.state_bytes_per_param(
        state.params, (state.opt_state, state.param_compensation)
    )
    on_one = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    memory = compiled_step.memory_analysis()
    used = f"{mesh.size}" + (f" of {jax.device_count()}" if mesh.size < jax.device_count() else "")
    logging.info(
        f"mptrain: precision {state.policy} (matmul precision {state.policy.matmul_precision}), "
        f"param rounding {state.param_rounding}, loss scale "
        f"{type(state.loss_scale).__name__} (scale {scale:g}), "
        f"{sum(x.size for x in jax.tree.leaves(state.params))} params, {per_param:.1f} state "
        f"bytes/param, mesh {used} devices: "
        + " x ".join(f"{axis} {n}" for axis, n in mesh.shape.items())
    )
    if report.axis_bytes:
        moved = ", ".join(f"{axes} {b / 2**20:,.1f} MiB" for axes, b in report.axis_bytes.items())
        logging.info(f"mptrain: collectives a step by mesh axis: {moved}")
    logging.info(f"mptrain: casting rule {state.policy.describe_rules(state.params)}")
    if jax.tree.leaves(getattr(state, "frozen", {})):  # adapters over a frozen base
        logging.info(f"mptrain: trained: {report.trains}")
    logging.info(
        f"mptrain: per device: state {on_one / 2**20:.1f} MiB; the compiled train step "
        f"{memory.temp_size_in_bytes / 2**20:.1f} MiB temporaries, "
        f"{memory.argument_size_in_bytes / 2**20:.1f} MiB arguments"
    )
    for warning in report.warnings:
        logging.warning("mptrain: %s", warning)
    if start:
        logging.info("mptrain: resuming from step %d", start)


def create_writer(
    workdir: str | os.PathLike,
    *,
    is_main_process: bool = True,
    restart: int | None = None,
    config: Any = None,
):
    """TensorBoard events (an `EventWriter`, `restart` as there) in `workdir`, absl log lines,
    and the loggers `config.log_to` names (`loggers`: W&B, MLflow), written from a background
    thread so the train loop never waits on a disk or a network; on other processes, nothing."""
    metric_writers = import_clu("metric_writers")
    if not is_main_process:
        return metric_writers.MultiWriter([])
    # One background thread for the log and the event file (a log step then costs the loop one
    # hand-off, not one per writer); each remote logger gets its own, so a slow network never
    # holds up TensorBoard.
    local = metric_writers.MultiWriter(
        [metric_writers.LoggingWriter(), EventWriter(workdir, restart)]
    )
    remote = loggers.create(config, workdir) if config is not None else []
    return metric_writers.MultiWriter([metric_writers.AsyncWriter(w) for w in (local, *remote)])


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Host floats from fetched metrics (bools become 0/1)."""
    return {k: float(np.asarray(v)) for k, v in metrics.items() if np.ndim(v) == 0}


def vectors(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The fetched metrics of one axis (a mixture of experts' share of tokens an expert), for
    the history: a log line of 128 values would be unreadable."""
    return {k: np.asarray(v) for k, v in metrics.items() if np.ndim(v) == 1}


def _fmt_secs(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """One live status line (step, loss, scale, tokens/s or examples/s, MFU, steps/s, ETA) when
    the stream is a terminal.

    On a terminal the line is redrawn in place; otherwise nothing is printed, since the log
    lines of the writer already carry the same numbers into files and pipes.
    """

    def __init__(self, num_train_steps: int, stream: TextIO | None = None):
        self.num_train_steps = num_train_steps
        self.stream = stream or sys.stdout
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last: tuple[int, float] | None = None
        self._rate: float | None = None

    def update(self, step: int, values: Mapping[str, float]) -> str:
        now = time.monotonic()
        if self._last is not None and step > self._last[0]:
            self._rate = (step - self._last[0]) / max(now - self._last[1], 1e-9)
        self._last = (step, now)
        parts = [f"step {step}/{self.num_train_steps}"]
        for key in ("loss", "eval_loss"):
            if key in values:
                parts.append(f"{key} {curves.loss_text(values[key])}")
        if "loss_scale" in values:
            parts.append(f"loss_scale {values['loss_scale']:g}")
        if values.get("skipped_steps"):
            parts.append(f"skipped {int(values['skipped_steps'])}")
        for key, unit in (("tokens_per_s", "tok/s"), ("examples_per_s", "ex/s")):
            if key in values:
                parts.append(f"{values[key]:,.0f} {unit}")
        if "mfu" in values:
            parts.append(f"MFU {values['mfu']:.1%}")
        if self._rate:
            eta = (self.num_train_steps - step) / self._rate
            parts.append(f"{self._rate:.2f} steps/s ETA {_fmt_secs(eta)}")
        line = " | ".join(parts)
        if self.live:
            end = "\n" if step >= self.num_train_steps else ""
            self.stream.write("\r\x1b[2K" + line + end)
            self.stream.flush()
        return line
