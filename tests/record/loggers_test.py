"""W&B and MLflow beside TensorBoard (issue 36, point 4): `config.log_to`, read back for real
without a network (W&B offline, its own run file; MLflow's file store, through its client).

The tests that need the packages carry the `loggers` marker and run by `make test-loggers`,
which installs the extras `mptrain[wandb,mlflow]`; `make test` leaves them out. The missing-
extra test needs neither and runs in `make test`."""

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import run_cli

from mptrain.record import loggers

RUN = ("--config.num_train_steps=4", "--config.log_to=tensorboard,wandb,mlflow")


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (`run-<id>.wandb`): a 7-byte header, then
    LevelDB's log format, 32 KiB blocks of fragments (crc 4, length 2, type 1, data), a record
    whole (type 1) or in a first (2), middle (3) and last (4) fragment."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, found, parts = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            found.append(record)
            parts = b""
    return found


def _items(items) -> dict:
    """`{key: value}` of W&B's items (a key, or a nested key's parts)."""
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A tiny 4-step run that logs to all three."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    root = tmp_path_factory.mktemp("loggers")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", (root / "mlruns").as_uri())
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in
        env.delenv("WANDB_MODE", raising=False)  # offline: the default
        assert run_cli(root / "run", *RUN)[0] == 0
    return root


@pytest.mark.loggers
def test_wandb_offline_keeps_the_metrics_config_and_report(logged):
    (run_file,) = (logged / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    kinds = {kind: [r for r in records if r.WhichOneof("record_type") == kind] for kind in
             ("history", "run", "config", "summary")}  # fmt: skip
    history = [_items(r.history.item) for r in kinds["history"]]
    losses = {row["_step"]: row["loss"] for row in history if "loss" in row}
    assert sorted(losses) == [2, 4] and all(v > 0 for v in losses.values())
    assert any("tokens_per_s" in row for row in history)
    config = {k: v for r in kinds["run"] for k, v in _items(r.run.config.update).items()}
    assert config["precision"] == "bf16-mixed" and config["model.d_model"] == 32
    summary = {k: v for r in kinds["summary"] for k, v in _items(r.summary.update).items()}
    assert summary["precision.matmul_share.bfloat16"] == "100.00%"
    assert summary["loss"] == pytest.approx(losses[4]) and 0 < summary["goodput"] < 1
    assert summary["eval_loss"] > 0
    assert list(run_file.parent.glob("files/precision_report.txt"))


@pytest.mark.loggers
def test_mlflow_file_store_keeps_the_metrics_config_and_report(logged):
    from mlflow.tracking import MlflowClient

    client = MlflowClient((logged / "mlruns").as_uri())
    run_id = json.loads((logged / "run" / loggers.IDS).read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert sorted(losses) == [2, 4] and all(v > 0 for v in losses.values())
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval_loss")) == [4]
    assert [m.step for m in client.get_metric_history(run_id, "tokens_per_s")] == [2, 4]
    assert run.data.params["precision"] == "bf16-mixed"
    assert run.data.params["model.d_model"] == "32"
    assert run.data.tags["precision.matmul_share.bfloat16"] == "100.00%"
    assert 0 < run.data.metrics["goodput"] < 1  # the final metrics: each one's latest
    assert [a.path for a in client.list_artifacts(run_id)] == ["precision_report.txt"]


def test_a_missing_extra_is_one_line_naming_the_pip_line(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        loggers.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    code, err = run_cli(tmp_path / "run", "--config.log_to=wandb", capsys=capsys)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if "wandb" in line]
    assert len(lines) == 1 and "pip install 'mptrain[wandb]'" in lines[0], err[-500:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before anything ran
