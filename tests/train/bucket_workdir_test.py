"""A workdir in a bucket (`--workdir=s3://...`, `gs://...`; `mptrain.mirror`), against real
servers on localhost (`servers`: moto's S3 server, gcp-storage-emulator), started by these tests
alone. What the bucket holds is read back with the store's own client, not mptrain's.

- The same run in a bucket and on local disk: the same history, the same arrays.
- Killed with -9 while a checkpoint goes up, and run again from another machine's empty stage:
  the uninterrupted run's history and arrays; the unfinished upload never counts.
- One writer: a second run is refused by the lease; a holder killed here is taken over.
- A bucket that does not exist, refused credentials, an unreachable endpoint, another scheme:
  one line, exit 2, nothing written.
"""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest
import servers
from helpers import (
    ROOT,
    TINY,
    assert_trees_bytes_equal,
    fake_cpu_env,
    history_without_timings,
    plain_orbax_state,
    run_cli,
)

from mptrain import buckets, errors, export, mirror
from mptrain.data import tokenize


@pytest.fixture(scope="module")
def s3():
    with servers.s3() as env:
        yield env


@pytest.fixture(scope="module")
def gcs():
    with servers.gcs() as env:
        yield env


def _bucket(env: dict, monkeypatch, tmp_path) -> str:
    """A new bucket on the server of `env`, which this test's process then uses, with a stage
    of its own; returns its name."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPTRAIN_MIRROR_EVERY_S", "0.2")
    name = f"runs-{secrets.token_hex(4)}"
    servers.make_bucket(env, name)
    return name


def _committed(objects: dict) -> list[int]:
    return sorted(int(k.split("/")[1]) for k in objects if re.fullmatch(
        rf"checkpoints/\d+/{mirror.MARKER}", k))  # fmt: skip


def _same_run_in_a_bucket(env, scheme, monkeypatch, tmp_path, capsys):
    local = tmp_path / "local"
    assert run_cli(local, capsys=capsys)[0] == 0
    url = f"{scheme}://{_bucket(env, monkeypatch, tmp_path)}/runs/tiny"
    code, err = run_cli(url, capsys=capsys)
    assert code == 0, err[-3000:]
    objects = servers.objects(env, url)
    assert _committed(objects) == [4, 8] and mirror.LEASE not in objects  # released at the end
    copy = servers.download(env, url, tmp_path / "copy")
    assert history_without_timings(copy) == history_without_timings(local)
    assert_trees_bytes_equal(plain_orbax_state(copy, 8), plain_orbax_state(local, 8))
    files = lambda names: {re.sub(r"tfevents\..*", "tfevents", k) for k in names
                           if not k.startswith("checkpoints/") and k != ".lock"}  # fmt: skip
    # config.json, the history, the report, the curves, the events: everything
    assert files(p.relative_to(local).as_posix() for p in local.glob("*.*")) == files(objects)
    # an export reads the bucket (a local copy) and writes to one: the local run's export
    exported = f"{url.rsplit('/', 2)[0]}/exports/tiny"
    assert export.main([f"--workdir={url}", f"--out={exported}"]) == 0
    assert export.main([f"--workdir={local}", f"--out={tmp_path / 'export'}"]) == 0
    sidecar = lambda folder: json.loads((folder / "export.json").read_text())
    theirs = sidecar(servers.download(env, exported, tmp_path / "exported"))
    assert theirs["params_fingerprint"] == sidecar(tmp_path / "export")["params_fingerprint"]
    assert export.main([f"--workdir={url}", f"--out={exported}"]) == 2  # not over an export


def test_a_run_in_an_s3_bucket_is_the_same_run_as_on_local_disk(s3, monkeypatch, tmp_path, capsys):
    _same_run_in_a_bucket(s3, "s3", monkeypatch, tmp_path, capsys)


@pytest.mark.slow
def test_a_run_in_a_gcs_bucket_is_the_same_run_as_on_local_disk(gcs, monkeypatch, tmp_path, capsys):
    _same_run_in_a_bucket(gcs, "gs", monkeypatch, tmp_path, capsys)


# ----------------------------------------------------------------- kill -9 during an upload

LONG = [  # long enough to be killed in: about 5 s of steps, a checkpoint every 100
    "--config.num_train_steps=2000",
    "--config.checkpoint_every_steps=100",
    "--config.log_every_steps=50",
    "--config.eval_every_steps=1000",
    "--config.optimizer.schedule=constant",
    "--config.optimizer.warmup_steps=0",
]


def _uploading(objects: dict) -> int | None:
    """A checkpoint step some of whose objects are in the bucket and not its marker."""
    if mirror.LEASE not in objects:
        return None  # the run has not begun, or has ended
    steps = {int(m.group(1)) for k in objects if (m := re.match(r"checkpoints/(\d+)/", k))}
    committed = _committed(objects)  # (an older one being deleted has no marker either)
    unfinished = {s for s in steps if s > max(committed, default=-1)}
    return min(unfinished) if unfinished else None


KILLS = 2  # two kills mid-upload, each on a machine of its own, then the run that ends it


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_kill_9_during_an_upload_then_a_run_elsewhere_is_the_uninterrupted_run(
    scheme, request, monkeypatch, tmp_path
):
    """Killed `KILLS` times as soon as a checkpoint's objects start to appear, each run on a
    machine of its own (an empty stage): the last one ends as the uninterrupted run."""
    env = request.getfixturevalue({"s3": "s3", "gs": "gcs"}[scheme])
    url = f"{scheme}://{_bucket(env, monkeypatch, tmp_path)}/run"
    command = lambda workdir: [sys.executable, "-m", "mptrain.main", TINY, f"--workdir={workdir}",
                               *LONG]  # fmt: skip
    run_env = lambda cache: {**fake_cpu_env(1), **env, "MPTRAIN_CACHE": str(tmp_path / cache),
                             "MPTRAIN_MIRROR_EVERY_S": "0.05"}  # fmt: skip
    straight = tmp_path / "straight"
    done = subprocess.run(command(straight), cwd=ROOT, env=run_env("x"), capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]

    cut, kills, dead_holder = [], 0, False  # the steps whose upload a kill cut short, ...
    for machine in range(KILLS):
        proc = subprocess.Popen(command(url), cwd=ROOT, env=run_env(f"machine{machine}"),
                                stderr=subprocess.DEVNULL)  # fmt: skip
        deadline, before = time.monotonic() + 120, _committed(servers.objects(env, url, False))
        # each run moves on: a checkpoint of its own up, then the kill in the next one's upload
        while proc.poll() is None:
            objects = servers.objects(env, url, read=False)  # one listing a look: quick
            step = _uploading(objects)
            if step is not None and set(_committed(objects)) - set(before):
                break
            assert time.monotonic() < deadline
        if proc.poll() is not None:  # it outran the looks to its end: no more kills
            assert proc.returncode == 0
            dead_holder = False
            break
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        kills, dead_holder = kills + 1, True
        left = servers.objects(env, url, read=False)
        assert mirror.LEASE in left  # still held by the dead run
        cut += [step] if step not in _committed(left) else []
    assert cut, "no kill landed before a marker: the uploads outran the looks"

    again = subprocess.run(command(url), cwd=ROOT, env=run_env("last"), capture_output=True,
                           text=True)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    # on a failure, what the run read and took over (its head), and how the kills went
    said = [line for line in again.stderr.splitlines() if "mirror.py" in line][:6]
    why = "\n".join([*said, f"cut {cut}, kills {kills}, dead holder {dead_holder}"])
    assert re.search(r"resuming from step (\d+)", again.stderr), why
    assert ("Took over the lease" in again.stderr) == dead_holder
    copy = servers.download(env, url, tmp_path / "copy")
    assert history_without_timings(copy) == history_without_timings(straight)
    assert_trees_bytes_equal(plain_orbax_state(copy, 2000), plain_orbax_state(straight, 2000))
    print(f"{scheme}: {kills} runs killed, {len(cut)} of them mid-upload (steps {cut})")


# ------------------------------------------------------------------------------ one writer


def test_a_second_run_is_refused_by_the_lease_and_a_dead_holder_here_taken_over(
    s3, monkeypatch, tmp_path
):
    url = f"s3://{_bucket(s3, monkeypatch, tmp_path)}/run"
    bucket = buckets.open(url)
    holder = mirror.Lease(bucket)
    holder.take()
    with pytest.raises(errors.WorkdirError, match=rf"in use by another run \(pid {os.getpid()}"):
        mirror.Lease(bucket).take()
    # a holder on another machine, renewed long ago: its lease has lapsed
    away = dict(holder.holder, host="elsewhere", renewed=time.time() - mirror.LAPSE_S - 1)
    bucket.put(mirror.LEASE, json.dumps(away).encode())
    assert not holder.renew() and holder.lost  # the first holder finds it taken
    taker = mirror.Lease(bucket)
    taker.take()
    # a holder here whose process is gone is taken over at once
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)  # fmt: skip
    gone = dict(taker.holder, pid=int(dead.stdout), renewed=time.time())
    bucket.put(mirror.LEASE, json.dumps(gone).encode())
    mirror.Lease(bucket).take()
    on_another_machine = dict(gone, host="elsewhere")
    bucket.put(mirror.LEASE, json.dumps(on_another_machine).encode())
    with pytest.raises(errors.WorkdirError, match="on elsewhere, its lease renewed 0 s ago"):
        mirror.Lease(bucket).take()


def test_a_checkpoint_counts_only_once_its_marker_is_written_last(s3, monkeypatch, tmp_path):
    """An upload cut short (here: the third object fails) leaves no marker: a stage made from
    the bucket has the older checkpoint only, and the unfinished objects are deleted."""
    url = f"s3://{_bucket(s3, monkeypatch, tmp_path)}/run"
    bucket, stage = buckets.open(url), tmp_path / "stage"
    for step in (1, 2):
        for name in ("state/a", "state/b", "meta/metadata"):
            (stage / f"checkpoints/{step}/{name}").parent.mkdir(parents=True, exist_ok=True)
            (stage / f"checkpoints/{step}/{name}").write_text(f"{step} {name}")
    (stage / "history.jsonl").write_text('{"step": 2}\n')
    one = mirror.Mirror(bucket, stage)
    (stage / "checkpoints/2").rename(tmp_path / "2")  # not saved yet
    one.sync()
    (tmp_path / "2").rename(stage / "checkpoints/2")
    upload, calls = bucket.upload, []

    def failing(path, relative):
        calls.append(relative)
        if len(calls) == 3:
            raise errors.StorageError("the network went away")
        return upload(path, relative)

    bucket.upload = failing
    with pytest.raises(errors.StorageError):
        one.sync()
    assert _committed(servers.objects(s3, url)) == [1]
    elsewhere = mirror.Mirror(buckets.open(url), tmp_path / "elsewhere")
    elsewhere.start_up()
    found = sorted(p.relative_to(elsewhere.stage).as_posix()
                   for p in elsewhere.stage.rglob("*") if p.is_file())  # fmt: skip
    assert found == [mirror.RECORD, "checkpoints/1/meta/metadata", "checkpoints/1/state/a",
                     "checkpoints/1/state/b", "history.jsonl"]  # fmt: skip
    assert not [k for k in servers.objects(s3, url) if k.startswith("checkpoints/2/")]


# ------------------------------------------------------------------------------ bad input


def _refused(url, capsys, monkeypatch, tmp_path, says):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    started = time.monotonic()
    code, err = run_cli(url, capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--workdir={url}" in err and says in err, err
    assert list(tmp_path.iterdir()) == []  # no stage, no folder named after the scheme
    assert time.monotonic() - started < 60


def test_a_bucket_that_is_not_there_is_one_line(s3, gcs, monkeypatch, tmp_path, capsys):
    for env, url in ((s3, "s3://no-such-bucket/run"), (gcs, "gs://no-such-bucket/run")):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        _refused(url, capsys, monkeypatch, tmp_path, "no bucket 'no-such-bucket'")


def test_refused_credentials_are_one_line_and_nothing_is_written(monkeypatch, tmp_path, capsys):
    with servers.s3(check_keys=True) as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        _refused("s3://runs/run", capsys, monkeypatch, tmp_path, "the credentials were refused")
    # GCS, no emulator: a key file that is no key is refused before anything is sent
    key = tmp_path.parent / f"{tmp_path.name}-key.json"
    key.write_text('{"type": "service_account", "client_email": "run@example.com"}')
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    says = f"no Google credentials (Failed to load service account credentials from {key})"
    _refused("gs://runs/run", capsys, monkeypatch, tmp_path, says)


@pytest.mark.parametrize(
    "scheme",  # GCS's client retries for 15 s first (S3's: under 1 s)
    ["s3", pytest.param("gs", marks=pytest.mark.slow)],
)
def test_an_unreachable_endpoint_is_one_line(scheme, monkeypatch, tmp_path, capsys):
    for key, value in servers.AWS.items():
        monkeypatch.setenv(key, value)
    nobody = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", nobody)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", nobody)
    says = f"cannot reach the endpoint {nobody}"
    _refused(f"{scheme}://runs/run", capsys, monkeypatch, tmp_path, says)


def test_the_token_cache_stays_on_local_disk():
    with pytest.raises(ValueError, match="data.cache_dir='s3://b/tokens': token caches stay on"):
        tokenize.create_corpus(("a.txt",), "bytes", None, "s3://b/tokens")


@pytest.mark.slow
def test_a_run_whose_lease_is_taken_stops_and_uploads_nothing_more(s3, monkeypatch, tmp_path):
    url = f"s3://{_bucket(s3, monkeypatch, tmp_path)}/run"
    env = {**fake_cpu_env(1), **s3, "MPTRAIN_CACHE": str(tmp_path / "cache"),
           "MPTRAIN_MIRROR_EVERY_S": "0.05"}  # fmt: skip
    command = [sys.executable, "-m", "mptrain.main", TINY, f"--workdir={url}", *LONG]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _committed(servers.objects(s3, url, read=False)):
        assert proc.poll() is None and time.monotonic() < deadline
    other = {"host": "elsewhere", "pid": 1, "boot": "", "renewed": time.time()}
    buckets.open(url).put(mirror.LEASE, json.dumps(other).encode())
    taken = _committed(servers.objects(s3, url, read=False))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"mptrain: error: --workdir={url}: another run")
    after = servers.objects(s3, url)
    assert json.loads(after[mirror.LEASE]) == other  # not released: it is the other run's
    # each marker is written just after the lease is renewed: none after it was taken
    assert set(_committed(after)) <= set(taken)
