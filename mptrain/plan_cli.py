"""The command line of `python -m mptrain.plan` (see `mptrain.plan`), and of its `--fit`.

It ends as the trainer's does: one line and the right exit code, never a traceback. 0 it
fits (with `--fit`: a candidate fits); 4 it does not (the verdict first, then the plan; with
`--fit`, the closest candidate and what it would need); 2 bad usage, config or target, found
before anything compiles (a device count below 1, a target's chip count that is not a whole
number, `--devices` that disagrees with the target's count, a `--json` path that is empty, a
folder, under a file or in a folder this user cannot write); 1 the JSON could not be written
after all; 130 Ctrl-C, at once, even inside XLA's compile.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from mptrain import errors, plan

EXIT_INTERRUPTED = 130


def _usage(flag_values) -> str:
    names = ", ".join(sorted(plan.TARGETS))
    return (
        "usage: python -m mptrain.plan --config=FILE[:ARG] --target=NAME [--devices=N] "
        "[--fit] [--json=PATH] [--config.KEY=VALUE ...]\n\n"
        "Compiles the run's train step for an accelerator that need not be here and reports "
        "its memory, dtypes, hazards and roofline floor; --fit searches the memory knobs for "
        "the fastest configuration that fits. Exit codes: 0 it fits, 4 it does not, 2 bad "
        f"usage, config or target, 130 Ctrl-C.\n\ntargets: {names} (a TPU name may carry its "
        "chip count, e.g. v5e-8)\n\nflags:\n"
        + "\n".join(
            f"  --{n}: {flag_values[n].help}"
            for n in ("config", "target", "devices", "fit", "json")
        )
        + "\n"
    )


def _stop_at_once_on_ctrl_c() -> None:
    """Ctrl-C ends the process with one line and 130, also while XLA compiles (a Python
    handler would wait for the compile to return): the C-level handler writes to a wakeup
    pipe that a thread watches."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    stderr = os.dup(2)  # the terminal's, whatever fd 2 is while XLA compiles (plan_memory)
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.set_wakeup_fd(write)

    def watch() -> None:
        while os.read(read, 1) != bytes([signal.SIGINT]):
            pass
        os.write(stderr, b"mptrain: error: interrupted (Ctrl-C); nothing was written\n")
        os._exit(EXIT_INTERRUPTED)

    threading.Thread(target=watch, daemon=True, name="ctrl-c").start()


def check_json_path(path: str | None) -> None:
    """A `ConfigError` for a `--json` path no file can be written at, before anything
    compiles: empty, a folder, under a file, or in a folder this user cannot write to."""
    if path is None:
        return
    if not path.strip():
        raise errors.ConfigError("--json= is empty: give the path of a file to write")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise errors.ConfigError(f"--json={path}: a folder; give the path of a file in it")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):  # the folders write_json would create
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise errors.ConfigError(f"--json={path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise errors.ConfigError(f"--json={path}: cannot write in {parent}")


def _write_json(path: str, data) -> None:
    from mptrain import files

    try:
        files.write_json(path, data)
    except (OSError, errors.StorageError) as e:
        sys.stderr.write(f"mptrain: error: --json={path}: {errors.first_line(e)}\n")
        sys.exit(errors.StorageError.exit_code)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc); returns the exit code."""
    if argv is None:
        _stop_at_once_on_ctrl_c()
    from mptrain import target as target_lib

    target_lib.compile_only()  # no backend looks for a driver: this process only compiles
    from absl import flags, logging

    from mptrain import main as main_lib

    argv = list(sys.argv if argv is None else argv)

    def define(fv) -> None:
        flags.DEFINE_string("target", None, "The accelerator, e.g. h100 or v5e-8.", flag_values=fv)
        flags.DEFINE_integer(
            "devices",
            None,
            "Devices of the target (default: the target name's count, the config's mesh, else 1).",
            flag_values=fv,
        )
        flags.DEFINE_boolean(
            "fit",
            False,
            "Search the memory knobs, cheapest first, for the fastest configuration that fits; "
            "print the --config. overrides.",
            flag_values=fv,
        )
        flags.DEFINE_string("json", None, "Also write the plan as JSON here.", flag_values=fv)

    flag_values = main_lib.parse_flags(argv, _usage, define)
    if flag_values is None:  # --help
        return errors.EXIT_OK
    if not flag_values.target:
        names = ", ".join(sorted(plan.TARGETS))
        main_lib.usage_error(f"--target is required; known targets: {names}")
    logging.set_verbosity(logging.WARNING)
    try:
        check_json_path(flag_values.json)
        if flag_values.fit:
            result = plan.fit(flag_values.config, flag_values.target, flag_values.devices)
        else:
            result = plan.plan(flag_values.config, flag_values.target, flag_values.devices)
    except errors.ConfigError as e:
        main_lib.usage_error(str(e))
    if not result.fits:
        sys.stdout.write(result.verdict() + "\n\n")
    sys.stdout.write(str(result))
    sys.stdout.flush()
    if flag_values.json:
        _write_json(flag_values.json, json.loads(result.to_json()))
    return errors.EXIT_OK if result.fits else plan.EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
