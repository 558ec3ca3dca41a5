"""8-bit block-quantized optimizer state: the `"q8"` storage dtype of `optim.adamw`'s moments.

A tensor of at least `min_size` elements (smaller ones, biases and norms, stay fp32) is cut into
blocks of `block_size` consecutive elements of its flattened form; each block keeps one fp32
scale (its largest magnitude over 448) and one 8-bit code per element. The code is the value
over the scale in float8 e4m3 (3 mantissa bits, exponents 2^-9..2^8): a floating-point code
map, so small elements of a block keep about 6% relative precision however far below the
block's largest they sit, where a linear int8 map would round everything under 1/254 of it
to zero. The second moment spans many more decades than the first (it is a square), so it is
coded in square-root space: `sqrt(nu)` is what Adam divides by, and its range is half as wide.

Blocks and layout depend only on the tensor's global shape, never on the mesh: the codes keep
the tensor's shape (so they shard as the tensor does under FSDP), and the scales have the shape
`shape[:k] + (blocks,)`, where `shape[k:]` is the shortest trailing part of the shape whose size
is a multiple of the block (when there is none, the whole flattened tensor, padded). Blocks never
straddle a leading index, so a tensor split over a leading dimension splits its scales with it.

Rounding to the code is stochastic by default (unbiased, like bf16 moments here): the second
moment moves by 0.1% of itself per step, far below the code's resolution, and rounded to
nearest it would mostly stand still. The random bits are a function of the key and the global
shape only, so every mesh rounds alike.

Peers: bitsandbytes' and torchao's 8-bit Adam use a 256-entry dynamic-exponent code looked up
in a table, rounded to nearest; mptrain uses the hardware-friendly e4m3 cast (no table, no
gather) and rounds stochastically.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

BLOCK_SIZE = 256
# (bound, why) of a block's size: blocks past ~a million elements save nothing and pad a lot
MAX_BLOCK = (2**20, "each tensor is padded to whole blocks; one fp32 scale a block is 1/4 byte")
BLOCK_SETTING = (BLOCK_SIZE, 1, *MAX_BLOCK)  # optimizer.q8_block_size: default, low, high, why
MIN_SIZE = 4096
_CODE = jnp.float8_e4m3fn
_CODE_MAX = float(jnp.finfo(_CODE).max)  # 448
_CODE_MIN_EXPONENT = -9  # e4m3's smallest subnormal is 2^-9
_MANTISSA_BITS = 3
KINDS = ("signed", "sqrt")  # the first moment as it is; the second in square-root space


@struct.dataclass
class Q8:
    """A quantized tensor: `codes` (uint8, the tensor's shape: e4m3 bit patterns) and
    `scales` (float32, one per block). `kind` and `block_size` are static."""

    codes: jax.Array
    scales: jax.Array
    kind: str = struct.field(pytree_node=False, default="signed")
    block_size: int = struct.field(pytree_node=False, default=BLOCK_SIZE)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def shardings(self, spec: PartitionSpec, mesh: Mesh) -> Q8:
        """The `NamedSharding`s of the codes and the scales where the tensor this stands for is
        split as `spec` on `mesh` (`scales_spec`): what `parallel.sharding` lays it out by."""
        scales = scales_spec(tuple(spec), self.shape, self.block_size, dict(mesh.shape))
        return self.replace(
            codes=NamedSharding(mesh, spec), scales=NamedSharding(mesh, PartitionSpec(*scales))
        )


def is_q8(x: Any) -> bool:
    return isinstance(x, Q8)


def quantized(shape: tuple[int, ...], min_size: int = MIN_SIZE) -> bool:
    """Whether a tensor of this global shape is stored in 8 bits (else fp32)."""
    return math.prod(shape) >= min_size


def split(shape: tuple[int, ...], block_size: int) -> int:
    """`k`: blocks run along `shape[k:]`, the shortest trailing part whose size is a multiple
    of `block_size` (0 when none is: the whole tensor, padded)."""
    for k in range(len(shape) - 1, -1, -1):
        if math.prod(shape[k:]) % block_size == 0:
            return k
    return 0


def scales_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    k = split(shape, block_size)
    return (*shape[:k], -(-math.prod(shape[k:]) // block_size))


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
    """`x` as `shape[:k] + (blocks, block_size)`, zero-padded where the blocks overrun."""
    k = split(x.shape, block_size)
    lead, inner = x.shape[:k], math.prod(x.shape[k:])
    flat = x.reshape(*lead, inner)
    pad = -inner % block_size
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    return flat.reshape(*lead, -1, block_size)


def _unblocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    k = split(shape, blocks.shape[-1])
    flat = blocks.reshape(*shape[:k], -1)[..., : math.prod(shape[k:])]
    return flat.reshape(shape)


def zeros(shape: tuple[int, ...], kind: str, block_size: int = BLOCK_SIZE) -> Q8:
    return Q8(
        codes=jnp.zeros(shape, jnp.uint8),
        scales=jnp.zeros(scales_shape(shape, block_size), jnp.float32),
        kind=kind,
        block_size=block_size,
    )


def _round_to_code(y: jax.Array, key: jax.Array | None) -> jax.Array:
    """`y` (fp32, |y| <= 448) to e4m3: to nearest (ties to even), or stochastically with `key`:
    up or down to the neighbouring codes with probability given by the distance to each.

    Both round in fp32 onto the codes' grid, so the final cast is exact. Left to the cast, the
    rounding could vanish where the codes are read back in the same program: XLA folds the
    uint8 bitcasts away, and a compiler allowed excess precision may then skip the remaining
    fp32 -> e4m3 -> fp32 round trip (XLA:GPU's default)."""
    magnitude = jnp.abs(y)
    # the spacing of codes around y: 2^(exponent - 3) in the normal range, 2^-9 below it; the
    # power of two is y's own with the mantissa bits cleared, exact on every backend
    bits = jax.lax.bitcast_convert_type(magnitude, jnp.uint32) & jnp.uint32(0x7F800000)
    power = jax.lax.bitcast_convert_type(bits, jnp.float32)
    step = jnp.maximum(power * 2.0**-_MANTISSA_BITS, 2.0**_CODE_MIN_EXPONENT)
    if key is None:
        steps = jnp.round(magnitude / step)  # ties to even, as a cast would
    else:
        steps = jnp.floor(magnitude / step + jax.random.uniform(key, y.shape, jnp.float32))
    return (jnp.sign(y) * jnp.minimum(steps * step, _CODE_MAX)).astype(_CODE)


def quantize(
    x: jax.Array, kind: str, block_size: int = BLOCK_SIZE, key: jax.Array | None = None
) -> Q8:
    """fp32 `x` as a `Q8`; `kind` "sqrt" (for values >= 0) codes `sqrt(x)`. `key`: round
    stochastically. Non-finite input gives non-finite codes (the train step drops them)."""
    values = jnp.sqrt(x) if kind == "sqrt" else x
    blocks = _blocks(values.astype(jnp.float32), block_size)
    scales = jnp.max(jnp.abs(blocks), axis=-1) / _CODE_MAX
    scaled = blocks / jnp.where(scales > 0, scales, 1.0)[..., None]
    scaled = jnp.clip(scaled, -_CODE_MAX, _CODE_MAX)  # the division may land a hair above
    codes = _round_to_code(_unblocks(scaled, x.shape), key)
    return Q8(jax.lax.bitcast_convert_type(codes, jnp.uint8), scales, kind, block_size)


def dequantize(q: Q8) -> jax.Array:
    """The fp32 tensor `q` stands for."""
    codes = jax.lax.bitcast_convert_type(q.codes, _CODE).astype(jnp.float32)
    values = _unblocks(_blocks(codes, q.block_size) * q.scales[..., None], q.shape)
    return jnp.square(values) if q.kind == "sqrt" else values


def scales_spec(codes_spec: tuple, shape: tuple[int, ...], block_size: int, ways: Any) -> tuple:
    """The partition of the scales that goes with the codes' partition `codes_spec`: a split
    leading dimension splits the scales alike; a split inside the blocked part splits the
    blocks when they divide evenly, else the (small) scales are replicated. `ways`: the
    devices a split takes, one count for every axis or a mesh's `{axis: size}`."""
    k = split(shape, block_size)
    spec = [None] * (k + 1)
    for dim, axis in enumerate(codes_spec):
        if axis is None:
            continue
        names = axis if isinstance(axis, tuple) else (axis,)
        count = math.prod(ways[a] for a in names) if isinstance(ways, dict) else ways
        if dim < k:
            spec[dim] = axis
        elif spec[k] is None and scales_shape(shape, block_size)[k] % count == 0:
            spec[k] = axis
    return tuple(spec)


def nbytes_per_element(block_size: int = BLOCK_SIZE) -> float:
    """Bytes of a quantized tensor per element: 1 for the code, 4/block_size for the scale."""
    return 1 + 4 / block_size
