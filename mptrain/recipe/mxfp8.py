"""MXFP8 matmuls (`fp8.scaling="mxfp8"`): block scaling instead of one scale a tensor.

Each run of 32 values along a matmul's contracting axis shares a power-of-two scale (E8M0) and
keeps its values in e4m3 (the OCP Microscaling format, v1.0): the scale follows the block, so
no amax history and no per-tensor scale is needed, and one outlier costs only its own block.
Forward and both gradients quantize so (JAX's `mxfp8` config, as torchao's MXFP8 recipe).

On a GPU the matmul is `jax.nn.scaled_dot_general`, which XLA compiles to cuDNN's block-scaled
GEMM (`__cudnn$blockScaledDot`) for a Blackwell GPU (`--target=b200`) and to a dequantize and a
bf16 GEMM for a Hopper, which has no MX tensor cores. JAX has no CPU lowering for it, so a CPU
run computes the same rounding in fp32 (`emulated`): the numerics, not the speed.

`matmul` also reports the step's amaxes (input, kernel, gradient) through the probe, as
`fp8.matmul` does, so the log's per-layer amaxes and the precision report cover MXFP8 too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 32  # values sharing one scale
E4M3_MAX = 448.0


def quantize(x: jax.Array, axis: int) -> jax.Array:
    """`x` after MXFP8 rounding in blocks of 32 along `axis`, in fp32: each block divided by
    2**ceil(log2(its amax / 448)), rounded to e4m3, multiplied back. The scale rounds up, as
    JAX's `mxfp8` quantization does, so no value clips (the OCP spec's floor rule puts a
    block's amax in [256, 512) and clips what lies above e4m3's 448)."""
    x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    size = x.shape[-1]
    pad = -size % BLOCK  # zeros: they change no block's amax
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    blocks = padded.reshape(*padded.shape[:-1], -1, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    exponent = jnp.ceil(jnp.log2(jnp.where(amax > 0, amax / E4M3_MAX, 1.0)))
    # E8M0's range; ldexp, as XLA's exp2 need not give a power of two exactly
    scale = jnp.ldexp(jnp.float32(1), jnp.clip(exponent, -127, 127).astype(jnp.int32))
    q = jnp.clip(blocks / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    out = (q.astype(jnp.float32) * scale).reshape(padded.shape)[..., :size]
    return jnp.moveaxis(out, -1, axis)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` of MXFP8-rounded values, accumulated in fp32. An e4m3 value times a power of
    two is exact in bf16 (3 mantissa bits of its 7), so the operands go in as bf16: the same
    products, and the precision report counts the emulation at the compute dtype."""
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def emulated(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`x @ kernel` (`[M, K] @ [K, N]`) with MXFP8 operands, in fp32, returned in x's dtype."""
    return _dot(quantize(x, 1), quantize(kernel, 0)).astype(x.dtype)


def _emulated_fwd(x, kernel):
    return emulated(x, kernel), (x, kernel)


def _emulated_bwd(residuals, dy):
    x, kernel = residuals
    dx = _dot(quantize(dy, 1), quantize(kernel, 1).T)  # blocks along N, the contracted axis
    dk = _dot(quantize(x, 0).T, quantize(dy, 0))  # blocks along M
    return dx.astype(x.dtype), dk.astype(kernel.dtype)


emulated.defvjp(_emulated_fwd, _emulated_bwd)


def _scaled(x: jax.Array, kernel: jax.Array) -> jax.Array:
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3  # input, kernel, gradient
    numbers = (((1,), (0,)), ((), ()))
    return jax.nn.scaled_dot_general(x, kernel, numbers, x.dtype, configs=configs)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def matmul(x: jax.Array, kernel: jax.Array, amax_probe: jax.Array, emulate: bool) -> jax.Array:
    """`x @ kernel` (2-D) in MXFP8; the gradient with respect to `amax_probe` (`fp8.probe()`) is
    `[amax_x, amax_kernel, amax_grad]`. `emulate`: the CPU's fp32 rounding instead of JAX's
    `scaled_dot_general`."""
    del amax_probe
    return (emulated if emulate else _scaled)(x, kernel)


def _matmul_fwd(x, kernel, amax_probe, emulate):
    del amax_probe
    y, vjp = jax.vjp(emulated if emulate else _scaled, x, kernel)
    return y, (vjp, jnp.stack([_amax(x), _amax(kernel)]))


def _matmul_bwd(emulate, residuals, dy):
    del emulate
    vjp, amaxes = residuals
    dx, dk = vjp(dy)
    return dx, dk, jnp.append(amaxes, _amax(dy))


matmul.defvjp(_matmul_fwd, _matmul_bwd)
