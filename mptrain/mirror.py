"""A run's workdir on object storage (`--workdir=s3://BUCKET/RUN`, `gs://BUCKET/RUN`): the run
writes a local copy, the stage, exactly as it writes any workdir, and a mirror copies it to the
bucket as it goes. On another machine, or after a kill, the run starts from what the bucket
holds.

Why a stage: a bucket has no rename, no append and no lock, and everything a run writes besides
orbax's arrays leans on them (`config.json` and the checkpoints' metadata replaced atomically,
the history appended, the workdir's flock). The stage keeps all of that as it is, the token
cache stays on local disk (`data.cache_dir`), and one rule makes the bucket safe:

- **A checkpoint counts once complete.** The mirror uploads a checkpoint once orbax has renamed
  it into place, its files first and `checkpoints/<step>/commit_success.txt` last (orbax's own
  marker on GCS, so plain orbax lists the same steps). A kill mid-upload leaves no marker: the
  previous checkpoint stays the newest valid one, and the next run deletes the unfinished one.
- **Every other file is replaced whole** (the history, events, report, curves, rollouts): an
  object store writes an object entirely or not at all, so a kill loses the lines written since
  the last pass, never the file. Each pass uploads those files before the checkpoints that were
  complete when it began, so the bucket's history always reaches its newest checkpoint (a
  resumed run drops the lines past it, as on local disk).
- **One writer**, by a lease object (`.mptrain-lease.json`) written with a conditional put
  (absent, or still at the version read) and renewed every `RENEW_S`: a second run is refused,
  naming the holder. A holder killed on this machine (its pid gone, the same boot) is taken
  over at once; on another machine, once its lease is `LAPSE_S` old. A run that finds its lease
  taken stops as if preempted and says so; it uploads nothing more.

At start the bucket is the truth: the stage is made equal to its complete checkpoints and files
(downloading what differs, deleting the rest), unless the stage's own record of the bucket
(`.mptrain-mirror.json`) still matches it object for object, in which case nothing else wrote
there and what the stage holds beyond it (a last checkpoint a failed upload left) is uploaded.

The stage is `$MPTRAIN_CACHE/workdirs/<scheme>/<bucket>/<path>` (else under ~/.cache/mptrain).
A run of several processes needs a shared folder still: each would stage its own shards.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from absl import logging

from mptrain import buckets, errors, files

LEASE = ".mptrain-lease.json"
RECORD = ".mptrain-mirror.json"
MARKER = "commit_success.txt"
EVERY_S = 15.0  # between passes; `MPTRAIN_MIRROR_EVERY_S` sets another
RENEW_S = 20.0
LAPSE_S = 120.0
_STEP = re.compile(r"checkpoints/(\d+)/")
_MARKER = re.compile(rf"checkpoints/\d+/{re.escape(MARKER)}")
_UNSAVED = re.compile(r"checkpoints/\d+\.orbax-checkpoint-tmp")
_LOCAL = {".lock", RECORD}  # the stage's own: never uploaded, never deleted by a pull


def stage_dir(url: str) -> Path:
    """Where the run of `url` is staged (the module doc)."""
    kind, name, prefix = buckets.parse(url)
    return files.cache_dir("workdirs", kind, name, *prefix.split("/"))


def _step(relative: str) -> int | None:
    found = _STEP.match(relative)
    return int(found.group(1)) if found else None


def _is_marker(relative: str) -> bool:
    """Whether `relative` is a checkpoint's marker (orbax's items have files of that name)."""
    return _MARKER.fullmatch(relative) is not None


@contextlib.contextmanager
def staged(url: str) -> Iterator[Path]:
    """The stage of `url` for one run (the module doc): the bucket checked and leased, the
    stage brought up to date; mirrored while the block runs; on leaving, a last pass (after a
    refusal, a `ConfigError` or `WorkdirError` of the run, none) and the lease released."""
    import jax

    if jax.process_count() > 1:
        raise errors.ConfigError(
            f"--workdir={url}: a job of {jax.process_count()} processes needs a workdir they "
            "share (each would stage only its own checkpoint shards); a single process may "
            "write to object storage"
        )
    bucket = buckets.open(url)
    lease = Lease(bucket)
    lease.take()
    try:
        mirror = Mirror(bucket, stage_dir(url), lease)
        mirror.start_up()
        with mirror.running():
            yield mirror.stage
    finally:
        lease.release()


def read_copy(url: str, flag: str = "--workdir") -> Path:
    """A local copy of the run in `url` for a reader (export, generate): the bucket's complete
    checkpoints and files, downloading only what changed since the last copy; nothing in the
    bucket is written, and no lease is taken (a run may be writing it). It is
    `$MPTRAIN_CACHE/reads/<scheme>/<bucket>/<path>`, one reader at a time on a machine."""
    import fcntl

    kind, name, prefix = buckets.parse(url, flag)
    mirror = Mirror(
        buckets.open(url, flag), files.cache_dir("reads", kind, name, *prefix.split("/"))
    )
    mirror.stage.mkdir(parents=True, exist_ok=True)
    with open(mirror.stage / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another reader here: wait for its copy
        mirror.pull(mirror.remote(), mirror.record().get("sent", {}), read_only=True)
    if not mirror.committed:
        raise errors.WorkdirError(f"{flag}={url}: holds no complete checkpoint")
    return mirror.stage


def upload_folder(folder: Path, bucket: buckets.Bucket) -> None:
    """Every file under `folder` to `bucket` (an export's `--out`), by its relative path."""
    started, names = time.monotonic(), sorted(p for p in folder.rglob("*") if p.is_file())
    for path in names:
        bucket.upload(path, path.relative_to(folder).as_posix())
    size = sum(p.stat().st_size for p in names)
    logging.info("Uploaded %s to %s: %d files, %.1f MB in %.1f s", folder, bucket.url,
                 len(names), size / 1e6, time.monotonic() - started)  # fmt: skip


class Lease:
    """The single-writer rule on a bucket (the module doc)."""

    def __init__(self, bucket: buckets.Bucket):
        self.bucket, self.version, self.lost = bucket, None, False
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "boot": _boot_id()}
        self._renewing = threading.Lock()  # the passes and the renewing thread both renew

    def take(self) -> None:
        for _ in range(3):  # a lease that changes under us is read again
            self.holder["renewed"] = time.time()
            found = self.bucket.get(LEASE)  # read first: a store may ignore the conditions
            if found is None:
                if version := self.bucket.put(LEASE, self._body(), if_absent=True):
                    self.version = version
                    return
                continue
            body, version = found
            try:
                other = json.loads(body)
                age = time.time() - float(other["renewed"])
            except (ValueError, KeyError, TypeError):
                other, age = {}, LAPSE_S  # unreadable: nobody's
            if not (age >= LAPSE_S or self._dead_here(other)):
                raise errors.WorkdirError(
                    f"--workdir={self.bucket.url} is in use by another run (pid "
                    f"{other.get('pid')} on {other.get('host')}, its lease renewed {age:.0f} s "
                    f"ago); wait for it to end, or, if it died on another machine, for its lease "
                    f"to lapse ({LAPSE_S:.0f} s unrenewed)"
                )
            if version := self.bucket.put(LEASE, self._body(), if_version=version):
                logging.info("Took over the lease of %s from pid %s on %s (%s)",
                             self.bucket.url, other.get("pid"), other.get("host"),
                             "gone" if age < LAPSE_S else f"{age:.0f} s unrenewed")  # fmt: skip
                self.version = version
                return
        raise errors.WorkdirError(f"--workdir={self.bucket.url}: its lease keeps changing hands")

    def renew(self) -> bool:
        """Renews the lease; False (and `lost`) when another run holds it now."""
        with self._renewing:
            if self.lost:
                return False
            self.holder["renewed"] = time.time()
            version = self.bucket.put(LEASE, self._body(), if_version=self.version)
            self.lost = version is None
            self.version = version or self.version
            return not self.lost

    def release(self) -> None:
        with contextlib.suppress(errors.StorageError):
            found = self.bucket.get(LEASE)
            if not self.lost and found is not None and found[1] == self.version:
                self.bucket.delete(LEASE)

    def _body(self) -> bytes:
        return json.dumps(self.holder).encode()

    def _dead_here(self, other: dict) -> bool:
        """Whether `other` held the lease from a process of this boot of this machine that is
        gone (a pid reused since is taken for alive)."""
        if other.get("host") != self.holder["host"] or other.get("boot") != self.holder["boot"]:
            return False
        try:
            os.kill(int(other["pid"]), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return False


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


class Mirror:
    """Copies the stage to the bucket, a pass at a time (the module doc)."""

    def __init__(self, bucket: buckets.Bucket, stage: Path, lease: Lease | None = None):
        self.bucket, self.stage, self.lease = bucket, stage, lease
        self.sent: dict[str, list] = {}  # relative path -> [size, mtime_ns, version]
        self.committed: set[int] = set()  # checkpoint steps whose marker is in the bucket
        self.markers: dict[str, str] = {}  # their markers' versions, by step
        self.every_s = float(os.environ.get("MPTRAIN_MIRROR_EVERY_S") or EVERY_S)
        self._stop = threading.Event()
        self._failure: Exception | None = None

    # ---- start: the bucket's state into the stage ----------------------------------------

    def start_up(self) -> None:
        self.stage.mkdir(parents=True, exist_ok=True)
        remote, record = self.remote(), self.record()
        ours = {k: v[2] for k, v in record.get("sent", {}).items()}
        ours |= {f"checkpoints/{s}/{MARKER}": v for s, v in record.get("markers", {}).items()}
        if record.get("url") == self.bucket.url and ours == {
            k: o.version for k, o in remote.items()
        }:
            self.sent, self.markers = record["sent"], dict(record["markers"])
            self.committed = {int(s) for s in self.markers}
            return  # nothing else wrote there: the stage continues it
        self.pull(remote, record.get("sent", {}))

    def remote(self) -> dict[str, buckets.Object]:
        """The bucket's objects, but the lease."""
        return {k: o for k, o in self.bucket.list().items() if k != LEASE}

    def pull(
        self, remote: dict[str, buckets.Object], had: dict[str, list], read_only: bool = False
    ) -> None:
        """Makes the stage the bucket's complete checkpoints and files (`had`: what the stage's
        record says it held); unless `read_only`, deletes the objects of unfinished uploads."""
        self.committed = {_step(k) for k in remote if _is_marker(k)}
        self.markers = {str(_step(k)): remote[k].version for k in remote if _is_marker(k)}
        wanted = {
            k: o for k, o in remote.items()
            if not _is_marker(k) and (_step(k) is None or _step(k) in self.committed)
        }  # fmt: skip
        unfinished = [k for k in remote if _step(k) is not None and _step(k) not in self.committed]
        kept = {}
        for relative in self._local_files():
            entry = had.get(relative)  # [size, mtime_ns, version] when it was last synced
            obj = wanted.get(relative)
            if (
                obj
                and entry
                and entry[2] == obj.version
                and entry[:2] == _stat(self.stage, relative)
            ):
                kept[relative] = entry
            else:
                (self.stage / relative).unlink()
        for folder in sorted(self.stage.rglob("*"), reverse=True):  # emptied, or unfinished saves
            if folder.is_dir() and (not any(folder.iterdir()) or _UNSAVED.match(
                    folder.relative_to(self.stage).as_posix() + "/")):  # fmt: skip
                shutil.rmtree(folder, ignore_errors=True)
        fetch = {k: o for k, o in wanted.items() if k not in kept}
        started, size = time.monotonic(), sum(o.size for o in fetch.values())
        for relative, obj in sorted(fetch.items()):
            path = self.stage / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            self.bucket.download(relative, path)
            kept[relative] = [*_stat(self.stage, relative), obj.version]
        if fetch:
            logging.info("Read %s: %d files, %.1f MB in %.1f s (checkpoints %s)",
                         self.bucket.url, len(fetch), size / 1e6, time.monotonic() - started,
                         sorted(self.committed) or "none")  # fmt: skip
        self.sent = kept
        for relative in (
            [] if read_only else unfinished
        ):  # an upload a kill cut short: never a checkpoint
            self.bucket.delete(relative)
        if unfinished and not read_only:
            logging.warning("Deleted %d objects of unfinished checkpoint uploads in %s",
                            len(unfinished), self.bucket.url)  # fmt: skip
        self._write_record()

    # ---- passes: the stage into the bucket -----------------------------------------------

    def sync(self) -> None:
        """One pass: changed files, then new complete checkpoints (files, then their marker),
        then what the stage no longer holds."""
        self._hold()
        steps = self._complete_steps()  # first: the files read after are newer than these
        local = self._local_files()
        for relative in sorted(r for r in local if _step(r) is None):
            self._send(relative)
        for step in sorted(steps & self.committed):  # saved again since (a replaced step)
            if self._changed(f"checkpoints/{step}/", local):
                self._uncommit(step)
        for step in sorted(steps - self.committed, reverse=True):  # the newest first: the
            self._send_checkpoint(step, local)  # others may be pruned before their turn
        for step in sorted(self.committed - steps):  # pruned (max_to_keep)
            self._uncommit(step)
        for relative in sorted(set(self.sent) - set(self._local_files())):
            self.bucket.delete(relative)
            del self.sent[relative]
        self._write_record()

    def _changed(self, prefix: str, local: list[str]) -> bool:
        names = {r for r in local if r.startswith(prefix)}
        sent = {r for r in self.sent if r.startswith(prefix)}
        return names != sent or any(self.sent[r][:2] != _stat(self.stage, r) for r in names)

    def _uncommit(self, step: int) -> None:
        """The marker first: a checkpoint half deleted is never complete."""
        self.bucket.delete(f"checkpoints/{step}/{MARKER}")
        self.committed.discard(step)
        self.markers.pop(str(step), None)
        self._write_record()

    def _send(self, relative: str) -> bool:
        stat = _stat(self.stage, relative)
        if stat is None or (relative in self.sent and self.sent[relative][:2] == stat):
            return False
        version = self.bucket.upload(self.stage / relative, relative)
        self.sent[relative] = [*stat, version]
        return True

    def _send_checkpoint(self, step: int, local: list[str]) -> None:
        started, prefix = time.monotonic(), f"checkpoints/{step}/"
        names = [r for r in local if r.startswith(prefix)]
        sent = [r for r in names if self._send(r)]
        if not (self.stage / prefix).is_dir():  # pruned while it went up: never marked
            return
        listing = {r: self.sent[r][0] for r in names if r in self.sent}
        self._write_record()
        self._hold()
        marker = self.bucket.put(f"{prefix}{MARKER}", json.dumps(listing).encode())
        self.committed.add(step)
        self.markers[str(step)] = marker
        self._write_record()
        size = sum(self.sent[r][0] for r in sent)
        logging.info("Checkpoint %d uploaded to %s: %d files, %.1f MB in %.2f s",
                     step, self.bucket.url, len(sent), size / 1e6,
                     time.monotonic() - started)  # fmt: skip

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Passes every `every_s` in the background, the lease renewed as often (at least every
        `RENEW_S`), while the block runs; then the last pass, unless the run was refused."""
        threads = [(self.every_s, self._pass)]
        threads += [(min(RENEW_S, self.every_s), self._renew)] if self.lease else []
        threads = [threading.Thread(target=self._loop, args=t, daemon=True) for t in threads]
        for thread in threads:
            thread.start()
        refused = True
        try:
            yield
            refused = False
        except (errors.ConfigError, errors.WorkdirError):
            raise
        except BaseException:
            refused = False
            raise
        finally:
            self._stop.set()
            for thread in threads:
                thread.join()
            self._finish(refused)

    def _hold(self) -> None:
        """Renews the lease, before a pass and before each marker: a run that lost it writes
        nothing more (a `WorkdirError` saying so)."""
        if self.lease is not None and not self.lease.renew():
            raise errors.WorkdirError(
                f"--workdir={self.bucket.url}: another run took its lease; this run's files "
                f"since its last upload are in {self.stage} only"
            )

    def _finish(self, refused: bool) -> None:
        if refused and not (self.lease and self.lease.lost):
            return
        try:
            self.sync()
        except errors.StorageError as e:
            raise errors.StorageError(
                f"{e}; the run's last files are in {self.stage}: run the same command again "
                "on this machine to upload them"
            ) from e

    def _loop(self, every_s: float, work) -> None:
        while not self._stop.wait(every_s):
            work()

    def _pass(self) -> None:
        try:
            self.sync()
        except errors.WorkdirError:
            self._lost()
        except Exception as e:  # the network, say: the next pass tries again
            if type(e) is not type(self._failure):
                logging.warning("Could not upload to %s (trying again): %s", self.bucket.url, e)
            self._failure = e
        else:
            self._failure = None

    def _renew(self) -> None:
        try:
            renewed = self.lease.renew()
        except errors.StorageError as e:
            logging.warning("Could not renew the lease of %s: %s", self.bucket.url, e)
            return
        if not renewed:
            self._lost()

    def _lost(self) -> None:
        """Stops the run as a preemption would (its checkpoint stays in the stage)."""
        logging.error("Another run took the lease of %s: stopping", self.bucket.url)
        self._stop.set()
        os.kill(os.getpid(), signal.SIGTERM)

    # ---- the stage's files ---------------------------------------------------------------

    def _local_files(self) -> list[str]:
        found = []
        for folder, dirs, names in os.walk(self.stage):
            rel = Path(folder).relative_to(self.stage).as_posix()
            dirs[:] = [d for d in dirs if not _UNSAVED.match(f"{rel}/{d}/".lstrip("./"))]
            for name in names:
                relative = f"{rel}/{name}".removeprefix("./")
                # orbax writes a marker of that name into each step's folder too, before the
                # rename: the bucket's is the mirror's, written last
                if not (relative in _LOCAL or files.is_temporary(name) or _is_marker(relative)):
                    found.append(relative)
        return sorted(found)

    def _complete_steps(self) -> set[int]:
        folder = self.stage / "checkpoints"
        names = os.listdir(folder) if folder.is_dir() else []
        return {int(n) for n in names if n.isdigit() and (folder / n).is_dir()}

    def record(self) -> dict:
        """The stage's record of the bucket (`RECORD`), {} where there is none."""
        try:
            return json.loads((self.stage / RECORD).read_text())
        except (OSError, ValueError):
            return {}

    def _write_record(self) -> None:
        record = {"url": self.bucket.url, "sent": self.sent, "markers": self.markers}
        files.write_json(self.stage / RECORD, record)


def _stat(stage: Path, relative: str) -> list[int] | None:
    try:
        found = (stage / relative).stat()
    except FileNotFoundError:
        return None
    return [found.st_size, found.st_mtime_ns]
