"""The files of a HuggingFace folder: config.json in either of transformers' forms (its family's
own keys read by `mptrain.hf.families`), and safetensors tensors found by name, read by slices,
written in shards with an index. `mptrain.hf` maps them onto mptrain's decoder and its param
tree; this module knows the files.

A folder holds either one `model.safetensors`, or shards `model-0000i-of-0000n.safetensors`
listed by `model.safetensors.index.json` (its `weight_map`: tensor name -> file); a folder with
neither is read from every `*.safetensors` in it. Files are memory-mapped by safetensors (its
numpy API, which reads bf16 through ml_dtypes): opening one reads only its header, and
`get_slice(name)[a:b, c:d]` copies only those rows and columns. What cannot be read is a
`ConfigError` of one line naming the file, the tensor and the bad value.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from mptrain import errors
from mptrain.hf import families

FULL, SLIDING = families.FULL, families.SLIDING

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The safetensors dtypes a float param may be stored in; each widens to float32 exactly
# (float64 rounds, as torch's `.float()` does).
FLOATS = ("F64", "F32", "BF16", "F16")
CONFIG_FILE = "config.json"
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ShardTensor = tuple[str, tuple[int, ...], int, Callable[[], np.ndarray]]  # name, shape, bytes, get


def read_json(file: Path) -> dict:
    try:
        value = json.loads(file.read_text())
    except FileNotFoundError:
        raise errors.ConfigError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise errors.ConfigError(f"{file}: not readable JSON: {errors.first_line(e)}") from None
    if not isinstance(value, dict):
        raise errors.ConfigError(f"{file}: a JSON object expected, found {type(value).__name__}")
    return value


class Reader:
    """A folder's tensors by name; each file opened once, closed on leaving the `with`."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}
        self.files = self._locate()  # tensor name -> the file that holds it

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self._handles.clear()

    def _locate(self) -> dict[str, Path]:
        index = self.folder / INDEX
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise errors.ConfigError(f"{index}: no 'weight_map' of tensor names to files")
            return {name: self.folder / file for name, file in weight_map.items()}
        if (self.folder / SINGLE).exists():
            files = [self.folder / SINGLE]
        else:
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise errors.ConfigError(
                f"{self.folder}: no *.safetensors files (a folder saved by transformers' "
                "save_pretrained has model.safetensors or its shards and an index)"
            )
        return {name: file for file in files for name in self.handle(file).keys()}  # noqa: SIM118

    def handle(self, file: Path) -> Any:
        if file not in self._handles:
            if not file.exists():
                listed = f", though {INDEX} lists it" if (self.folder / INDEX).exists() else ""
                raise errors.ConfigError(f"{file}: no such file{listed}")
            try:  # safetensors says "No such file" of a file it may not read: ask open()
                with open(file, "rb"):
                    pass
            except OSError as e:
                raise errors.ConfigError(f"{file}: cannot be read: {e.strerror or e}") from None
            try:
                opened = safetensors.safe_open(str(file), framework="numpy")
                self._handles[file] = self._stack.enter_context(opened)
            except Exception as e:  # SafetensorError, OSError: a header that does not parse
                raise errors.ConfigError(
                    f"{file}: not a readable safetensors file: {errors.first_line(e)}"
                ) from None
        return self._handles[file]

    def file(self, name: str) -> Path:
        if name not in self.files:
            files = set(self.files.values())
            if (self.folder / INDEX).exists():
                where = self.folder / INDEX
            else:
                where = files.pop() if len(files) == 1 else self.folder / "*.safetensors"
            raise errors.ConfigError(f"{where}: no tensor {name}")
        return self.files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape; a `ConfigError` when it is missing or not a float tensor."""
        file = self.file(name)
        try:
            view = self.handle(file).get_slice(name)
            shape, dtype = tuple(view.get_shape()), view.get_dtype()
        except errors.ConfigError:
            raise
        except Exception as e:  # the index lists it, the file does not have it
            raise errors.ConfigError(f"{file}: no tensor {name} ({errors.first_line(e)})") from None
        if dtype not in FLOATS:
            raise errors.ConfigError(
                f"{file}: tensor {name} is {dtype}; a param must be one of {', '.join(FLOATS)}"
            )
        return shape

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """`tensor[index]`, in the file's dtype: only those bytes are copied from the file."""
        file = self.file(name)
        try:
            part = self.handle(file).get_slice(name)[index]
        except Exception as e:  # the header promised bytes the file does not deliver
            raise errors.ConfigError(
                f"{file}: tensor {name} could not be read: {errors.first_line(e)}"
            ) from None
        return np.asarray(part)


def transpose_into(out: np.ndarray, part: np.ndarray) -> None:
    """`out[...] = part.T` (2-D, cast to `out`'s dtype on the way), a block that fits the
    cache at a time: 2-3x faster than numpy's strided copy of the whole."""
    rows, cols = part.shape
    for i in range(0, rows, 128):
        for k in range(0, cols, 512):
            out[k : k + 512, i : i + 128] = part[i : i + 128, k : k + 512].T


def read_model_config(file: Path) -> dict[str, Any]:
    """`mptrain.hf.read_config`'s dict from the config.json `file` (the doc is there)."""
    raw = read_json(file)
    family = families.of_config(file, raw)
    gemma = family.name.startswith("gemma")
    # the MLP's activation: SiLU, or Gemma's GELU (tanh), which it names hidden_activation
    act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    for key, fine in (act, ("mlp_bias", False)):
        if raw.get(key, fine) not in (fine, None):
            raise errors.ConfigError(
                f"{file}: {key}={raw[key]!r}: mptrain's decoder has {key}={fine!r} only"
            )
    defaults = dict(family.defaults)

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        """`raw[key]`, else `default` (transformers' own; None: the key is required)."""
        default = defaults.get(key, default)
        value = default if raw.get(key) is None else raw[key]
        if value is None:
            raise errors.ConfigError(
                f"{file}: no {key!r}, which a {family.architecture}'s config.json must give"
            )
        return _checked(file, key, value, kind)

    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    theta, scaling, local = _rope(file, raw, gemma)
    return {
        "name": "llama",
        "family": family.name,
        "vocab_size": get("vocab_size"),
        "d_model": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads", heads),
        "head_dim": get("head_dim", hidden // heads),
        "d_ff": get("intermediate_size"),
        "max_len": get("max_position_embeddings", 2048),
        "rope_theta": _checked(file, "rope_theta", theta, float),
        "rope_scaling": scaling,
        "norm_eps": get("rms_norm_eps", 1e-6, float),
        "tie_embeddings": get("tie_word_embeddings", False, bool),
        "attn_bias": "none",
        "qk_norm": False,
        "sliding_window": None,
        "layer_types": None,
        "rope_local_theta": local and _checked(file, "rope_local_base_freq", local, float),
        **dict.fromkeys(("query_pre_attn_scalar", "attn_softcap", "final_softcap")),
        **dict.fromkeys(("norm_plus_one", "post_norms", "embed_scale", "qk_norm_width"), False),
        "pre_norms": True,
        "nope_layers": None,
        "mlp_act": "silu",
        "token_ids": _token_ids(raw),
        "partial_rotary_factor": 1.0,
        **family.read(file, raw, layers),
    }


def _token_ids(raw: dict) -> tuple | None:
    """config.json's (pad, bos, eos) ids, an eos list as a tuple; None where none is given."""
    ids = [raw.get(f"{k}_token_id") for k in ("pad", "bos", "eos")]
    ids = [tuple(i) if isinstance(i, list) else i for i in ids]
    return None if ids == [None] * 3 else tuple(ids)


def _checked(file: Path, key: str, value: Any, kind: type) -> Any:
    """`value` when it is a positive int, a positive number (as a float) or a bool, as `kind`
    says; else a `ConfigError` naming the file and the key."""
    try:
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: must be true or false")
        if kind is int:
            return errors.check_integer(key, value, 1)
        return errors.check_number(key, value, 0.0, open_low=True) if kind is float else value
    except ValueError as e:
        raise errors.ConfigError(f"{file}: {e}") from None


def _rope(file: Path, raw: dict, gemma: bool = False) -> tuple[float, tuple | None, Any]:
    """`(rope_theta, rope_scaling, the sliding layers' base or None)` from either form of
    config.json: Gemma 3 gives the sliding layers a base of their own (`rope_local_base_freq`,
    or 5.x's `rope_parameters` per layer type), unscaled."""
    rope, local = raw.get("rope_parameters"), raw.get("rope_local_base_freq")
    if gemma and isinstance(rope, dict) and {FULL, SLIDING} & set(rope):
        for kind in (FULL, SLIDING):
            if not isinstance(rope.get(kind, {}), dict):
                raise errors.ConfigError(f"{file}: rope_parameters.{kind}: an object expected")
        local_rope = rope.get(SLIDING, {})
        theta, scaling = _rope_of(file, f"rope_parameters.{SLIDING}", local_rope, raw)
        if scaling is not None:
            raise errors.ConfigError(
                f"{file}: rope_parameters.{SLIDING}.rope_type={local_rope.get('rope_type')!r}: "
                "mptrain's sliding layers take RoPE type 'default' only"
            )
        return (*_rope_of(file, f"rope_parameters.{FULL}", rope.get(FULL, {}), raw), theta)
    if rope is not None:  # transformers 5.x: rope_theta inside
        return (*_rope_of(file, "rope_parameters", rope, raw), local)
    return (*_rope_of(file, "rope_scaling", raw.get("rope_scaling") or {}, raw, apart=True), local)


def _rope_of(file: Path, key: str, rope: Any, raw: dict, apart: bool = False) -> tuple:
    """`(rope_theta, rope_scaling)` of one RoPE object `rope` (config.json's `key`); `apart`:
    4.x's form, rope_theta beside it."""
    if not isinstance(rope, dict):
        raise errors.ConfigError(f"{file}: {key}={rope!r}: an object expected")
    theta = None if apart else rope.get("rope_theta")
    theta = raw.get("rope_theta", 10_000.0) if theta is None else theta
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind == "linear":
        return theta, ("linear", _checked(file, f"{key}.factor", rope.get("factor"), float))
    if kind != "llama3":
        raise errors.ConfigError(
            f"{file}: {key}.rope_type={kind!r}: not implemented; mptrain's decoder has RoPE "
            "types 'default', 'linear' and 'llama3'"
        )
    missing = [k for k in _ROPE_KEYS if rope.get(k) is None]
    if missing:
        raise errors.ConfigError(f"{file}: no {key}.{missing[0]}, which rope_type 'llama3' needs")
    kinds = (float, float, float, int)
    factor, low, high, original = (
        _checked(file, f"{key}.{k}", rope[k], kind)
        for k, kind in zip(_ROPE_KEYS, kinds, strict=True)
    )
    return theta, (factor, low, high, original)


def config_json(c: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json's content, transformers 4.x's form, for the decoder's checked settings `c`,
    as its family (`model.family`) writes it."""
    family = families.FAMILIES[c["family"]]
    scaling = c["rope_scaling"]
    rope = None
    if scaling is not None and scaling[0] == "linear":
        rope = {"rope_type": "linear", "factor": float(scaling[1])}
    elif scaling is not None:
        rope = {"rope_type": "llama3", **dict(zip(_ROPE_KEYS, scaling, strict=True))}
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["d_model"],
        "intermediate_size": c["d_ff"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_kv_heads"],
        "head_dim": c["head_dim"],
        "max_position_embeddings": c["max_len"],
        "rms_norm_eps": float(c["norm_eps"]),
        "rope_theta": float(c["rope_theta"]),
        "rope_scaling": rope,
        "tie_word_embeddings": c["tie_embeddings"],
        **{
            f"{k}_token_id": list(i) if isinstance(i, tuple) else i
            for k, i in zip(("pad", "bos", "eos"), c["token_ids"] or (), strict=False)
        },
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **family.write(c),
        "torch_dtype": dtype,
        "dtype": dtype,
    }


# --------------------------------------------------------------------------- safetensors


def _shards(tensors: list[ShardTensor], max_bytes: int) -> list[list[ShardTensor]]:
    """Tensors in order, cut into files of at most `max_bytes` (a larger tensor alone)."""
    shards: list[list[ShardTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor[2] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor[2]
    return shards


def write(
    folder: Path, tensors: list[ShardTensor], max_bytes: int, files: dict[str, str]
) -> list[Path]:
    """Writes `tensors` (each made when its file is written, so one file's worth is in memory
    at a time) as `model.safetensors`, or as shards and an index when they exceed `max_bytes`;
    then `files` (name -> text, e.g. config.json). Each file appears whole (written beside,
    then renamed); model files of an earlier save that this one does not write are removed.
    An `OSError` is a `StorageError` naming the file."""
    shards = _shards(tensors, max_bytes)
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written = []
    target = folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, shard in zip(names, shards, strict=True):
            target = folder / name
            arrays = {tensor[0]: np.ascontiguousarray(tensor[3]()) for tensor in shard}
            _atomic(target, lambda f, a=arrays: safetensors.numpy.save_file(a, f, {"format": "pt"}))
            written.append(target)
        if len(shards) > 1:
            weight_map = {
                t[0]: name for name, shard in zip(names, shards, strict=True) for t in shard
            }
            total = sum(t[2] for t in tensors)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            files = {INDEX: json.dumps(index, indent=2) + "\n", **files}
        for name, text in files.items():
            target = folder / name
            _atomic(target, lambda f, text=text: Path(f).write_text(text))
            written.append(target)
        for stale in _stale(folder, written):
            target = stale
            stale.unlink()
    except OSError as e:
        raise errors.StorageError(f"{target}: could not write: {errors.first_line(e)}") from None
    return written


def _atomic(path: Path, write_fn: Callable[[str], Any]) -> None:
    staging = path.with_name(f".{path.name}.partial")
    # A file of ours first, so it has the mode every new file gets (0666 less the umask): the
    # safetensors writer makes its own files 0600, which would hide an export from its readers.
    os.close(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666))
    mode = os.stat(staging).st_mode & 0o777
    write_fn(str(staging))
    os.chmod(staging, mode)
    os.replace(staging, path)


def _stale(folder: Path, written: Iterable[Path]) -> list[Path]:
    keep = set(written)
    candidates = [*folder.glob("model*.safetensors"), folder / INDEX]
    return [p for p in candidates if p.exists() and p not in keep]
