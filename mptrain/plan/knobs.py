"""The knobs `--fit` turns that change the run's shape (`mptrain.plan.search`): the mesh, the
micro-batches (and the context split that takes a micro-batch of fewer rows than devices), the
loss's chunks, the remat ladder, and across nodes a tensor group within each.

A mesh is proposed only where the run can take it, which the rules that decide a real run's
say (`refused`): the mesh's own (`layout.mesh_shape`: the devices and the batch's rows) and the
model's (its record, `models.mesh_refusal`: which axes it splits over, what they need of its
sizes and the data); none is restated here. `devices`: what the search compiles for (None:
this host's), by which a model chooses its attention (cuDNN's split attention takes no packed
rows).
"""

from __future__ import annotations

import copy
from typing import Any

REMAT = ("none", "minimal_with_context", "minimal", "full")  # light to heavy
CHUNK = 256  # loss.chunk_tokens the free knob sets


def get(config, key: str, default=None):
    """`config`'s dotted `key`, or `default` where a section lacks it."""
    section = config
    for part in key.split("."):
        if part not in section:
            return default
        section = section[part]
    return section


def changed(config, knobs: dict[str, Any]):
    """A copy of `config` with `knobs` set (a model key left at its default included)."""
    from mptrain import config as config_lib

    found = copy.deepcopy(config)
    with found.unlocked():
        config_lib.override(found, knobs)
    return found


def refused(config, knobs: dict[str, Any], count: int, devices: Any = None) -> str | None:
    """Why `config` with `knobs` set cannot run on `count` devices (the mesh's rules, then the
    model's: the module doc), or None where it can."""
    import jax
    import numpy as np

    from mptrain import config as config_lib
    from mptrain import data, errors, models
    from mptrain.parallel import layout

    candidate = changed(config, knobs)
    try:
        layout.mesh_shape(candidate.mesh, candidate.batch_size, count)
        policy = config_lib.policy_of(candidate)
    except ValueError as e:
        return errors.first_line(e)
    try:  # one example's shapes; a data key's own error is the run's validation's to tell
        example = data.check_config(candidate)
    except ValueError:
        length = get(candidate, "data.seq_len")
        example = {"inputs": jax.ShapeDtypeStruct((1, length), np.int32)} if length else None
    return models.mesh_refusal(candidate, policy, devices, example)


def mesh(config, count: int, devices: Any = None) -> dict[str, Any]:
    """The mesh `count` devices need where the config's does not divide them: all FSDP, and
    where the batch has fewer rows than that, the rest splitting each sequence (`split`)."""
    data, fsdp = get(config, "mesh.data", -1), get(config, "mesh.fsdp", 1)
    context, expert = get(config, "mesh.context", 1), get(config, "mesh.expert", 1)
    tensor = get(config, "mesh.tensor", 1)
    fixed = fsdp * expert * context * tensor  # the axes other than data
    fits = count % fixed == 0 and (data == -1 or data * fixed == count)
    if fits and config.batch_size % (count // (context * tensor)) == 0:
        return {}
    kept = count % expert == 0 and expert > 1  # an expert axis stays: the rest FSDP
    every = {"mesh.data": -1, "mesh.fsdp": count // expert} if kept else {}
    found = split(config, config.batch_size, count, devices)
    return found or every or {"mesh.data": -1, "mesh.fsdp": count}


def sharded(config, count: int, knobs: dict[str, Any]) -> dict[str, Any]:
    """The mesh of `knobs` (over the config's) with its data axis folded into fsdp: each device
    then holds 1 / (data x fsdp) of the state where it held 1 / fsdp, for the same rows a device
    and no FLOPs more; {} where data is 1 already."""
    at = lambda key, default: knobs.get(key, get(config, key, default))
    fsdp = at("mesh.fsdp", 1)
    others = at("mesh.expert", 1) * at("mesh.context", 1) * at("mesh.tensor", 1)
    data = at("mesh.data", -1)
    data = count // (fsdp * others) if data == -1 else data
    return {"mesh.data": 1, "mesh.fsdp": data * fsdp} if data > 1 else {}


def split(config, rows: int, count: int, devices: Any = None) -> dict[str, Any] | None:
    """A mesh of `count` devices for a batch of `rows` sequences fewer than the devices: FSDP
    over the rows, each sequence split over the rest (`mesh.context`), params over all; {}
    where the rows cover the devices; None where no split can take them (`refused`; not
    searched beside an expert axis)."""
    if rows % count == 0:
        return {}
    context = count // rows if rows and count % rows == 0 else 0
    if not context or get(config, "mesh.expert", 1) != 1:
        return None
    knobs = {"mesh.data": 1, "mesh.fsdp": rows, "mesh.context": context}
    return None if refused(config, knobs | {"batch_size": rows}, count, devices) else knobs


def tensor(config, count: int, node: int, devices: Any = None) -> dict[str, Any]:
    """Across nodes (`count` devices, more than one `node` of them): the layers split over a
    tensor group of a node's devices and fsdp across the nodes, where FSDP alone would gather
    every weight over the network; {} where the run cannot take it (`refused`: a model that
    does not split over a tensor axis, sizes the group does not divide, rows that do not
    cover the fsdp axis)."""
    if not node or count <= node or count % node:
        return {}
    knobs = {"mesh.data": 1, "mesh.fsdp": count // node, "mesh.context": 1, "mesh.tensor": node}
    return {} if refused(config, knobs, count, devices) else knobs


def chunk(config) -> dict[str, Any]:
    """`loss.chunk_tokens` where a language model's loss runs as one big chunk."""
    from mptrain.models import lm_loss

    length, vocab = get(config, "data.seq_len"), get(config, "model.vocab_size")
    if not (length and vocab) or get(config, "loss") is None:
        return {}
    width = get(config, "model.d_model") or 0
    chunk = get(config, "loss.chunk_tokens") or lm_loss.auto_chunk(length, vocab, width)
    return {"loss.chunk_tokens": CHUNK} if chunk >= length > CHUNK else {}


def remat_ladder(config) -> list[str | None]:
    """The given remat policy (the model's default where the config has none), then the
    heavier ones; [None] for a model without `remat`."""
    from mptrain import models

    given = get(config, "model.remat")
    if given is None and models.record_of(config):
        given = models.import_model(config.model.name).CONFIG_KEYS.get("remat")
    return list(REMAT[REMAT.index(given) :]) if given in REMAT else [given]


def micro_batches(config, count: int, devices: Any = None) -> list[int]:
    """k = 1, 2, 4, ... while `batch_size` / k still splits over `count` devices, its rows, or,
    fewer than the devices, each sequence split over the rest (`split`)."""
    batch, found = config.batch_size, [1]
    while batch % (found[-1] * 2) == 0:
        if split(config, batch // found[-1] // 2, count, devices) is None:
            break
        found.append(found[-1] * 2)
    return found


def micro(config, k: int, count: int, devices: Any = None) -> dict[str, Any]:
    """`k` micro-batches a global batch: the batch / k, k x the accumulation and step counts,
    the mesh that splits its rows (`split`)."""
    if k == 1:
        return {}
    rows = config.batch_size // k
    knobs = {"batch_size": rows, **split(config, rows, count, devices)}
    knobs["optimizer.accumulation_steps"] = config.optimizer.accumulation_steps * k
    for key in ("num_train_steps", "eval_every_steps", "checkpoint_every_steps"):
        knobs[key] = config[key] * k
    return knobs
