"""Process plumbing, apart from training logic: starting a run, the workdir lock, preemption.

`run(config, workdir)` is `mptrain.run`: it validates the config, imports the Trainer class that
`config.trainer` names and trains. The trainer holds the lock and the flag for a whole run::

    with runtime.workdir_lock(workdir), runtime.PreemptionFlag() as preemption:
        ...  # set up; then loop, checking `preemption.requested` after each step
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import jax
from absl import logging

from mptrain import errors


def import_trainer(spec: str):
    """The `Trainer` subclass named `"package.module:Class"`; `ConfigError`s name the spec."""
    from mptrain import trainer

    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise errors.ConfigError(
            f"config.trainer={spec!r}: expected 'package.module:Class', e.g. "
            "'mptrain.trainer:Trainer'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise errors.ConfigError(f"config.trainer={spec!r}: cannot import: {e}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, trainer.Trainer)):
        raise errors.ConfigError(
            f"config.trainer={spec!r}: {module_name} has no Trainer subclass {class_name!r}"
        )
    return cls


def run(config, workdir: str | os.PathLike):
    """What `python -m mptrain.main` does, from Python: validate, build the trainer, train.

    Returns the final `TrainState`; raises `errors.ConfigError` for a bad config and the
    `errors.StopTraining` family when a run ends early.
    """
    from mptrain import config as config_lib

    config_lib.validate(config)
    trainer_cls = import_trainer(config.trainer)
    started = time.monotonic()
    state = trainer_cls(config, Path(workdir)).train_and_evaluate()
    logging.info("mptrain: done in %.1f s", time.monotonic() - started)
    return state


@contextlib.contextmanager
def workdir_lock(workdir: Path):
    """Holds an exclusive lock on `<workdir>/.lock` for the run; a second run is refused.

    The lock is an flock, so the kernel drops it when the process dies, even under kill -9. Only
    process 0 of a multi-process job takes it (the others write nothing but checkpoint shards).
    """
    if jax.process_index() != 0:
        yield
        return
    try:
        workdir.mkdir(parents=True, exist_ok=True)
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
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the lock


class PreemptionFlag:
    """Turns SIGTERM into a flag that the loop checks after each step (main thread only).

    Python runs signal handlers only between bytecodes, so a SIGTERM that lands while XLA
    compiles would wait for the compiler. The wakeup fd is written by the C-level handler at
    once; a watcher thread reads it and, while `exit_now_ok` says that nothing is unsaved (the
    start-up: restore and compilation), exits with 75 straight away.
    """

    def __init__(self):
        self.requested = False
        self.exit_now_ok = False
        self._previous = None

    def _handle(self, signum, frame):
        del signum, frame
        self.requested = True

    def _watch(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            if signal.SIGTERM in data:
                self.requested = True
                if self.exit_now_ok:
                    sys.stderr.write(
                        "mptrain: preempted (SIGTERM) while starting up; nothing new to save, "
                        "run the same command again to resume\n"
                    )
                    sys.stderr.flush()
                    os._exit(errors.Preempted.exit_code)
        os.close(read_fd)

    @contextlib.contextmanager
    def starting_up(self):
        """Within this block a SIGTERM ends the process at once: there is nothing to save."""
        self.exit_now_ok = True
        try:
            yield
        finally:
            self.exit_now_ok = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._write_fd, False)
            self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read_fd,), daemon=True).start()
        return self

    def __exit__(self, *exc_info):
        self.exit_now_ok = False
        if self._previous is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write_fd)  # the watcher reads EOF and ends
            signal.signal(signal.SIGTERM, self._previous)
