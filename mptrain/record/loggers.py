"""The record's other homes: Weights & Biases and MLflow, beside TensorBoard (`config.log_to`).

    --config.log_to=tensorboard,wandb,mlflow

Each is a writer of clu's interface (`write_scalars`, `write_texts`, `write_hparams`, ...) that
`metrics.create_writer` adds to the run's writers, so it gets every value TensorBoard gets, from
a background thread of its own (a slow network never holds up TensorBoard). A run sends its
config (flattened, as params) at the start; at the end the precision report
(`precision_report.txt`, and its matmul FLOPs by dtype as params) and the final value of every
metric (W&B's summary; MLflow keeps each metric's latest). A resumed run continues the same W&B
or MLflow run: their ids are kept in `<workdir>/loggers.json`.

- W&B (`pip install 'mptrain[wandb]'`): project "mptrain" (or `WANDB_PROJECT`), the run named
  after the workdir, in offline mode unless `WANDB_MODE` says otherwise: its files go to
  `<workdir>/wandb/`, and `wandb sync <workdir>/wandb/offline-run-*` uploads them later.
- MLflow (`pip install 'mptrain[mlflow]'`): experiment "mptrain" (or `MLFLOW_EXPERIMENT_NAME`)
  at MLflow's tracking URI (`MLFLOW_TRACKING_URI`; by default its own `./mlruns` file store).

A name whose package is missing is a `ConfigError` naming the pip line (`check`), raised before
anything compiles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mptrain import errors, files

EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # name in log_to -> the module it needs
IDS = "loggers.json"
REPORT = "precision_report.txt"
PROJECT = __package__  # W&B's project and MLflow's experiment: "mptrain"


def names(config: Any) -> list[str]:
    """The loggers `config.log_to` names besides TensorBoard, in order."""
    given = [n.strip() for n in str(config.get("log_to") or "").split(",")]
    return [n for n in dict.fromkeys(given) if n in EXTRAS]


def check(config: Any) -> None:
    """A `ConfigError` naming the pip line for a logger whose package is not installed."""
    for name in names(config):
        if importlib.util.find_spec(EXTRAS[name]) is None:
            raise errors.ConfigError(
                f"config.log_to={config.log_to!r}: {name} is not installed: "
                f"pip install 'mptrain[{name}]'"
            )


def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings (a ConfigDict too) as `{"a.b": value}`, for hparams and params, which
    hold bools, numbers and strings only: a numpy scalar as its Python value, any other value
    (None, a tuple) as its `str`."""
    out = {}
    for key, value in tree.items():
        if hasattr(value, "items"):
            out |= flat(value, f"{prefix}{key}.")
        elif isinstance(value, np.generic):
            out[prefix + str(key)] = value.item()
        else:
            ok = isinstance(value, bool | int | float | str)
            out[prefix + str(key)] = value if ok else str(value)
    return out


def report_summary(workdir: Path) -> dict[str, str]:
    """The precision report's matmul FLOPs by operand dtype (`{"precision.matmul_share.
    bfloat16": "100.00%"}`) and its warning count, read from the report file."""
    path = workdir / REPORT
    if not path.exists():
        return {}
    text = path.read_text()
    found = {
        f"precision.matmul_share.{dtype}": share
        for dtype, share in re.findall(r"^  (\w+)\s+[\d,]+\s+([\d.]+%)", text, re.MULTILINE)
    }
    warnings = text.split("\nwarnings:\n", 1)[-1].strip().splitlines()
    found["precision.warnings"] = str(sum(1 for w in warnings if w.strip() != "- none"))
    return found


def _ids(workdir: Path) -> dict[str, str]:
    path = workdir / IDS
    return json.loads(path.read_text()) if path.exists() else {}


def _keep_id(workdir: Path, name: str, run_id: str) -> None:
    files.write_json(workdir / IDS, _ids(workdir) | {name: run_id})


class _Writer:
    """What clu's `MetricWriter` asks, for a logger that keeps scalars, texts and hparams."""

    def __init__(self, workdir: Path):
        self.workdir, self.last = workdir, {}

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        values = {k: float(v) for k, v in scalars.items()}
        self.last |= values
        self._scalars(int(step), values)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        pass  # the log lines: TensorBoard's and the console's

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._params(flat(hparams))

    def write_images(self, step: int, images: Mapping[str, Any]) -> None:
        pass

    def write_histograms(self, step: int, arrays: Mapping[str, Any], num_buckets=None) -> None:
        pass

    def write_summaries(self, step: int, values: Mapping[str, Any], metadata=None) -> None:
        pass

    def write_videos(self, step: int, videos: Mapping[str, Any]) -> None:
        pass

    def write_audios(self, step: int, audios: Mapping[str, Any], *, sample_rate: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Sends the precision report and the final metrics, and ends the run."""
        self._finish(report_summary(self.workdir), self.last)


class WandbWriter(_Writer):
    """A W&B run (offline unless `WANDB_MODE` says otherwise; see the module doc)."""

    def __init__(self, workdir: Path, config: Mapping[str, Any]):
        import wandb

        super().__init__(workdir)
        run_id = _ids(workdir).get("wandb") or uuid.uuid4().hex[:8]
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=workdir.name,
            id=run_id,
            resume="allow",
            dir=str(workdir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=flat(config),
            settings=wandb.Settings(silent=True, console="off"),
        )
        _keep_id(workdir, "wandb", run_id)
        self.step = -1

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        if step >= self.step:  # W&B drops a step older than one it has (`profile`'s marks)
            self.step = step
            self.run.log(values, step=step)

    def _params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def _finish(self, summary: dict[str, str], last: dict[str, float]) -> None:
        self.run.summary.update(summary | last)
        report = self.workdir / REPORT
        if report.exists():  # a copy in the run's folder: W&B links (and warns of) others
            copy = shutil.copy(report, Path(self.run.dir) / REPORT)
            self.run.save(str(copy), base_path=self.run.dir, policy="now")
        self.run.finish()


class MlflowWriter(_Writer):
    """An MLflow run in experiment "mptrain" (see the module doc)."""

    def __init__(self, workdir: Path, config: Mapping[str, Any]):
        from mlflow.tracking import MlflowClient

        super().__init__(workdir)
        self.client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        self.run_id = _ids(workdir).get("mlflow")
        if self.run_id is None:  # a new run; a resumed one has its params
            self.run_id = self.client.create_run(experiment_id, run_name=workdir.name).info.run_id
            self._params(flat(config))
            _keep_id(workdir, "mlflow", self.run_id)

    def _params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        given = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(given), 100):  # MLflow takes 100 params a batch
            self.client.log_batch(self.run_id, params=given[i : i + 100])

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def _finish(self, summary: dict[str, str], last: dict[str, float]) -> None:
        for key, value in summary.items():  # tags: a resumed run may change them
            self.client.set_tag(self.run_id, key, value)
        report = self.workdir / REPORT
        if report.exists():
            self.client.log_artifact(self.run_id, str(report))
        self.client.set_terminated(self.run_id)


def create(config: Any, workdir: str | os.PathLike) -> list[_Writer]:
    """The writers `config.log_to` names besides TensorBoard (`check` first)."""
    from mptrain import config as config_lib

    check(config)
    workdir = Path(workdir)
    settings = config_lib.to_dict(config)
    made = {"wandb": WandbWriter, "mlflow": MlflowWriter}
    return [made[name](workdir, settings) for name in names(config)]
