"""`python -m mptrain.main --config=configs/default.py --workdir=runs/default [--config.key=value]`

Parses flags and runs the trainer named by `config.trainer` (`mptrain.run` does the same from
Python). Exit codes (declared in `errors.py`): 0 done; 2 bad usage or config (one
message naming the key, no traceback); 3 training went non-finite and could not recover; 75
preempted (SIGTERM or a first Ctrl-C) after writing a checkpoint: run the same command to resume;
130 a second Ctrl-C, which does not wait for the checkpoint.
"""

from __future__ import annotations

import copy
import logging as std_logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from mptrain import errors


class _QuietLibraries(std_logging.Filter):
    """Drops the INFO chatter of orbax and jax's backend probing; warnings still pass."""

    _NOISY = ("/orbax/", "/jax/_src/xla_bridge", "/jax/_src/distributed")

    def filter(self, record: std_logging.LogRecord) -> bool:
        if record.levelno >= std_logging.WARNING:
            return True
        return not any(part in record.pathname for part in self._NOISY)


def _one_line(error: Exception) -> str:
    """The gist of a flag error: config_flags embeds whole tracebacks in its messages."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any(line.startswith("Traceback") for line in lines):
        raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)]
        return f"{lines[0].split(':')[0]}: {raised[-1] if raised else lines[-1]}"
    return " ".join(lines) or repr(error)


def usage_error(message: str) -> None:
    sys.stderr.write(f"mptrain: error: {message}\n")
    sys.exit(errors.EXIT_USAGE)


def _raised(error: BaseException, path: str) -> str:
    """`line N: KeyError: 'missing'`: what a config file raised, and where in it (config_flags
    wraps what a file raises at import in a ValueError holding the traceback as text)."""
    file = os.path.abspath(path.split(":", 1)[0])
    text = str(error)
    lines = [int(n) for f, n in re.findall(r'File "([^"]+)", line (\d+)', text) if f == file]
    tb = error.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == file:
            lines.append(tb.tb_lineno)
        tb = tb.tb_next
    # the traceback's last line names the class with its module (mptrain.errors.ConfigError)
    raised = re.findall(r"^([\w.]*?(\w+(?:Error|Exception|Exit))): (.*)$", text, re.M)
    what = f"{raised[-1][1]}: {raised[-1][2]}" if "Traceback" in text and raised else None
    what = what or f"{type(error).__name__}: {errors.first_line(error).strip(chr(34))}"
    if what.startswith("ConfigError: "):  # mptrain's own: it names its file and key itself
        return what
    return (f"line {lines[-1]}: " if lines else "") + what


class _BadConfigFile(Exception):
    """A config file that cannot be a config, or an override naming no key of it (not a
    ValueError: absl would wrap it in a message of its own)."""


def _checked_config_file(parser, argv: list[str]):
    """config_flags' loader of `--config=FILE[:ARG]` (`parser`), with what it leaves unchecked
    checked before any override is applied: the file has a `get_config`, which returns a
    ConfigDict, and each `--config.KEY=VALUE` names a key of it (else the closest is named)."""
    import ml_collections
    from absl import flags

    from mptrain import config as config_lib

    class Checked(flags.ArgumentParser):
        given = None  # the file's config, before the overrides
        overrides = tuple(
            a[len("--config.") :].split("=")[0] for a in argv[1:] if a.startswith("--config.")
        )

        def flag_type(self):
            return parser.flag_type()

        def parse(self, path):
            quiet = lambda record: "returned None" not in record.getMessage()  # said below
            std_logging.getLogger("absl").addFilter(quiet)
            # config_flags loads every file as module `config_config` into the module of that
            # name it finds: a second main() in one process would see the first file's names
            sys.modules.pop("config_config", None)
            try:
                config = parser.parse(path)
            except Exception as e:  # what the file raised, as it loaded or in get_config
                if not isinstance(e, AttributeError) or getattr(e, "name", None) != "get_config":
                    raise _BadConfigFile(f"--config={path}: {_raised(e, path)}") from None
                raise _BadConfigFile(
                    f"--config={path}: the file defines no get_config(arg=None), the function "
                    "that returns its config"
                ) from None
            finally:
                std_logging.getLogger("absl").removeFilter(quiet)
            if not isinstance(config, ml_collections.ConfigDict):
                getattr(config, "keys", None)  # a file config_flags could not load raises here
                what = "None (no return?)" if config is None else f"a {type(config).__name__}"
                raise _BadConfigFile(
                    f"--config={path}: get_config() returned {what}, not an ml_collections."
                    "ConfigDict; build it from mptrain.config.base_config() and return it"
                )
            for key in self.overrides:
                _declared_default(config, key)
                section = config
                for part in key.split("."):
                    if not isinstance(section, ml_collections.ConfigDict):
                        break  # an index into a value: config_flags' to judge
                    if part not in section:
                        valid = [k for k, _ in config_lib.flat_items(config)]
                        raise _BadConfigFile(
                            f"--config.{key}: config.{key} is not a key of {path}; "
                            f"{errors.did_you_mean(key, valid)}"
                        )
                    section = section[part]
            self.given = copy.deepcopy(config)  # before config_flags applies the overrides
            return config

    return Checked()


def _declared_default(config, key: str) -> None:
    """For an override `model.X` (or `data.X`) that the file's config leaves out, where X is
    one of the `CONFIG_KEYS` of the model (the data source) the config names: X set to its
    default, so that the override applies (the MoE keys on `configs/llama3.py:moe_tiny`, say).
    A default of None stays out: a command line cannot override a None."""
    from mptrain import data, models

    part, _, name = key.partition(".")
    section = config.get(part) if part in ("model", "data") else None
    if section is None or not name or "." in name or name in section:
        return
    find = models.import_model if part == "model" else data.import_source
    try:
        default = find(section.get("name")).CONFIG_KEYS.get(name)
    except ValueError:  # a name of no module here (a Trainer's own model): nothing declared
        return
    if default is not None:
        with section.unlocked():  # config_flags locks what a file returns
            section[name] = default


def _usage(flag_values) -> str:
    flags = "\n".join(f"  --{name}: {flag_values[name].help}" for name in ("config", "workdir"))
    return (
        "usage: python -m mptrain.main --config=FILE[:ARG] --workdir=DIR [--config.KEY=VALUE ...]"
        "\n\nTrains what a config file describes. Exit codes: 0 done, 1 storage or other "
        "failure, 2 bad usage or config, 3 training went non-finite for good, 75 preempted "
        "(SIGTERM or a first Ctrl-C; run the same command again to resume), 130 a second "
        "Ctrl-C (stopped at once).\n"
        f"\nflags:\n{flags}\n  --config.KEY=VALUE: sets one key of the config, e.g. "
        "--config.num_train_steps=200 --config.optimizer.learning_rate=3e-4\n"
        "\nconfig keys: every key of mptrain.config.base_config() is commented in "
        "mptrain/config.py; the keys beside model.name and data.name are their module's "
        "CONFIG_KEYS (mptrain/models/<name>.py, mptrain/data/<name>.py). A config file's "
        "get_config(arg) builds on base_config(): see configs/default.py.\n"
    )


def main(argv: list[str] | None = None) -> int:
    from mptrain import runtime

    runtime.catch_stop_signals()  # first: a stop signal from here on is exit 75 and one line
    code = None
    try:
        code = _main(argv)
        return code
    finally:
        if argv is None and code is not None:  # the process's own command line, done
            runtime.end_with_on_stop_signals(code)
        else:
            runtime.release_stop_signals()


def parse_flags(argv: list[str], usage: Callable, define: Callable) -> Any:
    """`argv` parsed as every mptrain command takes it: `--config=FILE[:ARG]` (required; the
    file and each `--config.KEY=VALUE` checked by `_checked_config_file`) and the flags that
    `define(flag_values)` adds. Bad usage exits 2 with one line (`_usage_error`); `--help`
    writes `usage(flag_values)` and returns None."""
    from absl import flags
    from ml_collections import config_flags

    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config",
        None,
        "Path to a config file, optionally ':arg'.",
        flag_values=flag_values,
        sys_argv=argv,  # overrides are read from here, not from the global sys.argv
    )
    define(flag_values)
    flag_values["config"].parser = _checked_config_file(flag_values["config"].parser, argv)
    if any(arg in ("--help", "-h", "--helpfull", "-?") for arg in argv[1:]):
        sys.stdout.write(usage(flag_values))
        return None
    files = [arg for arg in argv[1:] if arg.startswith("--config=")]
    if len(files) > 1:
        usage_error(
            f"--config given {len(files)} times ({', '.join(files)}): give one config file, "
            "and override its keys with --config.KEY=VALUE"
        )
    for arg in argv[1:]:
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1].split(":", 1)[0]
            if not os.path.isfile(path):
                usage_error(f"--config: no config file at {path!r} (from {os.getcwd()})")
    try:
        rest = flag_values(argv)
        if flag_values.config is not None:
            flag_values.config.keys()  # config_flags loads lazily: surface its errors here
    except _BadConfigFile as e:
        usage_error(str(e))
    except (AttributeError, KeyError) as e:  # an override names a key the config lacks
        detail = str(e).replace("\\n", " ").replace("\n", " ").replace("\\'", "'").strip("'\" ")
        overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
        usage_error(f"unknown config key in {', '.join(overrides)}: {detail}")
    except Exception as e:  # flags.Error, or the config file failed to load or parse
        usage_error(_one_line(e))
    if len(rest) > 1:
        usage_error(f"unexpected arguments: {' '.join(rest[1:])}")
    if flag_values.config is None:
        usage_error("--config is required, e.g. --config=configs/default.py")
    return flag_values


def _main(argv: list[str] | None) -> int:
    from absl import flags, logging

    argv = list(sys.argv if argv is None else argv)
    define = lambda fv: flags.DEFINE_string(
        "workdir", None, "Directory for checkpoints and logs.", flag_values=fv
    )
    flag_values = parse_flags(argv, _usage, define)
    if flag_values is None:  # --help
        return errors.EXIT_OK
    if not flag_values.workdir:
        usage_error("--workdir is required, e.g. --workdir=runs/default")
    from mptrain import buckets

    try:  # s3:// and gs:// are staged and mirrored (`mptrain.mirror`); other URLs refused
        if buckets.scheme(flag_values.workdir) is not None:
            buckets.parse(flag_values.workdir)
    except errors.ConfigError as e:
        usage_error(str(e))

    from absl import app

    app.parse_flags_with_usage([argv[0]])  # absl's own flags (logging) with their defaults
    logging.set_verbosity(logging.INFO)
    logging.use_absl_handler()
    logging.get_absl_handler().addFilter(_QuietLibraries())

    from mptrain import runtime
    from mptrain.train import launch

    config = flag_values.config
    try:
        runtime.start_backend(config)  # before anything touches a device
    except ValueError as e:
        usage_error(f"config.{e}")
    import jax

    if jax.process_index() != 0:  # process 0 tells the story; the others speak up on trouble
        logging.set_verbosity(logging.WARNING)
    from mptrain import unused

    parser = flag_values["config"].parser
    try:  # validates the config (every key, before the workdir is touched), then trains
        with unused.command_line(parser.given, parser.overrides):  # warn of what it set
            launch.run(config, flag_values.workdir)
    except errors.ConfigError as e:
        usage_error(str(e))
    except errors.StopTraining as e:
        preempted = isinstance(e, errors.Preempted)
        sys.stderr.write(f"mptrain: {'' if preempted else 'error: '}{e}\n")
        return e.exit_code
    return errors.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
