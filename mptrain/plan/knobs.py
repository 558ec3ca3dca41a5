"""The knobs `--fit` turns that change the run's shape (`mptrain.plan.search`): the mesh, the
micro-batches (and the context split that takes a micro-batch of fewer rows than devices), the
loss's chunks, the remat ladder, and across nodes a tensor group within each."""

from __future__ import annotations

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


def mesh(config, count: int) -> dict[str, Any]:
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
    return split(config, config.batch_size, count) or every or {"mesh.data": -1, "mesh.fsdp": count}


def split(config, rows: int, count: int) -> dict[str, Any] | None:
    """A mesh of `count` devices for a batch of `rows` sequences fewer than the devices: FSDP
    over the rows, each sequence split over the rest (`mesh.context`), params over all; {}
    where the rows cover the devices; None where no split can take them (a context axis is
    the Llama's on whole rows, of a length 2 x context chunks divide)."""
    if rows % count == 0:
        return {}
    length = get(config, "data.seq_len") or 0
    context = count // rows if rows and count % rows == 0 else 0
    llama = get(config, "model.name") == "llama" and get(config, "data.name") != "sft"
    llama = llama and get(config, "mesh.expert", 1) == 1  # not searched beside an expert axis
    if not (llama and context and length % (2 * context) == 0):
        return None
    return {"mesh.data": 1, "mesh.fsdp": rows, "mesh.context": context}


def tensor(config, count: int, node: int) -> dict[str, Any]:
    """Across nodes (`count` devices, more than one `node` of them): a Llama's layers split over
    a tensor group of a node's devices and fsdp across the nodes, where FSDP alone would gather
    every weight over the network; {} where the model cannot take it (`models._check_tensor`'s
    rules: the group divides the heads, the kv heads, the MLP and the vocabulary; no experts)
    or the rows do not cover the fsdp axis."""
    if not node or count <= node or count % node:
        return {}
    if get(config, "model.name") != "llama" or get(config, "model.num_experts"):
        return {}
    keys = ("num_heads", "num_kv_heads", "d_ff", "vocab_size")
    sizes = [get(config, f"model.{key}") or 0 for key in keys]
    length, fsdp = get(config, "data.seq_len") or 0, count // node
    if any(not n or n % node for n in (*sizes, length)) or config.batch_size % fsdp:
        return {}
    return {"mesh.data": 1, "mesh.fsdp": fsdp, "mesh.context": 1, "mesh.tensor": node}


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
    import importlib

    given = get(config, "model.remat")
    if given is None and get(config, "model.name"):
        module = importlib.import_module(f"mptrain.models.{config.model.name}")
        given = getattr(module, "CONFIG_KEYS", {}).get("remat")
    return list(REMAT[REMAT.index(given) :]) if given in REMAT else [given]


def micro_batches(config, count: int) -> list[int]:
    """k = 1, 2, 4, ... while `batch_size` / k still splits over `count` devices, its rows, or,
    fewer than the devices, each sequence split over the rest (`split`)."""
    batch, found = config.batch_size, [1]
    while (
        batch % (found[-1] * 2) == 0 and split(config, batch // found[-1] // 2, count) is not None
    ):
        found.append(found[-1] * 2)
    return found


def micro(config, k: int, count: int) -> dict[str, Any]:
    """`k` micro-batches a global batch: the batch / k, k x the accumulation and step counts,
    the mesh that splits its rows (`split`)."""
    if k == 1:
        return {}
    knobs = {"batch_size": config.batch_size // k, **split(config, config.batch_size // k, count)}
    knobs["optimizer.accumulation_steps"] = config.optimizer.accumulation_steps * k
    for key in ("num_train_steps", "eval_every_steps", "checkpoint_every_steps"):
        knobs[key] = config[key] * k
    return knobs
