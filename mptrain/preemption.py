"""SIGTERM and SIGINT (Ctrl-C): stops that lose nothing.

The command line calls `catch_stop_signals()` before anything else, so that either signal during
imports, validation, the dataset build and compilation ends it with exit 75 and one line. The
trainer's loop holds a `PreemptionFlag` (re-exported by `runtime`): from then on the first
signal checkpoints the steps done and exits 75, a second Ctrl-C exits at once with 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from mptrain import errors

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A second Ctrl-C ends the process at once with the shell's code for death by SIGINT, 128 + 2:
# 75 would tell a wrapper script that a checkpoint of the progress was written, and it was not.
EXIT_INTERRUPTED = 128 + signal.SIGINT

_catcher: _Catcher | None = None  # the process's handlers, while installed


def catch_stop_signals() -> None:
    """A command line's first call: SIGTERM and SIGINT (Ctrl-C) are stops from here on, and
    until a `PreemptionFlag` takes over (the trainer's loop) either one ends the process at
    once with 75 and one line, as nothing is unsaved yet: no traceback, no death by the signal,
    no crash of a compile in flight. The handlers stay for the life of the process, so a
    library must not call this (a `PreemptionFlag` installs its own for its block)."""
    global _catcher
    if _catcher is None and threading.current_thread() is threading.main_thread():
        _catcher = _Catcher(STOP_SIGNALS, exit_now_ok=True)


def end_with_on_stop_signals(code: int) -> None:
    """The command line's last call when it is the process's own (`python -m mptrain.main`):
    the work is done and `code` is the exit on its way, so a stop signal during the
    interpreter's teardown (JAX's exit hooks can take a while) ends the process at once with
    `code`, not with a KeyboardInterrupt traceback."""
    if _catcher is not None:
        _catcher.done_code = code


def release_stop_signals() -> None:
    """Undoes `catch_stop_signals` (the command line's last call, so that `main()` called
    in-process, by a test say, leaves the process's handlers as it found them)."""
    global _catcher
    if _catcher is not None and threading.current_thread() is threading.main_thread():
        _catcher.close()
        _catcher = None


def _exit_now(code: int, message: str | None) -> None:
    """Writes `mptrain: message` (if any) to stderr and ends the process at once, from any
    thread. No exception unwinds and no shutdown tears down XLA's busy threads (a
    KeyboardInterrupt during a compile used to end in a segfault)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if message is not None:
        with contextlib.suppress(OSError):
            os.write(2, f"mptrain: {message}\n".encode())
    os._exit(code)


class _Catcher:
    """Python handlers for `signals`, and a thread that watches for them.

    Python runs a handler in the main thread, between bytecodes: a signal that lands while XLA
    compiles, or while the main thread waits in C, waits with it. So the handler only notes the
    first stop signal's name (`first`), which the loop reads before its next step; a save under
    way finishes first, since nothing is raised into it. Python's C-level handler also writes
    each signal's number to a wakeup fd at once; the watcher thread reads it there and acts
    where waiting would be wrong:

    - once `done_code` is set (the command line has finished), it ends it with that code;
    - while `exit_now_ok` (starting up, nothing to save), it ends the process with 75;
    - at a SIGINT after the first stop signal (a second Ctrl-C), it ends it with 130;
    - with `forward` (several processes, see `PreemptionFlag`), it passes a first SIGINT on to
      this process as SIGTERM, the signal JAX's preemption notifier listens for.
    """

    def __init__(self, signals: tuple[int, ...], exit_now_ok: bool):
        self.first: str | None = None
        self.exit_now_ok = exit_now_ok
        self.forward = False
        self.done_code: int | None = None  # see `end_with_on_stop_signals`
        # The watcher first, the handlers last: a signal that lands between two handlers'
        # installs still reaches the watcher through the wakeup fd.
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(
            target=self._watch, args=(read_fd,), name="mptrain-signals", daemon=True
        ).start()
        self._previous = {signum: signal.signal(signum, self._handle) for signum in signals}

    def _handle(self, signum, frame) -> None:
        del frame
        if self.first is None:
            self.first = signal.Signals(signum).name

    def _watch(self, read_fd: int) -> None:
        stopping = False
        while data := os.read(read_fd, 64):
            for signum in (s for s in data if s in STOP_SIGNALS):
                name = signal.Signals(signum).name
                if self.done_code is not None:
                    _exit_now(self.done_code, None)
                if self.exit_now_ok and not self.forward:
                    _exit_now(
                        errors.Preempted.exit_code,
                        f"preempted ({name}) while starting up; nothing new to save, run the "
                        "same command again to resume",
                    )
                if stopping and signum == signal.SIGINT:
                    _exit_now(
                        EXIT_INTERRUPTED,
                        "SIGINT again: stopped at once, without waiting for the checkpoint; "
                        "the same command resumes from the newest complete one",
                    )
                if self.forward and not stopping and signum == signal.SIGINT:
                    os.kill(os.getpid(), signal.SIGTERM)
                stopping = True
        os.close(read_fd)

    def close(self) -> None:
        """Puts back the handlers and the wakeup fd found at install; the watcher ends."""
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write_fd)  # the watcher reads EOF and ends
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


_fork = threading.local()  # the signal mask of a thread that is forking


def _before_fork() -> None:
    # Blocked across the fork, so that the child runs no handler of ours before it has none.
    if _catcher is not None:
        _fork.mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _after_fork_in_parent() -> None:
    if getattr(_fork, "mask", None) is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _fork.mask)
        _fork.mask = None


def _after_fork_in_child() -> None:
    """A forked child (a data loader's worker, say) gets Python's own handling back: its signals
    must not reach the parent's watcher through the wakeup fd it inherited, where one Ctrl-C to
    both would count twice."""
    global _catcher
    if _catcher is not None:
        with contextlib.suppress(ValueError, OSError):
            _catcher.close()
        _catcher = None
    _after_fork_in_parent()  # signals that came meanwhile now meet Python's handlers


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)


class PreemptionFlag:
    """Turns SIGTERM and SIGINT (Ctrl-C) into a stop that every process takes at the same step.

    One process: the first of either signal sets `requested`; the loop checkpoints the steps
    done and exits 75. A second SIGINT exits at once with 130 (see `_Catcher`); more SIGTERMs
    change nothing. Within `starting_up()` either signal exits 75 at once: nothing is unsaved.

    Several processes: the signal may reach any one of them, and all must checkpoint the same
    step. JAX's coordination service owns SIGTERM there (its preemption notifier, started by
    `jax.distributed.initialize`): it passes the notice to every process and agrees on the
    first step that all of them can still reach. `reached(step)` asks it; until a notice
    arrives that is a local check, not a round trip to the coordinator. A first SIGINT is
    passed on to JAX as this process's SIGTERM, so Ctrl-C on one process stops them all at one
    step, checkpointed, with 75; a second exits that process at once with 130. Within
    `starting_up()` a SIGINT there is a notice too (the others cannot be told to exit).

    Where `catch_stop_signals` installed the process's handlers (the command line) the flag
    uses them; elsewhere it installs its own for its block, from the main thread only.
    """

    def __init__(self):
        self._catcher: _Catcher | None = None
        self._owned = False
        self._several = False

    @property
    def requested(self) -> bool:
        """Whether a stop signal reached this process."""
        return self._catcher is not None and self._catcher.first is not None

    @property
    def signal_name(self) -> str:
        """The first stop signal here, "SIGTERM" or "SIGINT"; "SIGTERM" when none arrived here
        (another process's notice)."""
        return (self._catcher and self._catcher.first) or "SIGTERM"

    def reached(self, step: int) -> bool:
        """Call before every step, with the number of steps done: True when the run must stop
        (checkpoint `step` and exit 75) on this process, and then on all of them."""
        if self._several:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    @contextlib.contextmanager
    def starting_up(self):
        """Within this block a stop signal ends the process at once: there is nothing to save."""
        if self._catcher is not None:
            self._catcher.exit_now_ok = True
        try:
            yield
        finally:
            if self._catcher is not None:
                self._catcher.exit_now_ok = False

    def __enter__(self):
        import jax

        global _catcher
        self._several = jax.process_count() > 1
        if _catcher is None and threading.current_thread() is threading.main_thread():
            # With several processes SIGTERM stays JAX's: only SIGINT is caught here.
            _catcher = _Catcher((signal.SIGINT,) if self._several else STOP_SIGNALS, False)
            self._owned = True
        self._catcher = _catcher
        if _catcher is not None:
            _catcher.exit_now_ok = False
            _catcher.forward = _catcher.forward or self._several
        return self

    def __exit__(self, *exc_info):
        global _catcher
        if self._catcher is not None:
            self._catcher.exit_now_ok = False
        if self._owned:
            self._catcher.close()
            _catcher, self._owned = None, False


def stop_requested() -> str | None:
    """The stop signal this process caught ("SIGTERM" or "SIGINT") while a `PreemptionFlag`
    or the command line's handlers hold them, else None. With several processes, None: they
    must stop at one step they agree on, which only the train loop's `reached` can ask."""
    import jax

    if _catcher is None or jax.process_count() > 1:
        return None
    return _catcher.first


def forward_sigint() -> None:
    """Several processes: JAX's preemption notifier owns SIGTERM from `jax.distributed`'s start;
    a first SIGINT is passed on to it as SIGTERM (see `_Catcher`)."""
    if _catcher is not None:
        _catcher.forward = True
