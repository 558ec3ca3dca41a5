"""The files of a HuggingFace folder: safetensors tensors found by name, read by slices, written
in shards with an index (config.json's keys are `mptrain.hf.config_file`'s). `mptrain.hf` maps
them onto mptrain's decoder and its param tree; this module knows the files.

A folder holds either one `model.safetensors`, or shards `model-0000i-of-0000n.safetensors`
listed by `model.safetensors.index.json` (its `weight_map`: tensor name -> file); a folder with
neither is read from every `*.safetensors` in it. Files are memory-mapped by safetensors (its
numpy API, which reads bf16 through ml_dtypes): opening one reads only its header, and
`get_slice(name)[a:b, c:d]` copies only those rows and columns. A tensor stored in MXFP4
(gpt-oss's experts: `X_blocks` and `X_scales`) reads as the tensor `X`, each slice dequantised
from the blocks that hold it. What cannot be read is a
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
from mptrain.hf import multimodal

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The safetensors dtypes a float param may be stored in; each widens to float32 exactly
# (float64 rounds, as torch's `.float()` does).
FLOATS = ("F64", "F32", "BF16", "F16")
CONFIG_FILE = "config.json"
# MXFP4 (OCP MX 1.0; gpt-oss's checkpoints): a tensor stored as `*_blocks` (e2m1 codes, two a
# byte, the first in the low nibble; blocks of 32 along the input) and `*_scales` (e8m0: a
# power of two, the exponent plus 127)
MXFP4 = ("_blocks", "_scales")
MXFP4_BLOCK = 32
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
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
        # a multimodal folder's text model: its tensors by the text-only folder's names
        config = self.folder / CONFIG_FILE
        raw = read_json(config) if config.exists() else {}
        self._names = {}  # the text model's name -> the file's name, where they differ
        self.files = {}  # tensor name -> the file that holds it
        for name, file in self._locate().items():
            ours = multimodal.tensor_name(raw, name)
            if ours is not None:
                self.files[ours] = file
                self._names[ours] = name
        # MXFP4 tensors (gpt-oss's experts): `X_blocks` and `X_scales` read as the tensor X
        self.mxfp4 = {}
        for name in [n for n in self.files if n.endswith(MXFP4[0])]:
            base = name.removesuffix(MXFP4[0])
            if base + MXFP4[1] in self.files:  # each in its own file (shards may differ)
                scales = base + MXFP4[1]
                self.mxfp4[base] = ((name, self.files[name]), (scales, self.files.pop(scales)))
                self.files[base] = self.files.pop(name)

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

    def _raw(self, name: str, file: Path) -> Any:
        return self.handle(file).get_slice(self._names.get(name, name))

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape; a `ConfigError` when it is missing or not a float tensor."""
        if name in self.mxfp4:  # blocks [..., out, in / 32, 16]: the tensor [..., in, out]
            *lead, out, groups, _ = self._raw(*self.mxfp4[name][0]).get_shape()
            return (*lead, groups * MXFP4_BLOCK, out)
        file = self.file(name)
        try:
            view = self.handle(file).get_slice(self._names.get(name, name))
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
        """`tensor[index]`, in the file's dtype (an MXFP4 tensor's in float32, dequantised
        from the blocks that hold the slice): only those bytes are copied from the file."""
        if name in self.mxfp4:
            return self._read_mxfp4(name, index)
        file = self.file(name)
        try:
            part = self.handle(file).get_slice(self._names.get(name, name))[index]
        except Exception as e:  # the header promised bytes the file does not deliver
            raise errors.ConfigError(
                f"{file}: tensor {name} could not be read: {errors.first_line(e)}"
            ) from None
        return np.asarray(part)

    def _read_mxfp4(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """`tensor[index]` of the `[..., in, out]` tensor an MXFP4 pair stands for: the rows
        `out` and the blocks of 32 inputs that cover the slice are read and dequantised (each
        value an e2m1 code times its block's power of two: exact in float32 and in bf16)."""
        shape = self.shape(name)
        *lead, (i0, i1, _), (o0, o1, _) = (s.indices(n) for s, n in zip(index, shape, strict=True))
        g0, g1 = i0 // MXFP4_BLOCK, -(-i1 // MXFP4_BLOCK)
        at = (*(slice(a, b) for a, b, _ in lead), slice(o0, o1), slice(g0, g1))
        (blocks_name, blocks_file), scales_of = self.mxfp4[name]
        try:
            blocks = np.asarray(self._raw(blocks_name, blocks_file)[at], np.uint8)
            scales = np.asarray(self._raw(*scales_of)[at], np.int32) - 127
        except Exception as e:
            raise errors.ConfigError(
                f"{blocks_file}: tensor {blocks_name} could not be read: {errors.first_line(e)}"
            ) from None
        codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)
        values = np.ldexp(E2M1[codes], scales[..., None]).reshape(*blocks.shape[:-2], -1)
        start = i0 - g0 * MXFP4_BLOCK
        return np.swapaxes(values[..., start : start + i1 - i0], -1, -2)


def transpose_into(out: np.ndarray, part: np.ndarray) -> None:
    """`out[...] = part.T` (2-D, cast to `out`'s dtype on the way), a block that fits the
    cache at a time: 2-3x faster than numpy's strided copy of the whole."""
    rows, cols = part.shape
    for i in range(0, rows, 128):
        for k in range(0, cols, 512):
            out[k : k + 512, i : i + 128] = part[i : i + 128, k : k + 512].T


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
