"""Training needs no TensorFlow (issue 17): mptrain's own TensorBoard writer, clu importable
without TensorFlow, and TensorFlow only for tfds data, as the extra `mptrain[tfds]`.

The processes started here get a `sitecustomize` (through PYTHONPATH) that runs before anything
else, as on a machine set up that way: it can make TensorFlow unimportable, and it reports at
exit which TensorFlow modules the process loaded.
"""

import importlib.util
import io
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, TINY, event_series, run_cli_process
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from mptrain.record import metrics

_BLOCK_TENSORFLOW = """
import sys
sys.modules["tensorflow"] = sys.modules["tensorflow_datasets"] = None  # as if not installed
"""
_REPORT_TENSORFLOW = """
import atexit
import sys

def _report():
    loaded = sorted(
        name for name, module in sys.modules.items()
        if name.split(".")[0] in ("tensorflow", "tensorflow_datasets") and module is not None
    )
    sys.stderr.write(f"\\nTENSORFLOW MODULES LOADED: {len(loaded)} {loaded[:3]}\\n")

atexit.register(_report)
"""
_NONE_LOADED = "TENSORFLOW MODULES LOADED: 0 []"


@pytest.fixture
def prelude(tmp_path, monkeypatch):
    """`prelude(code)`: `code` runs first in every Python process this test starts."""

    def install(code: str) -> None:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(code)
        paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))

    return install


def test_the_tiny_default_trains_and_writes_events_without_tensorflow(tmp_path, prelude):
    prelude(_BLOCK_TENSORFLOW + _REPORT_TENSORFLOW)
    workdir = tmp_path / "run"
    result = run_cli_process(TINY, f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _NONE_LOADED in result.stderr
    log_steps, eval_steps = [2, 4, 6, 8], [4, 8]  # the tiny config logs every 2, evals every 4
    for tag, steps in (("loss", log_steps), ("loss_scale", log_steps), ("eval_loss", eval_steps)):
        series = event_series(workdir, tag)
        assert sorted(series) == steps, (tag, series)
        assert all(v.dtype == np.float32 and v.shape == () for v in series.values()), tag
        assert all(np.isfinite(v) and v > 0 for v in series.values()), (tag, series)


@pytest.mark.slow  # a second CLI run; the one above already finds no TensorFlow module loaded
@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="needs TensorFlow installed"
)
def test_a_text_data_run_does_not_import_installed_tensorflow(tmp_path, prelude):
    prelude(_REPORT_TENSORFLOW)
    workdir = tmp_path / "run"
    result = run_cli_process(TINY, f"--workdir={workdir}", "--config.num_train_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _NONE_LOADED in result.stderr, result.stderr[-300:]
    assert sorted(event_series(workdir, "loss")) == [2]


def test_tfds_data_without_the_extra_is_a_one_line_config_error(tmp_path, prelude):
    prelude(_BLOCK_TENSORFLOW)
    workdir = tmp_path / "run"
    # the full config: its :tiny variant trains on synthetic images, without TensorFlow
    result = run_cli_process(
        f"--config={ROOT / 'configs' / 'mnist_cnn.py'}", f"--workdir={workdir}"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("mptrain: error:")]
    assert len(error) == 1, result.stderr[-3000:]
    assert "data.name='tfds'" in error[0] and "pip install 'mptrain[tfds]'" in error[0]
    assert "Traceback" not in result.stderr
    assert not workdir.exists()


def test_event_writer_round_trips_through_tensorboards_reader(tmp_path, caplog):
    writer = metrics.EventWriter(tmp_path)
    writer.write_scalars(3, {"loss": np.float32(1.5), "finite": True, "norm": jnp.asarray(2.0)})
    writer.write_scalars(5, {"loss": 0.25})
    writer.write_texts(3, {"note": "héllo"})
    writer.write_hparams({"lr": 0.1, "model": {"name": "mlp", "layers": np.int32(2)}, "x": None})
    writer.write_histograms(3, {"w": np.arange(100.0), "one": [7.0, np.nan]}, {"w": 4})
    writer.write_images(3, {"img": np.full((2, 3, 4, 3), 0.5, np.float32)})
    writer.write_videos(3, {"clip": np.zeros((1, 2, 3, 4, 3))})
    writer.close()

    assert event_series(tmp_path, "loss") == {3: 1.5, 5: 0.25}
    assert event_series(tmp_path, "finite") == {3: 1.0} and event_series(tmp_path, "norm") == {
        3: 2.0
    }
    events = event_accumulator.EventAccumulator(writer.path, size_guidance={"tensors": 0})
    events.Reload()
    assert events.SummaryMetadata("loss").plugin_data.plugin_name == "scalars"  # as TF2 writes

    assert event_series(tmp_path, "note")[3] == "héllo".encode()
    assert events.SummaryMetadata("note").plugin_data.plugin_name == "text"

    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["lr"].number_value == 0.1 and hparams["model.layers"].number_value == 2
    assert hparams["model.name"].string_value == "mlp" and hparams["x"].string_value == "None"

    histogram = event_series(tmp_path, "w")[3]  # rows of (left edge, right edge, count)
    np.testing.assert_allclose(histogram[:, 0], [0, 24.75, 49.5, 74.25])
    np.testing.assert_allclose(histogram[:, 1], [24.75, 49.5, 74.25, 99])
    np.testing.assert_array_equal(histogram[:, 2], [25, 25, 25, 25])
    one = event_series(tmp_path, "one")[3]  # one finite value: counted in the last of 30 buckets
    assert one.shape == (30, 3) and one[-1, 2] == 1 and one[:, 2].sum() == 1

    width, height, *pngs = event_series(tmp_path, "img")[3]
    assert (width, height, len(pngs)) == (b"4", b"3", 2)
    pixels = np.asarray(Image.open(io.BytesIO(pngs[0])))
    assert pixels.shape == (3, 4, 3) and (pixels == 128).all()
    assert events.SummaryMetadata("img").plugin_data.plugin_name == "images"

    assert "does not write videos" in caplog.text and "clip" in caplog.text


def test_a_resumed_writer_in_the_same_second_is_read_after_the_stopped_one(tmp_path, monkeypatch):
    """TensorBoard reads a folder's files in name order: a stop and its resume within one second
    (the tenth writer of a process after the ninth) once read the resume's file first, and the
    stopped file's early steps then dropped every later one as a restarted session's."""
    import itertools

    from tensorboard.backend.event_processing import plugin_event_accumulator

    monkeypatch.setattr(metrics.time, "time", lambda: 1_800_000_000.5)
    monkeypatch.setattr(metrics, "_SERIAL", itertools.count(9))
    stopped = metrics.EventWriter(tmp_path)
    for step in (1, 2, 3):
        stopped.write_scalars(step, {"loss": float(step)})
    stopped.close()
    resumed = metrics.EventWriter(tmp_path, restart=4)
    resumed.write_scalars(5, {"loss": 5.0})
    resumed.close()
    assert sorted(os.listdir(tmp_path)) == [Path(stopped.path).name, Path(resumed.path).name]
    events = plugin_event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("loss")] == [1, 2, 3, 5]


def test_scalar_events_are_the_bytes_of_the_generic_path(tmp_path):
    """A log step's scalars take a direct proto and a C checksum (the generic tensor proto and
    tensorboard's Python CRC were 280 us a write of the background thread): the same bytes,
    each record's framing checked with tensorboard's own CRC."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import masked_crc32c

    values = {"loss": 1.2345, "zero": 0.0, "tiny": -3e-40, "nan": np.nan, "inf": -np.inf}
    values |= {"f32": np.float32(2.5), "int": np.int32(7), "flag": True, "jax": jnp.asarray(3.0)}
    writer = metrics.EventWriter(tmp_path)
    writer.write_scalars(4, values)
    writer.close()
    data, records = Path(writer.path).read_bytes(), []
    while data:
        (length,) = np.frombuffer(data[:8], "<u8")
        header_crc, body = data[8:12], data[12 : 12 + length]
        assert masked_crc32c(data[:8]).to_bytes(4, "little") == header_crc
        assert masked_crc32c(body).to_bytes(4, "little") == data[12 + length : 16 + length]
        records.append(event_pb2.Event.FromString(body))
        data = data[16 + length :]
    written = records[-1].summary.value
    for got, (tag, value) in zip(written, values.items(), strict=True):
        generic = metrics._value(tag, np.asarray(value, np.float32).reshape(()), metrics._SCALAR)
        assert got.SerializeToString() == generic.SerializeToString(), tag


def test_create_writer_does_not_go_through_clus_summary_writer(tmp_path, monkeypatch):
    # The GPU machines' stopgap makes clu's SummaryWriter a no-op; mptrain's events must not care.
    class NoOp:
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    for name in ("metric_writers", "metric_writers.summary_writer", "metric_writers.utils"):
        monkeypatch.setattr(metrics.import_clu(name), "SummaryWriter", NoOp)
    writer = metrics.create_writer(tmp_path / "main")
    writer.write_scalars(1, {"loss": 2.0})
    writer.close()
    assert event_series(tmp_path / "main", "loss") == {1: 2.0}

    other = metrics.create_writer(tmp_path / "other", is_main_process=False)
    other.write_scalars(1, {"loss": 2.0})
    other.close()
    assert not (tmp_path / "other").exists()
