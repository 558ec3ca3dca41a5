"""What each dimension of a param is, said once where the param is created.

A model's module creates a param with an init wrapped by `declare(init, names)`: `names` gives
each dimension a logical name (`EMBED`, `Q_HEADS`, `KV_HEADS`, `MLP`, `VOCAB`, `EXPERTS`, and
`LAYERS` for a stack's leading axis, `RANK` for an adapter's; None for a dimension no mesh axis
splits), and `fp32=True`
marks a param the step hands the model in fp32 under 16-bit compute (an embedding table, a
norm's scale and bias: its role). The init then returns flax's `LogicallyPartitioned` box
(`Param`), which `nn.Module.param` unboxes for the model: the metadata exists only in what
`model.init` returns. `declared(variables)` reads it into an `Axes`, the path -> names table a
train state carries (hashable: a static part of it), and `unboxed(variables)` gives the plain
arrays. Which mesh axes a name is split over is `layout.RULES`' alone; a param the model did
not declare (a user's own model) has no names and is held whole on every device.

An optimizer's state mirrors the params: a state leaf takes the names of the param whose path
ends its own (`Axes.of`), so moments, an 8-bit moment's codes and a frozen base split as the
params they belong to without a list of their names. flax's `nn.with_logical_partitioning` and
MaxText's `kernel_axes` (`layers/linears.py`) are the anchors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import struct

# The logical names of a param's dimensions (and `layout.RULES`' keys)
EMBED = "embed"  # the model's width: what FSDP splits to store a param
Q_HEADS, KV_HEADS = "q_heads", "kv_heads"  # attention's heads (x head_dim), query and key-value
MLP = "mlp"  # an MLP's hidden units (an expert's too)
VOCAB = "vocab"  # the vocabulary: the embedding's rows, the head's columns
EXPERTS = "experts"  # a mixture's experts
LAYERS = "layers"  # the leading axis of a stack of layers (walked by a scan, never split)
RANK = "rank"  # a low-rank adapter's rank: split to store a factor that has no width
NAMES = (EMBED, Q_HEADS, KV_HEADS, MLP, VOCAB, EXPERTS, LAYERS, RANK)


class Param(nn.LogicallyPartitioned):
    """A param's value with its logical `names` and its roles: `fp32` (kept in fp32 for
    compute), `fixed` (never trained: no gradient reaches it and no optimizer moves it)."""

    fp32: bool = struct.field(default=False, pytree_node=False)
    fixed: bool = struct.field(default=False, pytree_node=False)


def is_param(x: Any) -> bool:
    """Whether `x` is a declared param's box (`Param`)."""
    return isinstance(x, Param)


def declare(init: Callable, names: tuple, *, fp32: bool = False, fixed: bool = False) -> Callable:
    """`init` whose value comes boxed with `names` (one a dimension) and the roles `fp32` and
    `fixed`; its `names` attribute says them (an adapter's factors take theirs from their
    kernel's)."""
    names = tuple(names)
    if unknown := [n for n in names if n is not None and n not in NAMES]:
        raise ValueError(f"declare: unknown logical axes {unknown}; the names are {NAMES}")

    @functools.wraps(init)
    def boxed(*args: Any, **kwargs: Any) -> Param:
        value = init(*args, **kwargs)
        if len(value.shape) != len(names):
            raise ValueError(f"declare: {len(names)} names {names} for a {value.shape} param")
        return Param(value, names, fp32=fp32, fixed=fixed)

    boxed.names, boxed.fp32 = names, fp32
    return boxed


def stacked(tree: Any) -> Any:
    """`tree`'s boxes with `LAYERS` before their names: what a stack of layers initialised
    under `jax.vmap` (one layer's boxes, a leading axis on each value) declares."""
    add = lambda b: b.replace(names=(LAYERS, *b.names)) if isinstance(b, Param) else b
    return jax.tree.map(add, tree, is_leaf=lambda x: isinstance(x, Param))


def unboxed(tree: Any) -> Any:
    """`tree` (variables, or any tree with `Param` boxes) with plain values."""
    return nn.meta.unbox(tree)


def _key(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


@dataclasses.dataclass(frozen=True)
class Axes:
    """The declared params of a model: `entries`, `(path, names, fp32)` each (`path` a tuple
    of keys from the params' top, `names` None where the param declared none)."""

    entries: tuple[tuple[tuple[str, ...], tuple | None, bool], ...] = ()
    fixed: tuple[tuple[str, ...], ...] = ()  # the paths of the params whose role is `fixed`

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.entries, self.fixed))

    def __hash__(self) -> int:  # once: a train state's static part, hashed at every step's call
        return self._hash

    @functools.cached_property
    def _table(self) -> dict[tuple[str, ...], tuple[tuple | None, bool]]:
        return {path: (names, fp32) for path, names, fp32 in self.entries}

    def lookup(self, path: tuple) -> tuple[tuple | None, bool]:
        """`(names, fp32)` of the param whose path ends `path` (a state leaf's: a moment's
        path ends with its param's), the longest such; `(None, False)` where none does."""
        keys = tuple(_key(k) for k in path)
        for start in range(len(keys)):
            if keys[start:] in self._table:
                return self._table[keys[start:]]
        return None, False

    def of(self, path: tuple) -> tuple | None:
        """The logical names of the leaf at `path` (`lookup`), None where undeclared."""
        return self.lookup(path)[0]

    def is_fixed(self, path: tuple) -> bool:
        """Whether the param whose path ends `path`'s (a state leaf's, as `lookup`) is never
        trained (its role `fixed`)."""
        keys = tuple(_key(k) for k in path)
        return any(keys[-len(f) :] == f for f in self.fixed if len(f) <= len(keys))

    def kept_fp32(self, path: tuple) -> bool:
        """Whether the param at `path` declared itself kept in fp32 for compute."""
        return self.lookup(path)[1]

    @property
    def undeclared(self) -> list[str]:
        """The "/"-joined paths of the params that declared no names."""
        return ["/".join(path) for path, names, _ in self.entries if names is None]

    def __len__(self) -> int:
        return len(self.entries)


def declared(params: Any) -> Axes:
    """The `Axes` of `params` as `model.init` returns them (boxed where declared)."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Param))
    entries, fixed = [], []
    for path, leaf in flat[0]:
        keys = tuple(_key(k) for k in path)
        if isinstance(leaf, Param):
            entries.append((keys, tuple(leaf.names), bool(leaf.fp32)))
            fixed += [keys] if leaf.fixed else []
        else:
            entries.append((keys, None, False))
    return Axes(tuple(entries), tuple(fixed))


def declared_of(init: Callable[..., Mapping], *args: Any) -> tuple[Axes, Any]:
    """`(Axes, shapes)` of the params `init(*args)` returns (`{"params": ...}` or the params),
    traced abstractly (`jax.eval_shape`: nothing is allocated); `shapes` unboxed."""
    variables = jax.eval_shape(init, *args)
    params = variables.get("params", variables) if isinstance(variables, Mapping) else variables
    return declared(params), unboxed(params)
