"""Grouped matmuls for a mixture of experts (`moe`): `x [M, K]`, its rows sorted
into groups of `sizes [G]` rows, times each group's own `w [G, K, N]`; rows past the groups are
undefined. Two ways, by `KERNELS`:

  * "xla": `jax.lax.ragged_dot` with fp32 results. A TPU runs each as one grouped-matmul
    kernel (Mosaic's); XLA:CPU loops over the groups. An H100 runs it as a dense matmul of
    every row against every group's `w` (`docs/measured/moe_compiled.py`: 128 times the routed
    FLOPs and 32 GiB of temporaries for a Qwen3-30B-A3B layer at 8,192 tokens): on a GPU the
    fallback, for chips "mosaic_gpu" does not cover;
  * "mosaic_gpu": JAX's own Hopper kernels (`jax.experimental.pallas.ops.gpu`: its
    `ragged_dot` for the forward and, with `transpose_rhs`, the input's gradient; its
    `transposed_ragged_dot` for the weights' gradient, one `[K, N]` block a group), bound by
    a `jax.custom_vjp`. Each accumulates in fp32 (wgmma) and rounds its result to the
    operands' 16 bits once. The same Qwen3 layer compiles for an H100 to three kernels and
    0.09 GiB of temporaries. Operands in bf16 or fp16, `K` and `N` multiples of 128: others
    (gpt-oss's 2,880) are padded with zeros up to one where that adds at most an eighth.

"auto" (`kernel_for`) takes "mosaic_gpu" on a Hopper GPU (compute capability 9.x) with 16-bit
operands and widths that are multiples of 128 or padded to one, "xla" elsewhere; "mosaic_gpu"
asked for where it cannot run is refused before anything compiles. `REFERENCE` stands in for
the Mosaic kernels with XLA's ops of the same signatures, so the custom VJP's wiring (and the
padding) is tested on a CPU (`tests/models/moe_test.py`); the kernels' own numbers are JAX's,
checked on an H100 by `scripts/gpu_check.py`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp

KERNELS = ("auto", "xla", "mosaic_gpu")
_BLOCKS = {"block_m": 128, "block_n": 128, "block_k": 64, "grid_block_n": 1}


class Kernels(NamedTuple):
    """The three grouped matmuls a custom VJP needs, each `(a, b, sizes) -> 16-bit result`:
    `forward` `a [M, K] @ b[g] [K, N]`; `input_grad` `a [M, N] @ b[g].T` (`b [G, K, N]`);
    `weight_grad` `[G, K, N]`: each group's rows of `a [M, K]`, transposed, times `b [M, N]`."""

    forward: Any
    input_grad: Any
    weight_grad: Any


def _mosaic(sms: int) -> Kernels:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as r
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t

    def weight_grad(a, b, sizes):
        # The kernel sizes its grid by `jax.devices()[0].core_count`: a plan on a host without
        # the GPU has CPU devices there; tell it the SMs of the GPU it compiles for.
        run = lambda: t.transposed_ragged_dot(
            a, b, group_sizes=sizes, max_concurrent_steps=2, **_BLOCKS
        )
        if getattr(jax.devices()[0], "core_count", None):
            return run()
        stand_in = type("Device", (), {"core_count": sms})()
        with mock.patch.object(jax, "devices", lambda *args: [stand_in]):
            return run()

    run = functools.partial(r.ragged_dot, max_concurrent_steps=4, **_BLOCKS)
    return Kernels(
        forward=lambda a, b, sizes: run(a, b, group_sizes=sizes),
        input_grad=lambda a, b, sizes: run(a, b, group_sizes=sizes, transpose_rhs=True),
        weight_grad=weight_grad,
    )


def _reference_weight_grad(a, b, sizes):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(a, b, sizes, dims).astype(a.dtype)


REFERENCE = Kernels(
    forward=lambda a, b, sizes: jax.lax.ragged_dot(a, b, sizes).astype(a.dtype),
    input_grad=lambda a, b, sizes: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), sizes),
    weight_grad=_reference_weight_grad,
)


def custom_vjp(kernels: Kernels):
    """`matmul(x, w, sizes)` whose forward and gradients are `kernels`' three grouped matmuls."""

    @jax.custom_vjp
    def matmul(x, w, sizes):
        return kernels.forward(x, w, sizes)

    def forward(x, w, sizes):
        return kernels.forward(x, w, sizes), (x, w, sizes)

    def backward(saved, grad):
        x, w, sizes = saved
        grad = grad.astype(x.dtype)
        return kernels.input_grad(grad, w, sizes), kernels.weight_grad(x, grad, sizes), None

    matmul.defvjp(forward, backward)
    return matmul


WIDTH_MULTIPLE = 128  # the Mosaic kernels' K and N: the model's and each expert's widths


def kernel_for(setting: str, backend: Any, dtype: Any, widths: dict[str, int]) -> str:
    """The kernel `setting` ("auto" or one of `KERNELS`) names for `backend`
    (`attention.Backend`), operands of `dtype` and the matmuls' `widths` (`{"model.d_model":
    ..., "model.expert_d_ff": ...}`). "auto" takes "mosaic_gpu" where it runs, "xla" elsewhere;
    "mosaic_gpu" where it cannot run is a `ValueError` naming the key and what stands in its
    way, raised before anything compiles."""
    capability = backend.compute_capability if backend is not None else None
    hopper = backend is not None and backend.platform == "gpu" and bool(capability)
    hopper = hopper and capability[0] == 9
    odd = {key: width for key, width in widths.items() if _padded(width) - width > width / 8}
    if not hopper:
        where = backend.platform if backend is not None else "unknown"
        if where == "gpu":
            where = f"a GPU of compute capability {'.'.join(map(str, capability or ()))}"
        why = f"runs on a Hopper GPU (compute capability 9.x) only; this step runs on {where}"
    elif jnp.dtype(dtype).itemsize != 2:
        why = f"takes 16-bit operands; the compute dtype is {jnp.dtype(dtype).name}"
    elif odd:
        shown = ", ".join(f"{key}={width}" for key, width in odd.items())
        why = (
            f"takes widths that are multiples of {WIDTH_MULTIPLE} (others padded with zeros "
            f"up to one, at most an eighth wider); {shown}"
        )
    else:
        why = ""
    if setting == "auto":
        return "xla" if why else "mosaic_gpu"
    if setting == "mosaic_gpu" and why:
        raise ValueError(
            f"model.expert_matmul='mosaic_gpu': JAX's Mosaic GPU kernel {why}; 'xla' runs "
            "anywhere, and 'auto' takes the kernel where it can"
        )
    return setting


@jax.custom_vjp
def _ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """XLA's `ragged_dot` with fp32 results whose gradient's matmuls take `x`'s dtype, as the
    Mosaic kernels' do: differentiated as it stands, the fp32 cotangent would make both of
    them fp32 matmuls (a plan of gpt-oss-20b found 49% of its step's FLOPs there)."""
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def _ragged_dot_backward(saved, grad):
    x, w, sizes = saved
    _, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
    return (*pullback(grad.astype(x.dtype)), None)


_ragged_dot.defvjp(
    lambda x, w, sizes: (_ragged_dot(x, w, sizes), (x, w, sizes)), _ragged_dot_backward
)


def matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, kernel: str, sms: int = 0):
    """`x @ w[group]` by `kernel` ("xla": fp32 results; "mosaic_gpu": `x`'s dtype, accumulated
    in fp32; "reference": the Mosaic kernels' stand-ins); `sms`: the GPU's multiprocessors."""
    if isinstance(kernel, Kernels):  # three of one's own (a test's)
        return custom_vjp(kernel)(x, w, sizes)
    if kernel == "xla":
        return _ragged_dot(x, w, sizes)
    kernels = REFERENCE if kernel == "reference" else _mosaic(sms)
    (k, n), (kp, np_) = w.shape[1:], (_padded(w.shape[1]), _padded(w.shape[2]))
    if (k, n) == (kp, np_):
        return custom_vjp(kernels)(x, w, sizes)
    # zeros up to the kernels' multiple: they add nothing, and their gradients are dropped
    x = jnp.pad(x, ((0, 0), (0, kp - k)))
    w = jnp.pad(w, ((0, 0), (0, kp - k), (0, np_ - n)))
    return custom_vjp(kernels)(x, w, sizes)[:, :n]


def _padded(width: int) -> int:  # up to the Mosaic kernels' multiple
    return -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
