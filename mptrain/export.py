"""`python -m mptrain.export`: a run's params as a standalone checkpoint in the dtype they serve in.

    python -m mptrain.export --workdir=runs/default --out=exports/default-bf16 \
        --dtype=bfloat16 --keep_fp32='(^|/)ln_|norm|scale'

Reads the newest valid checkpoint of `--workdir` (or `--step=N`) with the same validation as a
resume (array specs, fingerprint, finite params; an unusable newest checkpoint falls back to an
older one), takes the fp32 master params and writes them to `--out`: `params/`, a plain orbax
checkpoint (restores into numpy without mptrain), with every floating leaf cast to `--dtype`
except those whose path (`block_0/ln_attn/scale`) matches `--keep_fp32`; and `export.json`, the
sidecar (source workdir, step and fingerprint, the run's config and policy, the dtype of every
leaf). Bad usage (a missing workdir, a step with no checkpoint, an unknown dtype, an `--out`
that is not empty, a bad regex) and a workdir it cannot use (a corrupt `config.json`, no usable
checkpoint) exit 2 with one line and write nothing; an `--out` it cannot write (full, read-only,
denied) exits 1 with one line naming it and the cause.

It only reads the workdir, which may belong to a run still training: it never writes or deletes
there (a half-written checkpoint is that run's save in progress, not a leftover) and exports
the newest checkpoint that is finished and valid.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from mptrain import errors

DTYPES = ("bfloat16", "float16", "float32")


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keys)


def export(
    workdir: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "bfloat16",
    step: int | None = None,
    keep_fp32: str | None = None,
) -> dict[str, Any]:
    """Exports the params of `workdir`'s checkpoint to `out` (see the module doc); returns the
    sidecar. Raises `errors.ConfigError` for bad arguments, `errors.WorkdirError` for a workdir
    it cannot use (nothing is written then), `errors.StorageError` when `out` cannot be
    written."""
    import jax
    import ml_collections
    import numpy as np

    from mptrain import checkpoint, fingerprints, launch
    from mptrain import config as config_lib

    if dtype not in DTYPES:
        raise errors.ConfigError(f"--dtype={dtype!r}: not supported; valid values: {DTYPES}")
    try:
        keep = re.compile(keep_fp32) if keep_fp32 else None
    except re.error as e:
        raise errors.ConfigError(
            f"--keep_fp32={keep_fp32!r}: not a regular expression ({e})"
        ) from None
    workdir, out = Path(workdir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise errors.ConfigError(f"--out={out}: exists and is not an empty folder")
    config_path, checkpoints = workdir / "config.json", workdir / "checkpoints"
    if not config_path.is_file() or not checkpoints.is_dir():
        raise errors.WorkdirError(f"--workdir={workdir}: not an mptrain run (no config.json)")
    try:
        saved = json.loads(config_path.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
        saved["mesh"] = {**saved.get("mesh", {}), "data": 1, "fsdp": 1}  # whole, on one device
        saved["distributed"] = dict.fromkeys(("coordinator_address", "num_processes", "process_id"))
        config = ml_collections.ConfigDict(saved)
        config_lib.validate(config)
    except (OSError, ValueError, TypeError) as e:  # ConfigError is a ValueError
        raise errors.WorkdirError(
            f"--workdir={workdir}: {config_path} is unusable: {errors.first_line(e)}"
        ) from None
    trainer = launch.import_trainer(config.trainer)(config, workdir)
    init, args = trainer.make_init(trainer.build_datasets()[0].get_batch(0))
    abstract = jax.eval_shape(init, *args)
    with checkpoint.Checkpointer(checkpoints, read_only=True) as checkpointer:
        try:
            restored = checkpointer.restore(abstract, step)
        except FileNotFoundError as e:
            raise errors.ConfigError(f"--step={step}: {e}") from None
        except (checkpoint.InvalidCheckpointError, checkpoint.CheckpointMismatchError) as e:
            raise errors.WorkdirError(f"--workdir={workdir}: {e}") from None
    if restored is None:
        raise errors.WorkdirError(f"--workdir={workdir}: holds no checkpoint")
    state, meta = restored
    params = jax.device_get(state.params)
    dtypes, kept = {}, []

    def cast(keys, x):
        path, x = _path(keys), np.asarray(x)
        if np.issubdtype(x.dtype, np.floating) or x.dtype == jax.numpy.bfloat16:
            if keep is not None and keep.search(path):
                kept.append(path)
                x = x.astype(np.float32)
            else:
                x = x.astype(jax.numpy.dtype(dtype))
        dtypes[path] = x.dtype.name
        return x

    params = jax.tree_util.tree_map_with_path(cast, params)
    sidecar = {
        "source": {
            "workdir": str(workdir.resolve()),
            "step": int(meta["step"]),
            "fingerprint": meta["fingerprint"],
        },
        "dtype": dtype,
        "keep_fp32": keep_fp32,
        "kept_fp32": kept,
        "params": sum(int(np.size(x)) for x in jax.tree.leaves(params)),
        "params_fingerprint": fingerprints.fingerprint(params),
        "policy": meta.get("policy"),
        "config": meta.get("config"),
        "dtypes": dtypes,
    }
    checkpoint.save_standalone(out, params, sidecar)
    return sidecar


def main(argv: list[str] | None = None) -> int:
    import argparse

    class OneLine(argparse.ArgumentParser):
        def error(self, message: str):  # argparse's usage block, as mptrain's other commands
            sys.stderr.write(f"mptrain.export: error: {message} (--help lists the flags)\n")
            sys.exit(errors.EXIT_USAGE)

    parser = OneLine(prog="python -m mptrain.export", description=__doc__)
    parser.add_argument("--workdir", required=True, help="the run's workdir")
    parser.add_argument("--out", required=True, help="folder to write (absent or empty)")
    parser.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(DTYPES)}")
    parser.add_argument("--step", type=int, default=None, help="default: newest valid")
    parser.add_argument("--keep_fp32", default=None, help="regex of param paths kept in fp32")
    args = parser.parse_args(argv)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    try:
        sidecar = export(args.workdir, args.out, args.dtype, args.step, args.keep_fp32)
    except (errors.ConfigError, errors.WorkdirError, errors.StorageError) as e:
        sys.stderr.write(f"mptrain.export: error: {e}\n")
        return e.exit_code
    print(
        f"mptrain.export: step {sidecar['source']['step']} of {args.workdir}: "
        f"{sidecar['params']:,} params as {args.dtype} ({len(sidecar['kept_fp32'])} kept in "
        f"float32) in {args.out}"
    )
    return errors.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
