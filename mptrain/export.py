"""`python -m mptrain.export`: a run's params as a standalone checkpoint in the dtype they serve in.

    python -m mptrain.export --workdir=runs/default --out=exports/default-bf16 \
        --dtype=bfloat16 --keep_fp32='(^|/)ln_|norm|scale'
    python -m mptrain.export --workdir=runs/ft --format=hf --out=exports/ft-hf

`--format=hf` (a Llama run only) writes a HuggingFace Llama folder instead, with
`mptrain.hf.save`: config.json (transformers 4.x form, which 4.x and 5.x load), the weights in
`--dtype` (round-to-nearest-even from the fp32 masters) as `model.safetensors` or 5 GB shards
with an index, `export.json`, and the run's tokenizer files (`tokenizer.json`, and beside it
`tokenizer_config.json` and `special_tokens_map.json` where they are) when its
`data.tokenizer` names one; `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads it.
Another model under `--format=hf`, or `--keep_fp32` with it (a folder holds one dtype), exits 2
with one line and writes nothing.
A LoRA run (`config.lora`) exports its base with the adapters merged, `W + (alpha/rank) B A`
computed in fp32 and rounded once to `--dtype` (under `--format=orbax` and `hf` alike; the base
is read from its `init_from` and checked against the fingerprint its checkpoints name), or
under `--format=peft` the adapters alone as a PEFT folder (`mptrain.hf.peft`:
`adapter_config.json`, `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained`
loads onto the base folder. `--format=orbax`, the default, is the rest of this page.

Reads the newest valid checkpoint of `--workdir` (or `--step=N`) with the same validation as a
resume (array specs, fingerprint, finite params; an unusable newest checkpoint falls back to an
older one), takes the fp32 master params and writes them to `--out`: `params/`, a plain orbax
checkpoint (restores into numpy without mptrain), with every floating leaf cast to `--dtype`
except those whose path (`block_0/ln_attn/scale`) matches `--keep_fp32`; and `export.json`, the
sidecar (source workdir, step and fingerprint, the run's config and policy, the dtype of every
leaf). Bad usage (a missing workdir, a step with no checkpoint, an unknown dtype, an `--out`
that is not empty, a bad regex) and a workdir it cannot use (a corrupt `config.json`, no usable
checkpoint) exit 2 with one line and write nothing; an `--out` it cannot write (full, read-only,
denied) exits 1 with one line naming it and the cause. Every format's folder is written beside
`--out` (`.NAME.export-HOST-PID`) and renamed to it once whole; a failed export removes it, and
what a killed one left, the next export to that `--out` removes.

It only reads the workdir, which may belong to a run still training: it never writes or deletes
there (a half-written checkpoint is that run's save in progress, not a leftover) and exports
the newest checkpoint that is finished and valid.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging as std_logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from mptrain import buckets, errors, files, mirror

DTYPES = ("bfloat16", "float16", "float32")
FORMATS = ("orbax", "hf", "peft")
# What an HF folder holds of a tokenizer besides tokenizer.json, copied with it when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keys)


def export(
    workdir: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "bfloat16",
    step: int | None = None,
    keep_fp32: str | None = None,
    format: str = "orbax",
) -> dict[str, Any]:
    """Exports the params of `workdir`'s checkpoint to `out` as `format` (see the module doc);
    returns the sidecar. Raises `errors.ConfigError` for bad arguments, `errors.WorkdirError`
    for a workdir it cannot use (nothing is written then), `errors.StorageError` when `out`
    cannot be written."""
    import jax
    import numpy as np

    from mptrain.train import fingerprints, standalone

    if dtype not in DTYPES:
        raise errors.ConfigError(f"--dtype={dtype!r}: not supported; valid values: {DTYPES}")
    if format not in FORMATS:
        raise errors.ConfigError(f"--format={format!r}: not supported; valid values: {FORMATS}")
    if format in ("hf", "peft") and keep_fp32:
        raise errors.ConfigError(
            f"--keep_fp32={keep_fp32!r}: --format={format} writes every weight in one dtype "
            "(--dtype); leave --keep_fp32 out"
        )
    try:
        keep = re.compile(keep_fp32) if keep_fp32 else None
    except re.error as e:
        raise errors.ConfigError(
            f"--keep_fp32={keep_fp32!r}: not a regular expression ({e})"
        ) from None
    if buckets.scheme(out) is not None:  # s3:// or gs://: written here, then uploaded
        bucket = buckets.open(os.fspath(out), "--out")
        if bucket.list():
            raise errors.ConfigError(f"--out={out}: holds objects already; give an empty path")
        with tempfile.TemporaryDirectory(prefix="mptrain-export-") as local:
            sidecar = export(workdir, Path(local, "out"), dtype, step, keep_fp32, format)
            mirror.upload_folder(Path(local, "out"), bucket)
        return sidecar
    if buckets.scheme(workdir) is not None:  # read from a local copy
        workdir = mirror.read_copy(os.fspath(workdir))
    workdir, out = Path(workdir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise errors.ConfigError(f"--out={out}: exists and is not an empty folder")
    files.check_output("--out", out, folder=True)
    config, restored = read_run(workdir, step, base=format != "peft")  # peft: adapters alone
    from mptrain import models
    from mptrain.models import lora

    if format in ("hf", "peft") and not getattr(models.record_of(config), "hf", False):
        raise errors.ConfigError(
            f"--format={format}: the run in {workdir} trains model.name={config.model.name!r}; "
            f"only {models.able('hf')} maps onto a HuggingFace folder (use --format=orbax)"
        )

    if format == "peft" and not lora.enabled(config):
        raise errors.ConfigError(
            f"--format=peft: the run in {workdir} trains no adapters (config.lora.rank is "
            "None); --format=hf writes its weights"
        )
    base = config.get("init_from")
    if format == "peft" and base is not None and not Path(base).exists():  # X17
        from absl import logging

        logging.warning(
            "mptrain.export: the run's base folder %s is gone; adapter_config.json names it as "
            "the run had it (base_model_name_or_path): load the adapters onto the base where "
            "it is now", base,
        )  # fmt: skip
    state, meta = restored
    params = jax.device_get(state.params if format == "peft" else _weights(config, state))
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
    if format in ("hf", "peft"):
        sidecar["format"] = format
    with _written(out) as staging:
        if format in ("hf", "peft"):
            _save_hf(staging, config, params, dtype, format)
        else:
            standalone.save_params(staging, params)
        files.write_json(staging / "export.json", sidecar)
    return sidecar


def read_run(workdir: Path, step: int | None = None, base: bool = True) -> tuple[Any, tuple]:
    """`(config, (state, meta))` of the run in `workdir`: its `config.json` (on one device)
    and its checkpoint `step` (None: the newest complete one), read only, without the run's
    lock, so a live run goes on. A LoRA run's frozen base is read too (from its `init_from`),
    unless `base` is False: the adapters alone, all in the checkpoint. A `WorkdirError` for a
    folder that is no run, or holds no checkpoint that restores; a `ConfigError` for a `step`
    it does not hold."""
    import jax
    import ml_collections

    from mptrain import config as config_lib
    from mptrain.parallel import layout
    from mptrain.train import checkpoint, init_from, launch

    config_path, checkpoints = workdir / "config.json", workdir / "checkpoints"
    if not config_path.is_file():
        raise errors.WorkdirError(f"--workdir={workdir}: not an mptrain run (no config.json)")
    if not checkpoints.is_dir():
        raise errors.WorkdirError(f"--workdir={workdir}: holds no checkpoint (no checkpoints/)")
    try:
        saved = json.loads(config_path.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
        # whole, on one device: a checkpoint restores onto any mesh, whatever axes it trained on
        saved["mesh"] = {**saved.get("mesh", {}), **dict.fromkeys(layout.AXES, 1)}
        if isinstance(saved.get("model"), dict) and "expert_matmul" in saved["model"]:
            saved["model"]["expert_matmul"] = "auto"  # the kernel of the chip here, not the run's
        saved["distributed"] = dict.fromkeys(("coordinator_address", "num_processes", "process_id"))
        _without_a_lost_tokenizer(saved)
        config = ml_collections.ConfigDict(saved)
        resolved = config_lib.validate(config)
    except (OSError, ValueError, TypeError) as e:  # ConfigError is a ValueError
        raise errors.WorkdirError(
            f"--workdir={workdir}: {config_path} is unusable: {errors.first_line(e)}"
        ) from None
    trainer = launch.import_trainer(config.trainer)(config, workdir, resolved=resolved)
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
    state, meta = restored  # a LoRA run's base is read as its resume reads it
    if not base:
        return config, restored
    where = f"{checkpoints}/{meta['step']}"
    return config, (init_from.with_run_base(trainer, state, meta, lambda: init(*args), where), meta)


def _weights(config: Any, state: Any) -> Any:
    """The model's weights: its params, or a LoRA run's base with its adapters merged in fp32
    (`lora.merged`), rounded once when exported."""
    from mptrain.models import lora

    if not lora.enabled(config):
        return state.params
    keys = lora.settings(config.lora)
    return lora.merged(state.model_params, keys["alpha"] / keys["rank"])


def _save_hf(staging: Path, config: Any, params: Any, dtype: str, format: str) -> None:
    """`hf.save` of `params` (numpy, already in `dtype`) into `staging`, or under
    `--format=peft` a PEFT adapter folder of them (`hf.peft`), with the run's tokenizer files."""
    import shutil

    from absl import logging

    from mptrain import config as config_lib
    from mptrain import hf
    from mptrain.hf import peft

    tokenizer = _tokenizer_files(config)
    if format == "peft":
        model = hf.read_settings(config_lib.to_dict(config.model))
        peft.save(staging, params, config.lora, config.get("init_from"), model)
    else:
        hf.save(staging, config_lib.to_dict(config.model), params, dtype=dtype)
    for path in tokenizer:
        shutil.copyfile(path, staging / path.name)
    if tokenizer:
        logging.info("mptrain.export: tokenizer files %s", ", ".join(p.name for p in tokenizer))


@contextlib.contextmanager
def _written(out: Path):
    """Yields the folder an export writes (`_staging(out)`, beside `out`), renamed to `out` once
    the block returns: all or nothing, with the modes the umask gives. On a failure the folder
    is removed and a storage failure raised as one `errors.StorageError` naming `out`."""
    staging = _staging(out)
    try:
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()  # 0777 less the umask: mkdtemp's 0700 would hide the export
        yield staging
        if out.is_dir():  # an empty folder the user made for it
            out.rmdir()
        staging.rename(out)
    except BaseException as e:
        # A failed orbax save's other writes fail too, each in a task orbax never awaits, which
        # asyncio would print at exit ("Task exception was never retrieved", a traceback each):
        # the one line this failure says is theirs too (CI, 2026-12-06: 7 lines on a full disk).
        std_logging.getLogger("asyncio").setLevel(std_logging.CRITICAL)
        _remove(staging)
        if isinstance(e, errors.StorageError):  # one that names a file of the staging folder
            e = RuntimeError(str(e))  # its cause, told as the export's
        error = files.storage_error(e, f"the export at {out}")
        if error is None:
            raise
        raise error from e


def _remove(folder: Path) -> None:
    """Removes `folder` of a failed export once no write has landed in it for `_SETTLE_S`:
    orbax raises the first write of a save that fails while tensorstore's others go on and make
    their folders anew (CI at stop 77: a disk-full export left `params.orbax-checkpoint-tmp/`
    behind; 3 runs of 40 on a loaded 64 KiB tmpfs here). 30 s at most."""
    import shutil
    import time

    deadline = time.monotonic() + 30
    while True:
        shutil.rmtree(folder, ignore_errors=True)
        time.sleep(_SETTLE_S)
        if not folder.exists() or time.monotonic() > deadline:
            return


_SETTLE_S = 1.0


def _staging(out: Path) -> Path:
    """The folder an export writes before it is renamed to `out`: beside it, named by `out`,
    this host and this process (`.NAME.export-HOST-PID`). Those that exports to `out` killed on
    this host left (gigabytes, for a real model) are removed first, each told; a live
    process's, or another host's, are left alone."""
    import shutil
    import socket

    from absl import logging

    host, parent = socket.gethostname(), out.absolute().parent
    prefix = f".{out.name}.export-"
    for left in sorted(parent.glob(f"{glob.escape(prefix)}*")) if parent.is_dir() else []:
        owner, _, pid = left.name[len(prefix) :].rpartition("-")
        if owner == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
            logging.warning("mptrain.export: removed %s, left by an export that was killed", left)
    return parent / f"{prefix}{host}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _without_a_lost_tokenizer(saved: dict) -> None:
    """The weights are the run's; its tokenizer only travels with them. Where the run's
    `data.tokenizer` is gone, the export warns and goes on without it (the config check would
    refuse the config: `data` is a section the export never builds)."""
    from absl import logging

    from mptrain.data import tokenize

    data = saved.get("data")
    spec = data.get("tokenizer") if isinstance(data, dict) else None
    if not isinstance(spec, str) or spec == tokenize.BYTES:
        return
    try:
        tokenize.tokenizer_file(spec)
    except ValueError:
        logging.warning("mptrain.export: the run's data.tokenizer %s is gone: none copied", spec)
        data["tokenizer"] = tokenize.BYTES


def _tokenizer_files(config: Any) -> list[Path]:
    """The run's tokenizer files (`TOKENIZER_FILES` beside the tokenizer.json that its
    `data.tokenizer` names); none for bytes or another data source. A tokenizer that is gone
    was told and replaced by bytes when the config was read (`_without_a_lost_tokenizer`)."""
    spec = config.data.get("tokenizer")
    if not isinstance(spec, str) or spec == "bytes":
        return []
    path = Path(spec).expanduser()
    folder = path if path.is_dir() else path.parent
    found = [path] if path.is_file() else []
    found += [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    return list(dict.fromkeys(p.absolute() for p in found))


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
    parser.add_argument("--format", default="orbax", help=f"one of {', '.join(FORMATS)}")
    args = parser.parse_args(argv)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    try:
        sidecar = export(
            args.workdir, args.out, args.dtype, args.step, args.keep_fp32, format=args.format
        )
    except (errors.ConfigError, errors.WorkdirError, errors.StorageError) as e:
        sys.stderr.write(f"mptrain.export: error: {e}\n")
        return e.exit_code
    print(
        f"mptrain.export: step {sidecar['source']['step']} of {args.workdir}: "
        f"{sidecar['params']:,} params as {args.dtype} ({len(sidecar['kept_fp32'])} kept in "
        f"float32) in {args.out}{' (a HuggingFace folder)' if args.format == 'hf' else ''}"
    )
    return errors.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
