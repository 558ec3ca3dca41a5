"""`python -m mptrain.plan`: a run's train step compiled for the accelerator it will train on.

    python -m mptrain.plan --config=configs/lm_gpt2s.py --target=h100
    python -m mptrain.plan --config=configs/lm_1b.py --target=h100 --devices=8 --config.mesh.fsdp=8
    python -m mptrain.plan --config=configs/lm_gpt2s.py --target=v5e-8 --json=plan.json
    python -m mptrain.plan --config=configs/llama3.py:8b --target=h100 --decode --context=2048

The package: this module (the command line, `plan` and `fit`), `step` (the step compiled for the
target and read into a `Plan`), `memory` (the share a run gets, XLA's own rematerialisation),
`report` (the plan as text), `search` (the search of `--fit`), `roofline` (the floor) and
`decode` (a Llama's decoding step, `--decode`). It may
import everything below the command lines (`train` and down); nothing in mptrain imports it.

From any machine, a GPU-less laptop or CI included: the Trainer of `config.trainer` is built for
`--devices` compile-only devices of the target (`mptrain.target`), its own train step (state,
shardings, `steps_per_call`, donation) is compiled from abstract shapes (nothing is allocated,
no dataset is read beyond one example's shapes), and the compiled program is read
(`mptrain.inspect.program`). Every choice made by backend follows the target, not this
host: attention "auto" picks cuDNN's fused kernel for an H100 exactly as a run on the H100 does.

The `Plan` (`mptrain.plan.step`) says, per device and per step: the memory (params, optimizer
state, other state, inputs, temporaries) against what the run will have (75% of a GPU unless
`memory_fraction`, or the environment's XLA_PYTHON_CLIENT_MEM_FRACTION, says otherwise), with a
verdict and XLA's own
rematerialisation where it recomputed (`mptrain.plan.memory`); matmul FLOPs by operand dtype;
the attention that runs; the GPU hazards of the precision report (scatters, 16-bit sums across
devices) and every collective with its dtypes; the kernel count; and a roofline floor,
max(compute, memory, collectives over the target's interconnect), the binding side named,
with the MFU it implies. The floor is the least time the chip's peaks allow, not a
measurement. `--fit` searches the memory knobs for the fastest configuration that fits
(`mptrain.plan.search`, docs/make-it-fit.md).

The command line ends as the trainer's does: one line and the right exit code, never a
traceback. 0 it fits (with `--fit`: a candidate fits); 4 it does not (the verdict first, then
the plan; with `--fit`, the closest candidate and what it would need; a step the target's
compiler refuses for want of memory, as a TPU's does, is a plan that does not fit, with the
compiler's words and the memory it counted); 2 bad usage, config or
target, found before anything compiles (an unknown target lists the known ones, a missing
compiler names the `pip install 'mptrain[plan]'` line; a device count below 1, a target's
chip count that is not a whole number, `--devices` that disagrees with the target's count, a
`--json` path that is empty, a folder, under a file or in a folder this user cannot write); 1
the JSON could not be written after all; 130 Ctrl-C, at once, even inside XLA's compile.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from mptrain import errors

EXIT_INTERRUPTED = 130
__all__ = ["EXIT_DOES_NOT_FIT", "TARGETS", "Plan", "fit", "main", "plan", "plan_step"]
# Loaded on first use (PEP 562): `python -m mptrain.plan` reaches `main`, and its Ctrl-C watcher,
# in milliseconds, not after the half second that importing jax takes.
_FROM_STEP = {"EXIT_DOES_NOT_FIT", "TARGETS", "Plan"}


def __getattr__(name: str):
    if name == "plan_step" or name in _FROM_STEP:
        from mptrain.plan import step as plan_step

        return plan_step if name == "plan_step" else getattr(plan_step, name)
    raise AttributeError(f"module 'mptrain.plan' has no attribute {name!r}")


def plan(config, target: str, devices: int | None = None):
    """The contract's entry point: `config`'s train step compiled for `target` (a spec name such
    as "h100" or "v5e-8") on `devices` of it, read for memory, dtypes, kernels and the floor: a
    `plan_step.Plan` (`plan_step.plan` does the work; this module is the command line around
    it)."""
    from mptrain.plan import step as plan_step

    return plan_step.plan(config, target, devices)


def fit(config, target, devices: int | None = None, peft: bool = False):
    """The search of `--fit` as data: `mptrain.plan.search.fit` (see there); `peft`: adapters
    over a frozen base may be tried where full training fits nowhere."""
    from mptrain.plan import search as fit_lib

    return fit_lib.fit(config, target, devices, peft)


def _no_tokenizer_download(config) -> None:
    """A plan reads no data, and needs a Hub model's config.json alone: where `data.tokenizer`
    is a Hub id whose tokenizer is not in the cache, the plan does not fetch it but plans
    with the byte tokenizer (the data's shapes are the same: rows of `data.seq_len`), saying
    that it checked no vocabulary."""
    from mptrain import hub

    spec = (config.get("data") or {}).get("tokenizer")
    if hub.parse(spec) is None or hub.cached(spec, "tokenizer.json"):
        return
    config.data.tokenizer = "bytes"
    sys.stderr.write(
        f"mptrain.plan: data.tokenizer={spec!r} is not in the Hub's cache; a plan fetches no "
        "tokenizer (it reads no data), so the tokenizer's vocabulary is not checked against "
        "the model's\n"
    )


def _usage(flag_values) -> str:
    from mptrain.plan.step import TARGETS

    names = ", ".join(sorted(TARGETS))
    return (
        "usage: python -m mptrain.plan --config=FILE[:ARG] --target=NAME [--devices=N] "
        "[--fit [--peft]] [--json=PATH] [--config.KEY=VALUE ...]\n\n"
        "Compiles the run's train step for an accelerator that need not be here and reports "
        "its memory, dtypes, hazards and roofline floor; --fit searches the memory knobs for "
        "the fastest configuration that fits. Exit codes: 0 it fits, 4 it does not, 2 bad "
        f"usage, config or target, 130 Ctrl-C.\n\ntargets: {names} (a TPU name may carry its "
        "chip count, e.g. v5e-8)\n\nflags:\n"
        + "\n".join(
            f"  --{n}: {flag_values[n].help}"
            for n in ("config", "target", "devices", "fit", "peft", "json")
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
        flags.DEFINE_boolean(
            "peft",
            False,
            "With --fit: also try LoRA adapters over a frozen base (bf16, then 8-bit) where full "
            "training fits nowhere; their price in quality is not measured.",
            flag_values=fv,
        )
        flags.DEFINE_string("json", None, "Also write the plan as JSON here.", flag_values=fv)
        flags.DEFINE_boolean(
            "decode", False, "Plan a Llama's decoding step (mptrain.plan.decode).", flag_values=fv
        )
        flags.DEFINE_integer("context", 2048, "--decode: the KV cache's slots.", flag_values=fv)
        flags.DEFINE_integer("batch", 1, "--decode: the rows decoded at once.", flag_values=fv)

    flag_values = main_lib.parse_flags(argv, _usage, define)
    if flag_values is None:  # --help
        return errors.EXIT_OK
    from mptrain.plan.step import EXIT_DOES_NOT_FIT, TARGETS

    if not flag_values.target:
        names = ", ".join(sorted(TARGETS))
        main_lib.usage_error(f"--target is required; known targets: {names}")
    logging.set_verbosity(logging.WARNING)
    try:
        check_json_path(flag_values.json)
        _no_tokenizer_download(flag_values.config)
        if flag_values.decode:
            from mptrain.plan import decode

            out = decode.plan_decode(
                flag_values.config, flag_values.target, flag_values.batch, flag_values.context
            )
            sys.stdout.write(decode.text(out))
            if flag_values.json:
                _write_json(flag_values.json, out)
            return errors.EXIT_OK
        if flag_values.fit:
            args = (flag_values.config, flag_values.target, flag_values.devices)
            result = fit(*args, peft=flag_values.peft)
        else:
            result = plan(flag_values.config, flag_values.target, flag_values.devices)
    except errors.ConfigError as e:
        main_lib.usage_error(str(e))
    if not result.fits:
        ways = f"to make it fit: {result.ways_to_fit()}\n" if not flag_values.fit else ""
        sys.stdout.write(result.verdict() + "\n" + ways + "\n")
    sys.stdout.write(str(result))
    sys.stdout.flush()
    if flag_values.json:
        _write_json(flag_values.json, json.loads(result.to_json()))
    return errors.EXIT_OK if result.fits else EXIT_DOES_NOT_FIT
