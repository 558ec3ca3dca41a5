"""Checkpoints: save, validate, restore and fall back. The only module that imports orbax.

Layout, under the directory given to `Checkpointer` (the trainer uses `<workdir>/checkpoints`)::

    <step>/state/   the TrainState pytree (orbax StandardSave: OCDBT + zarr, one entry per leaf)
    <step>/meta/    JSON: step, config, policy, mptrain version, the state's fingerprint and
                    the dtype and shape of every array leaf

Saving is atomic: orbax writes `<step>.orbax-checkpoint-tmp/` and renames it to `<step>/` only
after every file is written. A save that dies half-way therefore leaves a `*.orbax-checkpoint-tmp`
folder, which orbax never lists as a step; `Checkpointer` deletes such leftovers when it opens the
directory (and orbax replaces a leftover of the same step when that step is saved again).

Restoring validates what it reads. `fingerprint(state)`, a sha256 over every array leaf's path,
dtype, shape and two position-aware sums of its elements' bits (computed on the devices, shard
by shard, so a sharded state is never gathered to a host), is stored in `meta` at save time and
recomputed on the restored arrays.
A checkpoint is rejected, with a warning naming the step and the reason, when orbax cannot read
it (missing, truncated or mangled files), when the fingerprint differs (bytes flipped on disk)
or when its params hold a NaN or an inf; `restore` then tries the next older one. A checkpoint
whose arrays do not match the requested state (another model, optimizer or precision policy) is
not corrupt but a mistake, and raises `CheckpointMismatchError` instead of being skipped.

Reading a `state` item with plain orbax, without mptrain installed: the TrainState was saved as
nested dicts keyed by field name (`params`, `opt_state`, `loss_scale`, `rng`, `step`, ...;
optax NamedTuples become lists, their empty states `None`), so::

    import jax, numpy as np, orbax.checkpoint as ocp
    path = "<workdir>/checkpoints/<step>/state"  # absolute path
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    state["params"]  # nested dicts of np.ndarray, dtypes as saved (bfloat16 via ml_dtypes)

`ocp.StandardCheckpointer().restore(path)` also works but returns jax arrays placed on the
saved shardings; the recipe above gives numpy arrays on any machine.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from mptrain import config as config_lib
from mptrain import errors, files, fingerprints, version

STATE_ITEM = "state"
META_ITEM = "meta"
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class InvalidCheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be used: unreadable, corrupt or non-finite."""


class CheckpointMismatchError(ValueError):
    """A readable checkpoint whose arrays do not fit the state it is restored into."""


def _summary(error: Exception, limit: int = 300) -> str:
    """The first line of an error, shortened: tensorstore errors carry a page-long spec."""
    lines = str(error).strip().splitlines() or [""]
    text = lines[0] if len(lines[0]) <= limit else lines[0][:limit] + " ..."
    return f"{type(error).__name__}: {text}"


class Checkpointer:
    """Saves and restores `(state, meta)` pairs under `directory`, one folder per step.

    `max_to_keep`: how many of the newest checkpoints to keep (None: all). `async_save`: when
    True, `save` returns once the arrays are copied off the device and the files are written in
    the background; call `wait()` (or `close()`) before relying on them. Every process of a
    multi-host job must call `save` and `restore` together.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = False,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep}; must be None (keep all) or >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        self.async_save = async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        if jax.process_index() == 0:
            # orbax's own `cleanup_tmp_directories` does this in a background thread; doing it
            # here, before the manager opens, leaves the directory tidy when __init__ returns.
            for name in _remove_tmp_dirs(self.directory):
                logging.warning("Removed %s/%s, left by an interrupted save", self.directory, name)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """Checkpoint steps, oldest first, not yet validated.

        Those found on disk when this Checkpointer opened plus those it saved since (an async
        one may still be in flight; see `wait`); never a save that died before its final rename.
        """
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest of `all_steps()`, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict, *, force: bool = True) -> None:
        """Writes `state` and `meta` as checkpoint `step`, replacing one already there.

        `meta` gets `step`, `mptrain_version`, `fingerprint` and `arrays` (each leaf's dtype and
        shape) added; values JSON cannot hold are stored as their `str()`. `force=False` lets
        orbax's save policy skip the step (the trainer passes True: it decides when to save).
        Blocks until the files are durable unless the Checkpointer was made with
        `async_save=True`.
        """
        step = int(step)
        if not force and not self._manager.should_save(step):
            return
        meta = dict(files.to_jsonable(meta))
        meta.setdefault("step", step)
        meta["mptrain_version"] = version.__version__
        meta["fingerprint"] = fingerprints.fingerprint(state)
        meta["arrays"] = fingerprints.array_specs(state)
        if step in self._manager.all_steps():
            # Re-saving a step happens after resuming past a rejected checkpoint: the fresh
            # state must replace the bad one, or every later resume would reject it again.
            logging.info("Replacing the checkpoint at step %d in %s", step, self.directory)
            self._manager.wait_until_finished()
            self._manager.delete(step)
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}
        )
        self._manager.save(step, args=args, force=True)
        if not self.async_save:
            self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """Restores the newest valid checkpoint, or checkpoint `step`, into `abstract_state`.

        `abstract_state` is the target pytree: a freshly created state, or its `jax.eval_shape`
        (whose leaves may carry shardings). The restored state has the target's pytree classes,
        dtypes and, where given, shardings. Returns `(state, meta)`, or None when the directory
        holds no checkpoint. Unusable checkpoints are skipped with a warning; if every one is
        unusable, or the given `step` is, raises `InvalidCheckpointError` (starting over would
        silently discard the run). Raises `CheckpointMismatchError` when a checkpoint's arrays
        do not match the target's, and FileNotFoundError when `step` does not exist.
        """
        self.wait()
        self._manager.reload()  # the directory may have changed behind the manager's back
        steps = self.all_steps()
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(
                    f"no checkpoint at step {step} in {self.directory}; steps there: {steps}"
                )
            try:
                return self._restore_step(int(step), abstract_state)
            except InvalidCheckpointError as e:
                raise InvalidCheckpointError(f"checkpoint at step {step} is unusable: {e}") from e
        reasons = []
        for candidate in reversed(steps):
            try:
                return self._restore_step(candidate, abstract_state)
            except InvalidCheckpointError as e:
                reasons.append(f"step {candidate}: {e}")
                logging.warning(
                    "Skipping checkpoint at step %d in %s: %s", candidate, self.directory, e
                )
        if reasons:
            raise InvalidCheckpointError(
                f"none of the {len(reasons)} checkpoints in {self.directory} is usable ("
                + "; ".join(reasons)
                + "); move them away to start over"
            )
        return None

    def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores and validates one checkpoint; InvalidCheckpointError says what is wrong."""
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
            )[META_ITEM]
        except Exception as e:  # orbax and tensorstore raise many types for unreadable files
            raise InvalidCheckpointError(f"cannot read meta: {_summary(e)}") from e
        if not isinstance(meta, dict) or "fingerprint" not in meta:
            raise InvalidCheckpointError("meta holds no fingerprint")
        _check_specs(step, meta.get("arrays"), fingerprints.array_specs(abstract_state))
        try:
            state = self._manager.restore(
                step,
                args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)}),
            )[STATE_ITEM]
        except Exception as e:
            raise InvalidCheckpointError(f"cannot read state: {_summary(e)}") from e
        found = fingerprints.fingerprint(state)
        if found != meta["fingerprint"]:
            raise InvalidCheckpointError(
                f"data do not match the fingerprint saved with them (saved "
                f"{meta['fingerprint']}, read {found})"
            )
        bad = fingerprints.nonfinite_params(state)
        if bad:
            raise InvalidCheckpointError(f"non-finite params in {', '.join(bad)}")
        return state, meta

    def wait(self) -> None:
        """Blocks until pending asynchronous saves (and deletions of old steps) are done."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending work and releases orbax's threads."""
        self._manager.close()


def _check_specs(step: int, saved: Any, wanted: dict[str, str]) -> None:
    if not isinstance(saved, dict):
        raise InvalidCheckpointError("meta holds no array specs")
    if saved == wanted:
        return
    diffs = [
        f"{path}: saved {saved.get(path, 'nothing')}, expected {wanted.get(path, 'nothing')}"
        for path in list(wanted) + [p for p in saved if p not in wanted]
        if saved.get(path) != wanted.get(path)
    ]
    shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
    raise CheckpointMismatchError(
        f"checkpoint at step {step} does not fit the state being restored ({shown}); was the "
        "model, optimizer or precision policy changed? Use a new workdir for a new setup."
    )


def _remove_tmp_dirs(directory: str | os.PathLike) -> list[str]:
    """Deletes leftovers of interrupted saves (`*.orbax-checkpoint-tmp*`) in `directory`."""
    directory = os.fspath(directory)
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        if re.fullmatch(rf"\d+{re.escape(TMP_SUFFIX)}.*", name):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(name)
    return removed


def resume(checkpointer: Checkpointer, state: Any, policy, config: dict) -> tuple[Any, int | None]:
    """`(state, step)` of the newest valid checkpoint, or `(state, None)` when there is none.

    A checkpoint of another model, optimizer or precision policy is a `WorkdirError`; a config
    key that changed since the checkpoint (say, the learning rate) is allowed and logged.
    """
    try:
        restored = checkpointer.restore(state)
    except CheckpointMismatchError as e:
        raise errors.WorkdirError(
            f"the checkpoints in {checkpointer.directory} belong to a different model, "
            f"optimizer or precision: {e}. Use another --workdir to start a new run"
        ) from None
    except InvalidCheckpointError as e:
        raise errors.WorkdirError(str(e)) from None
    if restored is None:
        return state, None
    state, meta = restored
    saved_policy = meta.get("policy")
    if saved_policy is not None and saved_policy != str(policy):
        raise errors.WorkdirError(
            f"the checkpoint at step {meta.get('step')} was trained with precision "
            f"'{saved_policy}', the config asks for '{policy}'; resuming would recast "
            "the master params. Use another --workdir, or the old precision"
        )
    for key, (old, new) in config_lib.changes(meta.get("config") or {}, config).items():
        logging.info("mptrain: config.%s changed since the checkpoint: %r -> %r", key, old, new)
    return state, int(meta["step"])


# --------------------------------------------------------------------------- export


def save_standalone(directory: str | os.PathLike, params: Any, sidecar: dict) -> None:
    """Writes `params` (numpy arrays) as a plain orbax checkpoint in `directory/params`, and
    `sidecar` as `directory/export.json`; all or nothing (written beside, then renamed)."""
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        checkpointer = ocp.PyTreeCheckpointer()
        checkpointer.save(os.path.join(staging, "params"), params)
        checkpointer.close()
        files.write_json(os.path.join(staging, "export.json"), sidecar)
        if os.path.isdir(directory):  # an empty folder the user made for it
            os.rmdir(directory)
        os.rename(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load_standalone(directory: str | os.PathLike) -> Any:
    """An exported `params` tree as numpy arrays (what plain orbax gives)."""
    path = os.path.join(os.path.abspath(directory), "params")
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
