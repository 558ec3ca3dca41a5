"""Initialising a run from pretrained weights: `config.init_from`, the params of step 0.

`config.init_from` names one of:
- a HuggingFace Llama folder (`hf.is_hf_folder`: a config.json and *.safetensors);
- an mptrain workdir (a `checkpoints/` folder): its newest checkpoint;
- one checkpoint of a workdir, `<workdir>/checkpoints/<step>`.

Only the params come from there. The optimizer state, the step, the loss scale and the rng
start fresh, exactly as in a run from the model's own init (the fresh state is made as usual
and its params replaced: mptrain's optimizers start their moments and counts at zero whatever
the params hold). The params take the dtypes of the new state's: fp32 masters, which bf16 or
fp16 weights become exactly; bf16 under bf16-pure (fp32 weights rounded to nearest even).

A workdir with checkpoints of its own resumes from them and never reads `init_from` again (the
folder may be gone by then); the start-up log says which happened: "initialised from DIR (HF
Llama, N params)" or "resuming from step S; init_from not read".

`read` runs before anything compiles or touches the workdir (the Trainer calls it before it
takes the workdir's lock), so every bad input is one `ConfigError` line (exit 2) and leaves no
workdir behind: a path that does not exist or is none of the three; a `config.model` key that
disagrees with the weights, named with both values (an HF folder's config.json as
`hf.read_config` reads it; an mptrain checkpoint's own config); a checkpoint whose params are
laid out otherwise (scanned against unscanned layers, other shapes); a tensor missing, of
another shape, unreadable or not finite. Keys that are the run's own choice and leave the
weights' meaning alone (`RUN_CHOICES`) may differ.

At scale no host holds the whole model: the params are made straight in the state's
shardings, each process reading only the slices its own devices hold (`hf.load_params` reads
safetensors slices; `checkpoint.Checkpointer.restore_params`, orbax shards). Read before the
workdir is touched, they share the devices with the fresh state for a moment, until its own
params are deleted: one more copy of the params (4 bytes a param for fp32 masters) beside
AdamW's 12, less than the gradients a train step holds beside the state anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
from absl import logging

from mptrain import config as config_lib
from mptrain import errors
from mptrain.models import lora as lora_lib
from mptrain.parallel import sharding
from mptrain.train import adapters, checkpoint, checkpoint_meta, fingerprints

# Model keys a run may set otherwise than the weights it starts from: how the step computes
# (attention kernel, scanned or not, rematerialisation, dropout, batch-norm momentum) and the
# longest sequence RoPE is asked for, which no weight depends on. A checkpoint's tree still
# has to fit: scanned layers are one stack, unscanned ones `layers_i` (checked apart).
RUN_CHOICES = frozenset(
    {"attention", "scan_layers", "remat", "dropout_rate", "bn_momentum", "max_len"}
)
FORMS = (
    "a HuggingFace folder of a decoder mptrain reads (config.json and *.safetensors), an "
    "mptrain workdir (with "
    "checkpoints/) or one of its checkpoints (checkpoints/<step>)"
)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """The params `read` made for step 0, in the state's shardings and dtypes, and where they
    came from, for the start-up line (`DIR (HF Qwen3ForCausalLM, N params)`)."""

    params: Any
    origin: str


def has_own_checkpoints(workdir: str | os.PathLike) -> bool:
    """Whether `workdir` holds finished checkpoints (`checkpoints/<step>`, read without orbax:
    a reader must not open another run's directory), from which a run resumes instead."""
    folder = Path(workdir) / "checkpoints"
    return folder.is_dir() and any(name.isdigit() for name in os.listdir(folder))


def read(trainer: Any, train_source: Any) -> Pretrained | None:
    """Host-side, before the workdir is touched: `config.init_from`'s params for `trainer`'s
    state (its abstract state from `make_init`, traced, not compiled), or None when no
    `init_from` is set or the workdir has checkpoints of its own. Bad input: `ConfigError`."""
    config = trainer.config
    lora = lora_lib.enabled(config)  # the frozen base is read on every start, resumes too
    if config.get("init_from") is None or (has_own_checkpoints(trainer.workdir) and not lora):
        return None
    init, args = trainer.make_init(train_source.get_batch(0))
    state = jax.eval_shape(init, *args)
    if lora:
        return load(config, adapters.base_target(state.frozen, trainer.policy.compute_dtype))
    return load(config, abstract(state.params))


def abstract(params: Any) -> Any:
    """`jax.ShapeDtypeStruct`s with the shardings of `params` (arrays or abstract ones)."""
    as_struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.tree.map(as_struct, params)


def load(config: Any, target: Any) -> Pretrained:
    """`config.init_from`'s params made into `target` (abstract params with shardings; the
    module doc says what is checked on the way). Raises `errors.ConfigError`."""
    from mptrain import hf, hub
    from mptrain.hf import families

    where = f"config.init_from={config.init_from!r}"
    path = Path(hub.folder(config.init_from, hub.WEIGHTS, "config.init_from"))
    if not path.exists():
        raise errors.ConfigError(f"{where}: no such folder; expected {FORMS}")
    try:
        if not hf.is_hf_folder(path):
            return _from_checkpoint(path, config, target, where)
        with _naming(where):  # hf's one line names the file and the key or tensor
            model = hf.read_config(path)
        check_model(config.model, model, f"{path / 'config.json'}", where)
        with _naming(where):
            params = hf.load_params(path, target, scan_layers=sharding.STACKED in target)
        if bad := fingerprints.nonfinite_params({"params": params}):  # as for a checkpoint's
            raise errors.ConfigError(f"{where}: non-finite params in {', '.join(bad)}")
        architecture = families.FAMILIES[model["family"]].architecture  # Qwen3ForCausalLM, ...
        return Pretrained(params, f"{path} (HF {architecture}, {_count(params):,} params)")
    except OSError as e:  # a folder that cannot be listed or read, whichever reader says so
        what = f"{where}: cannot read {e.filename or path}: {e.strerror or e}"
        raise errors.ConfigError(what) from None


@contextlib.contextmanager
def _naming(where: str):
    """A `ConfigError` raised within, prefixed with `where` (the key that led there)."""
    try:
        yield
    except errors.ConfigError as e:
        raise errors.ConfigError(f"{where}: {e}") from None


def _from_checkpoint(path: Path, config: Any, target: Any, where: str) -> Pretrained:
    """An mptrain checkpoint's params: the newest of a workdir's, or the one `path` names."""
    if (path / "checkpoints").is_dir():
        directory, step = path / "checkpoints", None
    elif path.name.isdigit() and (path / checkpoint.STATE_ITEM).is_dir():
        directory, step = path.parent, int(path.name)
    else:
        raise errors.ConfigError(f"{where}: not {FORMS}")
    with checkpoint.Checkpointer(directory, read_only=True) as checkpointer:
        steps = checkpointer.all_steps()
        if not steps or (step is not None and step not in steps):
            raise errors.ConfigError(f"{where}: no finished checkpoint in {directory}")
        step = steps[-1] if step is None else step
        try:
            meta = checkpointer.read_meta(step)
            saved = (meta["config"] or {}).get("model") or {}
            check_model(config.model, saved, f"{directory / str(step)}", where)
            _check_tree(meta["arrays"], target, saved, config.model, where)
            params = checkpointer.restore_params(step, target)
        except checkpoint.InvalidCheckpointError as e:
            raise errors.ConfigError(f"{where}: checkpoint {step} is unusable: {e}") from None
    if bad := fingerprints.nonfinite_params({"params": params}):
        raise errors.ConfigError(f"{where}: non-finite params in {', '.join(bad)}")
    return Pretrained(
        params, f"{path} (mptrain checkpoint of step {step}, {_count(params):,} params)"
    )


def check_model(mine: Any, theirs: dict, source: str, where: str) -> None:
    """A `ConfigError` naming the first `config.model` key (beside `RUN_CHOICES`) whose value
    differs from `theirs`, the model section the weights in `source` were made with; keys left
    unset on either side count as their model's defaults."""
    mine, theirs = _resolved(config_lib.to_dict(mine)), _resolved(dict(theirs))
    if mine.get("name") != theirs.get("name"):
        raise errors.ConfigError(
            f"config.model.name={mine.get('name')!r}: {where} holds a {theirs.get('name')!r} "
            f"model ({source}); set --config.model.name={theirs.get('name')!r} and its keys"
        )
    keys = (set(mine) & set(theirs)) - RUN_CHOICES
    changed = checkpoint_meta.changes({k: theirs[k] for k in keys}, {k: mine[k] for k in keys})
    if changed:
        key, (weights, asked) = next(iter(changed.items()))
        more = f" (and {len(changed) - 1} more keys)" if len(changed) > 1 else ""
        raise errors.ConfigError(
            f"config.model.{key}={asked!r}: the weights of {where} have {key}={weights!r}"
            f"{more} ({source}); set --config.model.{key}={weights!r}"
            + (", or use --config=configs/llama3.py:hf=DIR" if "config.json" in source else "")
        )


def _resolved(model: dict) -> dict:
    """A model section with its module's defaults for the keys it leaves unset, and a Llama's
    `head_dim` worked out as its module does (None: d_model / num_heads)."""
    from mptrain import models

    if model.get("name") in models.modules():
        defaults = models.import_model(model["name"]).CONFIG_KEYS
        unset = {key: value for key, value in defaults.items() if model.get(key) is None}
        model = model | unset
    if model.get("head_dim", 0) is None and model.get("num_heads"):
        model["head_dim"] = model["d_model"] // model["num_heads"]
    return model


def _check_tree(arrays: dict, target: Any, saved: dict, model: Any, where: str) -> None:
    """A `ConfigError` when the checkpoint's params (`arrays`, its meta's) do not fit `target`
    by path and shape (dtypes convert on the way in)."""
    wanted = {f".params{k}": v for k, v in fingerprints.array_specs(target).items()}
    found = {k: v for k, v in arrays.items() if k.startswith(".params[")}
    if diffs := checkpoint_meta.differences(found, wanted, dtypes=False):
        hint = "the model's shapes differ"
        scanned, asked = saved.get("scan_layers"), model.get("scan_layers")
        if scanned is not None and asked is not None and scanned != asked:
            hint = (
                f"its layers are {'one stack' if scanned else 'layers_i'} (model.scan_layers="
                f"{scanned}), this run's {'one stack' if asked else 'layers_i'}; set "
                f"--config.model.scan_layers={scanned}"
            )
        raise errors.ConfigError(
            f"{where}: the checkpoint's params are laid out otherwise than this run's: {hint} "
            f"({checkpoint_meta.shown(diffs, 3)})"
        )


def _count(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def resume(checkpointer, state, policy, config, pretrained: Pretrained | None = None):
    """`checkpoint.resume`'s `(state, step, meta)`; when the workdir has no checkpoint and
    `config.init_from` is set, the fresh `state` with `pretrained`'s params, or, when None
    (a caller of `Trainer.setup` that did not `read` first), with params read now into the
    state's shardings. The fresh params are deleted before the new ones take their place."""
    if config.get("init_from") is not None and jax.tree.leaves(state.frozen):
        # adapters: the base is the folder's, before the checkpoint is checked against it
        target = adapters.base_target(state.frozen, policy.compute_dtype)
        pretrained = pretrained or load(config, target)
        logging.info("mptrain: the frozen base is %s", pretrained.origin)
        state = adapters.with_base(state, pretrained.params)
        return checkpoint.resume(checkpointer, state, policy, config_lib.to_dict(config))
    state, step, meta = checkpoint.resume(checkpointer, state, policy, config_lib.to_dict(config))
    if config.get("init_from") is None:
        return state, step, meta
    if step is not None:
        logging.info("mptrain: resuming from step %d; init_from not read", step)
        for x in jax.tree.leaves(pretrained.params if pretrained else ()):
            x.delete()
        return state, step, meta
    target = abstract(state.params)
    for x in jax.tree.leaves(state.params):
        x.delete()
    pretrained = pretrained or load(config, target)
    logging.info("mptrain: initialised from %s", pretrained.origin)
    return state.replace(params=pretrained.params), step, meta


def with_run_base(trainer: Any, state: Any, meta: dict, fresh: Any, where: str) -> Any:
    """A LoRA run's `state` restored from its checkpoint at `where` (`meta`; the frozen base
    abstract) with its base: `config.init_from`'s, else `fresh()`'s (the model's own init),
    checked against the fingerprint the checkpoint names. Without adapters, `state`."""
    if not jax.tree.leaves(state.frozen):
        return state
    config = trainer.config
    if config.get("init_from") is None:
        state = state.replace(frozen=fresh().frozen)
    else:
        target = adapters.base_target(state.frozen, trainer.policy.compute_dtype)
        state = adapters.with_base(state, load(config, target).params)
    adapters.check_base(meta, state, where, config.get("init_from"))
    return state
