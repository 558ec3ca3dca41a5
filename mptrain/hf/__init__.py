"""HuggingFace folders in and out: `read_config`, `load`, `load_params`, `save`.

A folder is what transformers' `save_pretrained` writes for a causal LM of a family
`mptrain.hf.families` reads (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, ..., the mixtures
of experts Qwen3-MoE and Mixtral): config.json and the safetensors. Its tensors map onto the
param tree of mptrain's decoder (`mptrain.models.decoder`) by name, each torch `[out, in]` weight
transposed to a flax `[in, out]` kernel (the table is in decoder.py's module doc; biases and
norms as they are); layers are stacked on a leading axis (`scan_layers`) or kept as
`layers_i`, a layer's experts on the axis after it.

The package: this module (the mapping of names), `families` (each family's config.json keys)
and `tensors` (the files, sharded or not). It may import `models`, `recipe` and the base
modules; `train` and `export` read it.

config.json comes in two forms, both read: transformers 4.x's `rope_theta` and `rope_scaling`
(what Hub checkpoints of Llama 3.x carry, with `rope_type` or the older `type`), and 5.x's
`rope_parameters` (`rope_theta` inside; Gemma 3's per layer type). RoPE types: "default",
"linear", Llama 3's "llama3", Phi-3's "longrope" and "yarn"; any other ("dynamic", ...) is an
error rather than a model that runs and is quietly worse. `save` writes the 4.x form, which
4.x and 5.x both load.

Against the peers:
  * q and k are loaded as HF stores them. HF Llama rotates "half" pairs (dimension j with
    j + head_dim/2), and so does mptrain's llama, so nothing is permuted. torchtitan's
    state-dict adapter and MaxText's converter permute q/k rows to their interleaved RoPE
    (and back on export); Levanter, like us, keeps HF's order.
  * `load_params` builds each param straight into its sharding: every device's shard is read
    from its slice of the file (safetensors' `get_slice`), each distinct slice once (replicas
    share the read), cast to the target dtype on the way (bf16 -> fp32 exactly) and put on
    its devices before the next is read. No host holds the whole model, nor one whole tensor
    of a sharded param. Levanter's fsspec reader also reads device slices, but one read per
    device, and transposes nothing (its linear layers keep torch's [out, in]); torchtitan
    goes through DCP's HF storage reader and its adapter. The 1B figure: scripts/hf_load_bench.py.
  * `save` shards at 5 GB by default (HF's own default; Levanter's is 10 GB), rounds to the
    export dtype round-to-nearest-even from the fp32 masters, and writes one file's worth of
    tensors at a time.
  * Bad input is one line naming the file and the key or tensor (`errors.ConfigError`, exit 2):
    another architecture, an unimplemented RoPE type, a missing key or tensor, a shape that
    disagrees (both shapes), a file that is not safetensors or is cut short, a bias, or a
    tensor nothing maps onto. Peers raise a KeyError or a shape error from deep inside.

Multi-process: `load_params` reads only what a process's devices hold; `save` gathers each
tensor (`np.asarray`), so it runs where the params are fully addressable (one process).
"""

from __future__ import annotations

import collections
import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from mptrain import dtypes, errors, models
from mptrain.hf import config_file, families, names
from mptrain.hf import tensors as hf_io
from mptrain.models import decoder
from mptrain.parallel import axes, sharding

# Tensors some checkpoints carry that no param is made from: RoPE's frequencies (recomputed
# from the config). lm_head.weight is skipped too where config.json ties it to the embedding,
# as transformers skips it (`_check_unused`).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder with a config.json and at least one `*.safetensors`."""
    folder = Path(path)
    return (folder / hf_io.CONFIG_FILE).is_file() and any(folder.glob("*.safetensors"))


def _settings(model_config: Any) -> dict[str, Any]:
    """`config.model`'s llama keys with their defaults, checked by the model's own rules."""
    section = model_config
    if isinstance(model_config, dict):
        section = ml_collections.ConfigDict({k: v for k, v in model_config.items()})
    name = getattr(section, "name", None)
    if name is not None and not getattr(models.record_of(section), "hf", False):
        raise errors.ConfigError(
            f"config.model.name={name!r}: only {models.able('hf')} maps onto a HuggingFace folder"
        )
    with errors.config_errors():
        keys = decoder.settings(section)
        families.check(keys)
    return keys


def read_settings(model_config: Any) -> dict[str, Any]:
    """`config.model`'s decoder settings, checked (what `names` maps by)."""
    return _settings(model_config)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.model` section (`name="llama"`, its `family`, and the keys of
    `decoder.CONFIG_KEYS` that a checkpoint fixes) for a folder of a family `mptrain.hf.families`
    reads (or its config.json). Keys transformers has defaults for may be absent (its defaults
    are the family's: `families.Family.defaults`); the sizes may not. Errors: `ConfigError`
    naming the file and the key."""
    file = Path(path)
    file = file / hf_io.CONFIG_FILE if file.is_dir() else file
    model = config_file.read_model_config(file)
    try:  # the model's own rules, here, where the file the values came from is known
        _settings(model)
    except errors.ConfigError as e:
        raise errors.ConfigError(f"{file}: {e}") from None
    return model


def to_hf_config(model_config: Any, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json's content (transformers 4.x form) for a llama `config.model`."""
    return config_file.config_json(_settings(model_config), dtype)


# --------------------------------------------------------------------------- the param tree


def param_shapes(model_config: Any, scan_layers: bool = True) -> dict:
    """The decoder's param tree's shapes (tuples) for `config.model`, scanned or not: what its
    `model.init` makes, traced abstractly (`declared`)."""
    return jax.tree.map(lambda s: tuple(s.shape), declared(model_config, scan_layers)[1])


def declared(model_config: Any, scan_layers: bool = True) -> tuple[axes.Axes, dict]:
    """`(the params' declared axes, their abstract shapes)` of the decoder of `config.model`,
    scanned or not (`parallel.axes.declared_of`; nothing is allocated)."""
    keys = {**_settings(model_config), "scan_layers": scan_layers, "attention": "materialized"}
    keys.pop("name", None)
    model = decoder.create_model(keys)
    tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
    return axes.declared_of(model.init, jax.random.key(0), tokens)


def _keys(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


# --------------------------------------------------------------------------- in


def load(path: str | os.PathLike, *, scan_layers: bool | None = None) -> tuple[dict, dict]:
    """`(model_config, params)`: config.json's `config.model` section and the params as
    float32 numpy arrays in the llama's tree (`stacked_layers` or `layers_i`; None: stacked
    unless the config says otherwise, as one whose dense and expert layers differ does)."""
    config = read_config(path)
    scan_layers = config.get("scan_layers", True) if scan_layers is None else scan_layers
    shapes = param_shapes(config, scan_layers)
    is_shape = lambda x: isinstance(x, tuple)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), shapes, is_leaf=is_shape)
    return config, _read_tree(path, config, target, lambda read, t: read(_full(t.shape)))


def load_params(path: str | os.PathLike, target: Any, *, scan_layers: bool = True) -> Any:
    """The params of the folder at `path` as jax.Arrays with exactly `target`'s shardings and
    dtypes (a pytree of `jax.ShapeDtypeStruct`, e.g. the train state's abstract params: float32
    masters, or bfloat16 under bf16-pure, rounded to nearest). A process reads only the slices
    its devices hold, each distinct slice once, and puts it on those devices before reading
    the next (`jax.make_array_from_single_device_arrays`: `make_array_from_callback` would
    hold a whole param's slices on the host before the first copy). `scan_layers` must agree
    with `target`'s layout. A tensor that is missing, or whose shape disagrees with the target,
    is a `ConfigError` naming the file, the tensor and both shapes."""
    config, target = read_config(path), axes.unboxed(target)
    top = {_keys(p)[0] for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
    if (sharding.STACKED in top) != scan_layers:
        raise errors.ConfigError(
            f"scan_layers={scan_layers}: the target's params are "
            f"{'stacked' if sharding.STACKED in top else 'per layer'}; pass scan_layers to match"
        )

    def build(read, t):
        where = t.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        # Devices by the slice they hold: a slice is read once, copied to each device that
        # holds it (replicas), and dropped; the host holds one device's slice at a time.
        holders = collections.defaultdict(list)
        for device, index in where.addressable_devices_indices_map(t.shape).items():
            holders[tuple(s.indices(n) for s, n in zip(index, t.shape, strict=True))].append(
                (device, index)
            )
        arrays = []
        for devices in holders.values():
            part = read(devices[0][1])
            arrays += [jax.device_put(part, device) for device, _ in devices]
        return jax.make_array_from_single_device_arrays(t.shape, where, arrays)

    return _read_tree(path, config, target, build)


def _full(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _read_tree(path: Any, config: dict, target: Any, build: Any) -> Any:
    """`target` with each leaf `build(read, leaf)`, where `read(index)` returns that slice of
    the param (in the leaf's dtype) from the files; every shape is checked before any read."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    c = _settings(config)
    leaves = [names.leaf(_keys(p), tuple(t.shape), c) for p, t in flat]
    with hf_io.Reader(path) as reader:
        for leaf, (_, t) in zip(leaves, flat, strict=True):
            want = leaf.hf_shape
            for name in leaf.names:
                have = reader.shape(name)
                if have != want:
                    raise errors.ConfigError(
                        f"{reader.file(name)}: tensor {name} has shape {list(have)}, but "
                        f"params/{leaf.path} {list(t.shape)} needs {list(want)}"
                    )
        _check_unused(reader, leaves, config)
        if reader.mxfp4:
            logging.info(
                "mptrain: %s: %d MXFP4 tensors (gpt-oss's experts) dequantised as they are "
                "read, exactly (each value an e2m1 code times a power of two: exact in bf16 "
                "too); an export writes them in its dtype, not in MXFP4",
                path, len(reader.mxfp4),
            )  # fmt: skip
        out = []
        for leaf, (_, t) in zip(leaves, flat, strict=True):
            dtype = np.dtype(t.dtype)
            out.append(
                build(lambda index, leaf=leaf, dtype=dtype: _read(reader, leaf, index, dtype), t)
            )
    return jax.tree_util.tree_unflatten(treedef, out)


def _read(reader: hf_io.Reader, leaf: names.Leaf, index: tuple, dtype: Any) -> np.ndarray:
    """The param's `index` slice in `dtype` (bf16 and fp16 widen exactly; fp32 to bf16 rounds
    to nearest even), read a layer at a time into the one array it returns."""
    lead = len(leaf.lead)  # the axes over tensors (layers, experts): their rows of the slice
    picks = [range(*s.indices(n)) for s, n in zip(index[:lead], leaf.lead, strict=True)]
    index = index[lead:]
    shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, leaf.shape, strict=True))
    out = np.empty((*map(len, picks), *shape), dtype)
    hf_index = index[::-1] if leaf.transposed else index
    if leaf.rows is not None:  # a block of a fused tensor's rows
        first, stop, _ = hf_index[0].indices(leaf.rows[1] - leaf.rows[0])
        hf_index = (slice(leaf.rows[0] + first, leaf.rows[0] + stop), *hf_index[1:])
    strided = None
    if leaf.stride is not None:  # every parts-th column from offset: the columns around read
        offset, parts = leaf.stride
        first, stop, _ = hf_index[-1].indices(leaf.shape[-1])
        hf_index = (*hf_index[:-1], slice(first * parts, stop * parts))
        strided = (Ellipsis, slice(offset, None, parts))
    for at in np.ndindex(*map(len, picks)):
        which = tuple(p[i] for p, i in zip(picks, at, strict=True))
        name = leaf.names[int(np.ravel_multi_index(which, leaf.lead)) if lead else 0]
        if leaf.transposed:  # the kernel's [in, out] slice is the weight's [out, in] one
            hf_io.transpose_into(out[at], reader.read(name, hf_index))
        elif strided is not None:
            out[at] = reader.read(name, hf_index)[strided]
        else:
            out[at] = reader.read(name, index)
    return out


def _check_unused(reader: hf_io.Reader, leaves: list[names.Leaf], config: dict) -> None:
    used = {name for leaf in leaves for name in leaf.names}
    if config["tie_embeddings"]:
        head = names.TOP_NAMES[("head", "kernel")][0]
        used.add(head)
        if head in reader.files:  # transformers drops it too; a user may have meant otherwise
            logging.warning(
                "mptrain: %s holds %s, which config.json's tie_word_embeddings=true leaves "
                "unread: the head is the embedding, as in transformers; set it to false to "
                "read this head",
                reader.files[head], head,
            )  # fmt: skip
    unused = sorted(n for n in reader.files if n not in used and not _IGNORED.fullmatch(n))
    family = families.FAMILIES[config["family"]]
    if family.unread_layers:  # after the last layer (DeepSeek-V3's multi-token prediction)
        past = re.compile(r"model\.layers\.(\d+)\.")
        extra = [n for n in unused if (m := past.match(n)) and int(m[1]) >= config["num_layers"]]
        if extra:
            logging.warning("mptrain: %s: %d tensors of layers past num_hidden_layers (%s) left "
                            "unread, as transformers leaves them", reader.files[extra[0]],
                            len(extra), family.unread_layers)  # fmt: skip
            unused = [n for n in unused if n not in extra]
    if unused:
        raise errors.ConfigError(
            f"{reader.files[unused[0]]}: tensor {unused[0]} has no place in the model that "
            f"config.json describes ({len(unused)} such tensors)"
        )


# --------------------------------------------------------------------------- out


def save(
    path: str | os.PathLike,
    model_config: Any,
    params: Any,
    dtype: str = "bfloat16",
    *,
    max_shard_bytes: int = 5 * 10**9,
) -> None:
    """Writes an HF Llama folder that transformers loads: config.json (4.x form) and
    `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards and their index when the
    tensors exceed `max_shard_bytes`. Each tensor is rounded to `dtype` (round-to-nearest-even;
    float16 values past its range are an error, not infinities). `params` (numpy or jax
    arrays, scanned or not, boxed with their declared axes as `model.init` gives them or not)
    must have the shapes `model_config` gives."""
    params = axes.unboxed(params)
    with errors.config_errors():
        out_dtype = dtypes.parse_dtype(dtype, "dtype")
        errors.check_integer("max_shard_bytes", max_shard_bytes, 1)
    name = {dtypes.F32: "float32", dtypes.BF16: "bfloat16", dtypes.F16: "float16"}
    hf_config = to_hf_config(model_config, name[out_dtype])
    c = _settings(model_config)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    scanned = any(_keys(p)[0] == sharding.STACKED for p, _ in flat)
    want = {
        _keys(p): s
        for p, s in jax.tree_util.tree_flatten_with_path(
            param_shapes(model_config, scanned), is_leaf=lambda x: isinstance(x, tuple)
        )[0]
    }
    tensors: dict[str, hf_io.ShardTensor] = {}
    fused: dict[str, tuple] = {}
    for p, x in flat:
        keys = _keys(p)
        if keys not in want or tuple(np.shape(x)) != want[keys]:
            needs = list(want[keys]) if keys in want else "no such param"
            raise errors.ConfigError(
                f"params/{'/'.join(keys)}: shape {list(np.shape(x))}, but the model config "
                f"needs {needs}"
            )
        leaf = names.leaf(keys, tuple(np.shape(x)), c)
        want.pop(keys)
        nbytes = int(np.prod(leaf.hf_shape)) * out_dtype.itemsize
        for i, hf_name in enumerate(leaf.names):
            at = np.unravel_index(i, leaf.lead) if leaf.lead else ()  # its layer (and expert)
            get = lambda x=x, at=at, leaf=leaf: _export(x[at], leaf, out_dtype)
            if leaf.rows is not None:  # a part of a fused tensor: the parts, by first row
                parts = fused.setdefault(hf_name, (leaf.hf_shape, nbytes, {}))[2]
                parts[leaf.rows[0]] = get
                continue
            if leaf.stride is not None:  # interleaved columns: the parts, by offset
                parts = fused.setdefault(hf_name, (leaf.hf_shape, nbytes, {}))
                parts[2][("stride", leaf.stride[0])] = get
                continue
            tensors[hf_name] = (hf_name, leaf.hf_shape, nbytes, get)
    if want:
        missing = "/".join(next(iter(want)))
        raise errors.ConfigError(f"params/{missing}: missing, and the model config needs it")
    for hf_name, (shape, nbytes, parts) in fused.items():
        get = lambda parts=parts: np.concatenate([parts[k]() for k in sorted(parts)])
        if all(isinstance(k, tuple) for k in parts):  # interleaved along the last axis
            get = lambda parts=parts: np.stack([parts[k]() for k in sorted(parts)], -1).reshape(
                *parts[min(parts)]().shape[:-1], -1
            )
        tensors[hf_name] = (hf_name, shape, nbytes, get)
    ordered = sorted(tensors.values(), key=lambda t: names.order(t[0]))
    files = {hf_io.CONFIG_FILE: json.dumps(hf_config, indent=2) + "\n"}
    hf_io.write(Path(path), ordered, max_shard_bytes, files)


def _export(x: Any, leaf: names.Leaf, dtype: np.dtype) -> np.ndarray:
    """One layer's param as the file holds it: rounded to `dtype`, transposed for a kernel
    (its own rows only, for a part of a fused tensor)."""
    x = np.asarray(x)
    out = np.empty(x.T.shape if leaf.transposed else x.shape, dtype)
    with np.errstate(over="ignore"):  # float16's overflow is told below, with the param's name
        if leaf.transposed:
            hf_io.transpose_into(out, x)
        else:
            out[...] = x
    if dtype == dtypes.F16 and not np.isfinite(out).all() and np.isfinite(x).all():
        big = float(np.abs(x.astype(np.float32)).max())
        raise errors.ConfigError(
            f"params/{leaf.path}: |value| {big:g} is past float16's range (65504); export "
            "in bfloat16 or float32"
        )
    return out
