"""Several processes on localhost, each with its own fake CPU devices, as one job: the same
training as one process, SIGTERM to any one of them stops all at one step, and no array of the
state is ever gathered to a host."""

import glob
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    assert_trees_bytes_equal,
    needs_devices,
    plain_orbax_state,
    start_processes,
    tiny_config,
    wait_for_processes,
)

import mptrain

# The processes of a job compete for the same 2 cores: keep these tests on one xdist worker.
pytestmark = pytest.mark.xdist_group("multihost")
MESH = ("--config.mesh.data=2", "--config.mesh.fsdp=2")
COMMON = (*MESH, "--config.precision=fp32", "--config.optimizer.schedule=constant")


def _two_processes(workdir, *overrides):
    results = wait_for_processes(start_processes(workdir, *COMMON, *overrides))
    return [code for code, _ in results], [err for _, err in results]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Two processes with 2 devices each, mesh data=2 x fsdp=2, 8 steps, with any gather of an
    array to a host made to fail."""
    workdir = tmp_path_factory.mktemp("two_processes")
    trainer = "--config.trainer=multihost_helpers:NoGatherTrainer"
    codes, errs = _two_processes(workdir, trainer)
    assert codes == [0, 0], "\n".join(err[-3000:] for err in errs)
    return workdir


@pytest.mark.slow  # processes: make test keeps meshes and FSDP in this process
@needs_devices(4)
def test_two_processes_train_like_one_process_with_four_devices(two_process_run, tmp_path):
    mptrain.run(tiny_config(precision="fp32", **{"mesh.data": 2, "mesh.fsdp": 2}), tmp_path)
    one, two = plain_orbax_state(tmp_path, 8), plain_orbax_state(two_process_run, 8)
    for key in ("params", "opt_state"):
        for x, y in zip(jax.tree.leaves(one[key]), jax.tree.leaves(two[key]), strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-7)
    # one workdir: process 0 wrote the config and the only event file; each wrote its shards
    assert (two_process_run / "config.json").is_file()
    assert len(glob.glob(str(two_process_run / "events.out.tfevents.*"))) == 1
    shards = sorted(p.name for p in (two_process_run / "checkpoints" / "8" / "state").iterdir())
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(shards)
    # ... and the checkpoint of two processes on a 2x2 mesh resumes in one process, one device
    shutil.copytree(two_process_run, tmp_path / "resumed")
    resumed = mptrain.run(tiny_config(precision="fp32", num_train_steps=9), tmp_path / "resumed")
    assert int(resumed.step) == 9 and len(resumed.params["head"]["kernel"].sharding.device_set) == 1


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes_exactly(
    two_process_run, tmp_path
):
    trainer = "--config.trainer=multihost_helpers:SigtermOnProcess1"  # signals itself at step 3
    codes, errs = _two_processes(tmp_path, trainer)
    assert codes == [75, 75], "\n".join(err[-3000:] for err in errs)
    (step,) = {int(re.search(r"preempted \(SIGTERM\) at step (\d+)", err).group(1)) for err in errs}
    assert step >= 3 and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(step)]
    codes, errs = _two_processes(tmp_path)  # the same commands resume
    assert codes == [0, 0], "\n".join(err[-3000:] for err in errs)
    assert_trees_bytes_equal(plain_orbax_state(two_process_run, 8), plain_orbax_state(tmp_path, 8))


@pytest.mark.slow
def test_a_byte_flipped_in_one_process_shard_is_caught_and_training_falls_back(
    two_process_run, tmp_path
):
    workdir = tmp_path / "run"
    shutil.copytree(two_process_run, workdir)
    files = glob.glob(str(workdir / "checkpoints/8/state/ocdbt.process_1/d/*"))
    target = Path(max(files, key=lambda f: Path(f).stat().st_size))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    codes, errs = _two_processes(workdir)
    assert codes == [0, 0], "\n".join(err[-3000:] for err in errs)
    assert "Skipping checkpoint at step 8" in errs[0]
    assert_trees_bytes_equal(plain_orbax_state(two_process_run, 8), plain_orbax_state(workdir, 8))
