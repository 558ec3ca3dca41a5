"""Checkpoints: save, validate, restore and fall back. The only module that imports orbax.

Layout, under the directory given to `Checkpointer` (the trainer uses `<workdir>/checkpoints`)::

    <step>/state/   the TrainState pytree (orbax StandardSave: OCDBT + zarr, one entry per leaf)
    <step>/meta/    JSON: step, config, policy, mptrain version, the state's fingerprint and
                    the dtype and shape of every array leaf

Saving is atomic: orbax writes `<step>.orbax-checkpoint-tmp/` and renames it to `<step>/` once
every file is written, so a save that died leaves such a folder, never listed as a step. To
anyone but the run that owns the directory it may be a save in progress: that run deletes them
(`resume` calls `remove_leftovers`); readers such as export open it `read_only` and never write
or delete there. A save that fails on storage (full, read-only, denied), whichever layer says
so and whenever (an async save's failure shows at `wait`, the next `save` or `close`), is one
`errors.StorageError` naming the checkpoint and the cause; older checkpoints stay intact.

Restoring validates what it reads: `meta` holds `fingerprint(state)`, a sha256 over every array
leaf's path, dtype, shape and two position-aware sums of its elements' bits (computed on the
devices, shard by shard, so a sharded state is never gathered to a host), recomputed on the
restored arrays. A checkpoint is skipped, with a warning naming the step and the reason, when
orbax cannot read it (missing, truncated or mangled files), its meta is corrupt, the fingerprint
differs (bytes flipped on disk) or its params hold a NaN or an inf; `restore` then tries the
next older one. A checkpoint whose arrays do not fit the requested state (another model,
optimizer or precision policy) is not corrupt but a mistake: `CheckpointMismatchError`.

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

import contextlib
import dataclasses
import logging as std_logging
import os
import re
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint._src.metadata import array_metadata_store

from mptrain import errors, files, version
from mptrain.train import adapters, checkpoint_meta, fingerprints

STATE_ITEM = "state"
META_ITEM = "meta"
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class InvalidCheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be used: unreadable, corrupt or non-finite."""


class CheckpointMismatchError(ValueError):
    """A readable checkpoint whose arrays do not fit the state it is restored into."""


# Each orbax thread that sees a write fail logs it (a hundred lines of traceback) before orbax
# raises it to its caller; `Checkpointer` and the export raise it as one line.
files.quiet_storage_failures("/orbax/")


def _summary(error: Exception, limit: int = 300) -> str:
    """The first line of an error, shortened: tensorstore errors carry a page-long spec."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:limit]}{' ...' if len(first) > limit else ''}"


def use_async(setting: bool | None, platform: str) -> bool:
    """`config.checkpoint_async`, with None resolved for the devices' `platform`: background
    saves on an accelerator, whose state is copied to host memory and written by host cores the
    step does not use; foreground saves on a CPU, where the copy and the write share the step's
    memory and cores (scripts/checkpoint_stall.py: the steps during a background write lost
    more than the save call it shortened)."""
    if setting is not None:
        return bool(setting)
    return platform != "cpu"


def _write_each_shard_whole() -> None:
    """On one process, orbax writes each array shard whole, from its first replica: its
    replica-parallel writing (on by default except on GPUs) slices replicated shards among the
    devices holding them, which on one host spreads nothing and costs a compiled slice per array
    and save (72 on a data 2 x fsdp 4 Llama's two saves: 3.3 s of its 4-step run, 1.3 s
    without). The same arrays are written; across processes orbax's default stays."""
    global _WHOLE_SHARDS
    if _WHOLE_SHARDS:
        return
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(), use_replica_parallel=False
    )  # orbax's own registration, less the replica-parallel writing
    absl = std_logging.getLogger("absl")  # orbax warns of the override: meant, not news
    level = absl.level
    absl.setLevel(std_logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)
    _WHOLE_SHARDS = True


_WHOLE_SHARDS = False  # whether `_write_each_shard_whole` has registered its handler


class Checkpointer:
    """Saves and restores `(state, meta)` pairs under `directory`, one folder per step.

    `max_to_keep`: how many of the newest checkpoints to keep (None: all). `async_save`: when
    True, `save` returns once the state's fingerprint is taken and its arrays are copied to host
    memory, and orbax writes the files in the background while training goes on (the state may
    then be donated to the next step); `check()` between steps raises a failed write's
    `StorageError` as soon as it is known, `wait()` (or `close()`) blocks until the files are
    durable. Every read (`restore`, `read_meta`, `restore_params`) waits first: no checkpoint is
    read before it is complete. `read_only`: for
    readers of another run's directory; nothing is created, pruned or written. Every process of
    a multi-host job must call `save` and `restore` together.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = False,
        read_only: bool = False,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep}; must be None (keep all) or >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        self.async_save, self.read_only = async_save, read_only
        # (orbax's read_only option warns at every open; this manager writes nothing either)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
        )
        self._pending: int | None = None  # a saved step not known to be written yet
        self._failed = False  # whether a StorageError was raised
        if jax.process_count() == 1:
            _write_each_shard_whole()
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """Checkpoint steps, oldest first, not yet validated: those on disk when this opened and
        those saved since (an async one may be in flight); never a save that died unfinished."""
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
        Blocks until the files are durable unless `async_save`; a storage failure raises
        `errors.StorageError`.
        """
        if self.read_only:
            raise ValueError(f"{self.directory} is open read-only: a reader never writes there")
        step = int(step)
        if not force and not self._manager.should_save(step):
            return
        meta = dict(files.to_jsonable(meta))
        meta.setdefault("step", step)
        meta["mptrain_version"] = version.__version__
        if base := adapters.fingerprint(state):  # a frozen base is named, never saved
            meta[adapters.BASE], state = base, state.replace(frozen={})
        meta["fingerprint"] = fingerprints.fingerprint(state)
        meta["arrays"] = fingerprints.array_specs(state)
        self.wait()  # a failure of the previous save is told as that step's
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(_tree(state)), META_ITEM: ocp.args.JsonSave(meta)}
        )
        with self._writing(step):
            if step in self._manager.all_steps():
                # Re-saving a step happens after resuming past a rejected checkpoint: the fresh
                # state must replace the bad one, or every later resume would reject it again.
                logging.info("Replacing the checkpoint at step %d in %s", step, self.directory)
                self._manager.delete(step)
            self._pending = step
            self._manager.save(step, args=args, force=True)
            if not self.async_save:
                self._manager.wait_until_finished()
                self._pending = None

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """A storage failure of saving `step` (None: what is pending) as one StorageError."""
        try:
            yield
        except Exception as e:
            where = f"{self.directory}/{step}"
            what = self.directory if step is None else f"the checkpoint of step {step} ({where})"
            kept = [s for s in self.all_steps() if s != step]
            older = f"the older ones are intact (steps {kept})" if kept else "there is no older one"
            error = files.storage_error(e, what, f"; {older}")
            if error is None:
                raise
            self._pending, self._failed = None, True
            _quiet_unretrieved()
            raise error from e

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """Restores the newest valid checkpoint, or checkpoint `step`, into `abstract_state`: a
        fresh state or its `jax.eval_shape` (leaves may carry shardings), whose pytree classes,
        dtypes and shardings the result takes. Returns `(state, meta)`, or None when there is no
        checkpoint. Unusable ones are skipped with a warning; if all are, or the given `step` is,
        `InvalidCheckpointError` (starting over would silently discard the run). Arrays that do
        not fit the target: `CheckpointMismatchError`; a `step` not there: FileNotFoundError.
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
            why = "; ".join(reasons)
            raise InvalidCheckpointError(
                f"none of the {len(reasons)} checkpoints in {self.directory} is usable ({why}); "
                "move them away to start over"
            )
        return None

    def read_meta(self, step: int) -> dict:
        """Checkpoint `step`'s meta, checked; InvalidCheckpointError says what is wrong."""
        path = os.path.join(self.directory, str(step), META_ITEM)
        self.wait()  # never read a checkpoint still being written
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
            )[META_ITEM]
        except Exception as e:  # orbax and tensorstore raise many types for unreadable files
            raise InvalidCheckpointError(f"cannot read {path}: {_summary(e)}") from e
        if problem := checkpoint_meta.problem(meta, step):
            raise InvalidCheckpointError(f"{path} is corrupt: {problem}")
        return meta

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Checkpoint `step`'s params alone (for `init_from`: never the optimizer state), each
        leaf in `abstract_params`' dtype and sharding, so a process reads only its devices'
        shards. The fingerprint covers the whole state: callers check `read_meta`'s `arrays`."""
        to_args = lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype)
        args = {"params": jax.tree.map(to_args, abstract_params)}
        self.wait()
        item = ocp.args.PyTreeRestore({"params": abstract_params}, args, partial_restore=True)
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(state=item))["state"]
        except Exception as e:  # orbax and tensorstore raise many types for unreadable files
            raise InvalidCheckpointError(f"cannot read params: {_summary(e)}") from e
        return state["params"]

    def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores and validates one checkpoint; InvalidCheckpointError says what is wrong. A
        frozen base is not in it: the result has `abstract_state`'s (`adapters`)."""
        if frozen := getattr(abstract_state, "frozen", None):
            state, meta = self._restore_step(step, abstract_state.replace(frozen={}))
            return state.replace(frozen=frozen), meta
        meta = self.read_meta(step)
        _check_specs(step, meta["arrays"], fingerprints.array_specs(abstract_state))
        try:
            item = ocp.args.StandardRestore(_tree(abstract_state))
            state = self._manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: item}))
            state = _untree(abstract_state, state[STATE_ITEM])
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

    def in_flight(self) -> int | None:
        """The step of an asynchronous save whose files are still being written, or None."""
        return self._pending if self._manager.is_saving_in_progress() else None

    def check(self) -> None:
        """Host-side and cheap enough for every step: raises the `StorageError` of a background
        save as soon as it has failed, without waiting for one still being written."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Blocks until pending asynchronous saves (and deletions of old steps) are done."""
        with self._writing(self._pending):
            self._manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        """Waits, then releases orbax's threads (a failure raised already is not raised again)."""
        told = self._failed
        try:
            with self._writing(self._pending):
                self._manager.close()
        except errors.StorageError:
            if not told:
                raise

    def remove_leftovers(self) -> list[str]:
        """Deletes the leftovers of interrupted saves (`<step>.orbax-checkpoint-tmp*`): only for
        the run that holds the directory, to anyone else they may be its saves in progress."""
        if jax.process_index() != 0 or not os.path.isdir(self.directory):
            return []
        removed = []
        for name in sorted(os.listdir(self.directory)):
            if re.fullmatch(rf"\d+{re.escape(TMP_SUFFIX)}.*", name):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                logging.warning("Removed %s/%s, left by an interrupted save", self.directory, name)
                removed.append(name)
        return removed


# What asyncio logs, at the loop's end or when the garbage collector takes them, of the write
# tasks of a failed save whose exceptions nobody awaited: orbax writes a checkpoint's arrays in
# several tasks, and raises the first failure, which the run tells in one line
_UNRETRIEVED = ("Task exception was never retrieved", "Future exception was never retrieved")


class _ToldAlready(std_logging.Filter):
    """Drops asyncio's record of an unretrieved storage failure (`files.storage_cause`): the
    failed save's one StorageError line said it. Any other unretrieved exception is kept."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        told = isinstance(error, Exception) and files.storage_cause(error) is not None
        return not (told and record.getMessage().startswith(_UNRETRIEVED))


def _quiet_unretrieved() -> None:
    """Once a save has failed (sweep 2026-12-06, F01: 13 lines of asyncio's "Task exception
    was never retrieved" and an orbax traceback after the one line, 1 run of 2)."""
    asyncio_log = std_logging.getLogger("asyncio")
    if not any(isinstance(f, _ToldAlready) for f in asyncio_log.filters):
        asyncio_log.addFilter(_ToldAlready())


def _tree(state: Any) -> Any:
    """What a checkpoint's `state` item holds of `state`: a `TrainState`'s array fields by name,
    as orbax writes any dataclass, without `frozen` (a LoRA run's base, never saved), so a
    checkpoint of any mptrain version restores into any other's state."""
    if not dataclasses.is_dataclass(state) or not hasattr(state, "frozen"):
        return state
    fields = dataclasses.fields(state)
    return {
        f.name: getattr(state, f.name)
        for f in fields
        if f.metadata.get("pytree_node", True) and f.name != "frozen"
    }


def _untree(like: Any, tree: Any) -> Any:
    """`_tree`'s inverse: `like` (a state) with the restored fields of `tree`."""
    return like.replace(**tree) if isinstance(tree, dict) and hasattr(like, "frozen") else tree


def _check_specs(step: int, saved: dict, wanted: dict[str, str]) -> None:
    if diffs := checkpoint_meta.differences(saved, wanted):
        raise CheckpointMismatchError(
            f"checkpoint at step {step} does not fit the state being restored "
            f"({checkpoint_meta.shown(diffs)}); was the model, optimizer or precision policy "
            "changed?"
        )


def check_continues(checkpointer: Checkpointer, policy, config: dict) -> None:
    """Refuses, before any state is built or compiled, a config that the newest checkpoint's
    run cannot continue (`checkpoint_meta.check_resumable`: another model key, precision or
    adapters, or fewer steps): one line, in seconds. A meta that does not read is `resume`'s to
    skip."""
    if steps := checkpointer.all_steps():
        with contextlib.suppress(InvalidCheckpointError):
            meta = checkpointer.read_meta(steps[-1])
            where = f"{checkpointer.directory}/{steps[-1]}"
            checkpoint_meta.check_resumable(meta, str(policy), config, where, tell=False)


def resume(checkpointer: Checkpointer, state: Any, policy, config: dict) -> tuple[Any, Any, Any]:
    """`(state, step, meta)` of the newest valid checkpoint, else `(state, None, None)`.
    For the run that holds the directory: once the checkpoint is accepted it removes leftovers
    of interrupted saves. Checkpoints whose arrays do not fit `state` (another model shape,
    optimizer or precision) are a `WorkdirError`; a checkpoint that fits but was trained with
    other model keys or another precision, or is past `num_train_steps`, a `ConfigError` (the
    directory untouched either way); other changed keys (learning rate, intervals, ...) are
    allowed and logged."""
    try:
        restored = checkpointer.restore(state)
    except CheckpointMismatchError as e:
        check_continues(checkpointer, policy, config)  # a changed key that explains it, first
        raise errors.WorkdirError(
            f"the checkpoints in {checkpointer.directory} belong to a different model, "
            f"optimizer or precision: {e} Use another --workdir to start a new run"
        ) from None
    except InvalidCheckpointError as e:
        raise errors.WorkdirError(str(e)) from None
    step = meta = None
    if restored is not None:
        state, meta = restored
        step, where = int(meta["step"]), f"{checkpointer.directory}/{meta['step']}"
        checkpoint_meta.check_resumable(meta, str(policy), config, where)
        adapters.check_base(meta, state, where, config.get("init_from"))
    checkpointer.remove_leftovers()
    return state, step, meta
