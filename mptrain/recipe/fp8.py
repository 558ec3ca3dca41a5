"""fp8 matmuls with their scaling state as train state (the building block of `fp8-mixed`).

A selected matmul `x @ kernel` runs with both operands quantized to e4m3 forward and the
incoming gradient quantized to e5m2 backward, each with a per-tensor scale, accumulating in
fp32: `dot_general` on f8 operands, which XLA lowers to cuBLASLt's fp8 GEMM on Hopper and
emulates with converts elsewhere. This is flax's "direct" fp8 dot (`Fp8DirectDotGeneralOp`)
rather than its quantize-dequantize pattern, so that the program itself says f8 and the
precision audit counts the FLOPs by fp8 dtype without knowing what a GPU compiler will fuse.

What flax leaves to the user, and this module settles:

- **Where the new amaxes go.** The three amaxes a step measures (input, kernel, output
  gradient) leave the differentiated function as the *cotangent of a probe*: a zero `f32[3]`
  input that the matmul ignores forward and whose "gradient" is `[amax_x, amax_k, amax_g]`.
  The step reads them next to the parameter gradients, so they follow the same paths: max-
  combined over accumulation micro-batches (`combine`), all-reduced across devices (XLA takes
  the max of a sharded tensor globally), dropped with the rest of a skipped step.
- **Where the scaling state lives.** `Meta` (amax history and scales) is a plain pytree of
  fp32 arrays: checkpointed, resumed and selected on skip like any other train state.

Scales divide: `q = clip(x / scale)`, `x ~ q * scale`. Delayed scaling takes the scale from
the history of earlier steps' amaxes (`update`), so a step's scale is known before the step;
current scaling (`Recipe.current`) takes it from the tensor itself, one extra reduction.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mptrain import errors
from mptrain.parallel import view
from mptrain.recipe import mxfp8

E4M3 = jnp.float8_e4m3fn  # forward operands: more mantissa
E5M2 = jnp.float8_e5m2  # gradients: more range
MAX = {E4M3: float(jnp.finfo(E4M3).max), E5M2: float(jnp.finfo(E5M2).max)}  # 448, 57344
META, PROBES = "fp8", "fp8_probe"  # the model_state collections of the scaling state, the probes
# The order of the three tensors in a probe, an amax vector and a `Meta`'s rows.
TENSORS = ("x", "kernel", "grad")
DTYPES = (E4M3, E4M3, E5M2)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How scales are chosen. `history`: amaxes kept per tensor (delayed scaling reads their
    max); `margin`: the scale leaves `2**margin` of headroom below the format's max;
    `current`: scale each tensor by its own amax at use instead of the history's."""

    history: int = 1024
    margin: int = 0
    current: bool = False
    # which matmuls: the first and last `bf16_layers` blocks keep theirs in the compute dtype;
    # with `min_size`, a matmul runs in fp8 only if its input and output features both exceed
    # it and are multiples of 16 (`selected`)
    bf16_layers: int = 0
    min_size: int = 0
    # MXFP8 block scaling (`mptrain.recipe.mxfp8`) instead of a scale a tensor; `emulate`: the
    # model runs on a CPU, which computes its rounding in fp32 (set by the model's platform)
    block: bool = False
    emulate: bool = False


# What an unset `fp8.*` key means where the model's record says nothing of it.
DEFAULTS = {"scaling": "delayed", "bf16_layers": 0, "min_size": 0}


def from_config(section: Any, model: Any = None, num_layers: int | None = None) -> Recipe:
    """The `Recipe` of `config.fp8` (`section`), its unset keys at the model's defaults
    (`model`: what its record says, `models.record.Record.fp8`; None or empty: the recipe's
    own: delayed scaling, every dense layer) and `Recipe`'s; a `ValueError` names a bad key,
    or a `bf16_layers` past what a model of `num_layers` blocks can keep in bf16."""
    model, default = {**DEFAULTS, **(model or {})}, Recipe()
    get = lambda key, value: errors.setting(section, key, value)
    scaling = errors.check_choice("fp8.scaling", get("scaling", model["scaling"]), SCALINGS)
    number = lambda key, low, bound: errors.check_integer(
        f"fp8.{key}", get(key, model.get(key, getattr(default, key))), low, *bound
    )
    ends = number("bf16_layers", 0, MAX_BF16_LAYERS)
    if isinstance(num_layers, int) and ends > (num_layers + 1) // 2:
        raise ValueError(
            f"fp8.bf16_layers={ends}: the model has {num_layers} blocks, and "
            f"{(num_layers + 1) // 2} at each end already keep every one in bf16; use fewer, "
            "or precision='bf16-mixed' for no fp8"
        )
    return Recipe(
        history=number("history", 1, MAX_HISTORY),
        margin=number("margin", 0, MAX_MARGIN),
        current=scaling == "current",
        block=scaling == "mxfp8",
        bf16_layers=ends,
        min_size=number("min_size", 0, MAX_MIN_SIZE),
    )


SCALINGS = ("delayed", "current", "mxfp8")


def on(recipe: Recipe | None, platform: str) -> Recipe | None:
    """`recipe` as a model compiled for `platform` runs it: MXFP8 emulated off a GPU."""
    if not recipe or not recipe.block:
        return recipe
    return dataclasses.replace(recipe, emulate=platform != "gpu")


def selected(recipe: Recipe, in_features: int, out_features: int) -> bool:
    """Whether `recipe` runs a `[in_features, out_features]` kernel's matmul in fp8 (the size
    filter; the layer rule is the model's, `fp8_layers`)."""
    sizes, multiple = (in_features, out_features), mxfp8.BLOCK if recipe.block else 16
    if recipe.block and any(n % multiple for n in sizes):
        return False  # blocks of 32 along the contracted axis, forward and backward
    return not recipe.min_size or all(n > recipe.min_size and n % multiple == 0 for n in sizes)


def fp8_layers(recipe: Recipe | None, num_layers: int) -> tuple[int, int]:
    """`(start, stop)`: the blocks whose matmuls may run in fp8 (`bf16_layers` at each end
    keep theirs in the compute dtype); empty without a recipe."""
    if not recipe:
        return 0, 0
    start = min(recipe.bf16_layers, num_layers)
    return start, max(start, num_layers - recipe.bf16_layers)


# (bound, why) of `fp8.history` and `fp8.margin`, which `config.policy_of` checks
MAX_HISTORY = (
    2**16,
    "every fp8 tensor keeps this many amaxes in its train state, and the scale follows the "
    "largest of them (Transformer Engine's default is 1,024)",
)
MAX_MARGIN = (
    14,
    "e4m3 spans about 2**14.8 from its smallest normal number to its largest, 448: a larger "
    "margin scales the largest value below the smallest normal",
)


MAX_BF16_LAYERS = (2**16, "blocks kept in bf16 at each end of the stack")
MAX_MIN_SIZE = (2**20, "a matmul's input or output features at most this run in bf16")


def init_meta(recipe: Recipe = Recipe()) -> dict[str, jax.Array]:
    """The scaling state of one matmul: no amax seen yet, scales of 1, and `pending`, the max
    over the micro-batches of an accumulated update not yet applied."""
    return {
        "amax_history": jnp.zeros((len(TENSORS), recipe.history), jnp.float32),
        # 0: not calibrated yet; such a tensor is scaled by its own amax (current scaling)
        "scale": jnp.zeros((len(TENSORS),), jnp.float32),
        "pending": jnp.zeros((len(TENSORS),), jnp.float32),
        "saturated": jnp.zeros((len(TENSORS),), jnp.int32),
        # micro-batches per update: a micro-batch's gradient is that many times the batch's,
        # so its quantization scale is too (`matmul`); the scales above are the batch's
        "micro_batches": jnp.ones((), jnp.float32),
    }


def probe() -> jax.Array:
    """The zero input whose cotangent carries a step's amaxes out (see the module doc)."""
    return jnp.zeros((len(TENSORS),), jnp.float32)


def scale_for(amax: jax.Array, fp8_max: float, margin: int, previous: jax.Array) -> jax.Array:
    """The scale that maps `amax` to `fp8_max / 2**margin`; `previous` where `amax` is zero or
    not finite (nothing measured yet, or a step about to be skipped)."""
    scale = amax * (2.0**margin / fp8_max)
    usable = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(usable, scale, previous).astype(jnp.float32)


def update(
    meta: dict[str, jax.Array],
    amaxes: jax.Array,
    recipe: Recipe,
    applied: jax.Array | bool = True,
    micro_batches: jax.Array | int = 1,
) -> dict:
    """`meta` after a micro-batch that measured `amaxes` (`f32[3]`). They join `pending` by max;
    when the update is `applied` (the last of its `micro_batches`; always without gradient
    accumulation) the history rolls by one with `pending` in front, the gradient's amax divided
    by `micro_batches` (each micro-batch's mean loss scales its gradients by that many: by
    powers of two exactly, so 1, 2 or 8 micro-batches of one batch give the same bits), each
    scale comes from its history's max (delayed scaling), and `pending` starts again."""
    pending = combine(meta["pending"], amaxes)
    # (no `.at[]` updates here or below: they lower to scatters, which the audit flags)
    k = jnp.asarray(micro_batches, jnp.float32)
    per_update = pending / jnp.stack([jnp.float32(1), jnp.float32(1), k])
    history = jnp.concatenate([per_update[:, None], meta["amax_history"][:, :-1]], axis=1)
    maxima = jnp.max(history, axis=1)
    fp8_max = jnp.array([MAX[d] for d in DTYPES], jnp.float32)
    scale = scale_for(maxima, fp8_max, recipe.margin, meta["scale"])
    # the scale this update ran with could not hold its amax: values were clipped
    calibrated = meta["scale"] > 0  # an uncalibrated tensor was scaled by its own amax
    by_amax = not (recipe.current or recipe.block)  # only a history's scale can be outgrown
    clipped = (per_update > fp8_max * meta["scale"]) & calibrated & applied & by_amax
    return {
        "amax_history": jnp.where(applied, history, meta["amax_history"]),
        "scale": jnp.where(applied, scale, meta["scale"]),
        "pending": jnp.where(applied, jnp.zeros_like(pending), pending),
        "saturated": meta["saturated"] + clipped.astype(jnp.int32),
        "micro_batches": jnp.where(
            applied, jnp.asarray(micro_batches, jnp.float32), meta["micro_batches"]
        ),
    }


def combine(a: jax.Array, b: jax.Array) -> jax.Array:
    """Two micro-batches' amax vectors as one batch's: the max (exact, order-free)."""
    return jnp.maximum(a, b)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`x / scale`, clipped to the format's range (saturating, not inf), in `dtype`."""
    bound = MAX[dtype]
    return jnp.clip(x.astype(jnp.float32) / scale, -bound, bound).astype(dtype)


def saturated(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """How many elements of `x` the scale clips (int32)."""
    return jnp.sum(jnp.abs(x.astype(jnp.float32)) > MAX[dtype] * scale, dtype=jnp.int32)


def _amax(x: jax.Array) -> jax.Array:
    """`max |x|`; in a tensor group, of the logical matrix whose part `x` is (the max over the
    group: one scale for the matrix, as one device holding it whole would take)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    local = view.current()
    split = local and local.tensor()
    return amax if not split else jax.lax.pmax(amax, split.axis)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` for 2-D f8 operands, accumulated and returned in fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _matmul(x, kernel, scale, amax_probe, current):
    del amax_probe
    return _forward(x, kernel, scale, current)[0]


def _own(amax, fp8_max):
    """The scale of a tensor quantized by its own amax (current scaling)."""
    return scale_for(amax, fp8_max, 0, jnp.ones_like(amax))


def _pick(scale, own, current):
    """Delayed scaling uses `scale` once it is calibrated (> 0); before that, and under current
    scaling, the tensor's `own`."""
    return own if current else jnp.where(scale > 0, scale, own)


def _forward(x, kernel, scale, current):
    amaxes = jnp.stack([_amax(x), _amax(kernel)])
    own = _own(amaxes, jnp.float32(MAX[E4M3]))
    # A first step's input is scaled by 1, not by its own amax, which would depend on the
    # micro-batch (activations of O(1) fit e4m3 at 1); its kernel by its own amax: small
    # weights would lose their bits at 1.
    own = own if current else jnp.stack([jnp.float32(1), own[1]])
    scale = jnp.concatenate([_pick(scale[:2], own, current), scale[2:]])
    xq, kq = quantize(x, scale[0], E4M3), quantize(kernel, scale[1], E4M3)
    y = (_dot(xq, kq) * (scale[0] * scale[1])).astype(x.dtype)
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))  # residuals are arrays
    return y, (xq, kq, scale, amaxes, dtypes)


def _matmul_fwd(x, kernel, scale, amax_probe, current):
    del amax_probe
    return _forward(x, kernel, scale, current)


def _matmul_bwd(current, residuals, dy):
    xq, kq, scale, forward_amaxes, (x_like, k_like) = residuals
    x_dtype, k_dtype = x_like.dtype, k_like.dtype
    amax_g = _amax(dy)
    # a first step's gradient by its own amax too: at 1, gradients of 1e-5 flush to zero
    g_scale = _pick(scale[2], _own(amax_g, jnp.float32(MAX[E5M2])), current)
    gq = quantize(dy, g_scale, E5M2)
    dx = (_dot(gq, kq.T) * (g_scale * scale[1])).astype(x_dtype)
    dk = (_dot(xq.T, gq) * (scale[0] * g_scale)).astype(k_dtype)
    amaxes = jnp.append(forward_amaxes, amax_g)
    return dx, dk, jnp.zeros_like(scale), amaxes


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(
    x: jax.Array, kernel: jax.Array, meta: dict, amax_probe: jax.Array, recipe: Recipe = Recipe()
) -> jax.Array:
    """`x @ kernel` (`x` of any rank, contracting its last axis with `kernel`'s first) in fp8,
    returned in `x`'s dtype. `meta` gives the scales (`init_meta`, `update`); the gradient
    with respect to `amax_probe` (`probe()`) is this call's `[amax_x, amax_kernel, amax_grad]`.
    """
    lead = x.shape[:-1]
    scale = meta["scale"]
    if "micro_batches" in meta:  # the gradient of one of several micro-batches: that many times
        scale = scale * jnp.stack([jnp.float32(1), jnp.float32(1), meta["micro_batches"]])
    if recipe.block:  # MXFP8: block scales, the meta only logs the amaxes
        y = mxfp8.matmul(x.reshape(-1, x.shape[-1]), kernel, amax_probe, recipe.emulate)
    else:
        y = _matmul(x.reshape(-1, x.shape[-1]), kernel, scale, amax_probe, recipe.current)
    return y.reshape(*lead, kernel.shape[-1])


class DotGeneral(nn.Module):
    """A flax `dot_general_cls` (`nn.Dense(..., dot_general_cls=fp8.DotGeneral)`) that runs the
    Dense's matmul through `matmul`. Its scaling state is the variable `meta` of collection
    `fp8` and its probe the variable `amax` of collection `fp8_probe`: both land in the
    Trainer's `model_state`, where the step finds them (`step.make_train_step`)."""

    recipe: Recipe = Recipe()

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        (contract_lhs, contract_rhs), batch = dimension_numbers
        if batch != ((), ()) or tuple(contract_rhs) != (0,) or rhs.ndim != 2:
            raise ValueError("fp8.DotGeneral: only a Dense's `x @ kernel` is supported")
        if tuple(contract_lhs) != (lhs.ndim - 1,):
            raise ValueError("fp8.DotGeneral: only a Dense's `x @ kernel` is supported")
        if not selected(self.recipe, *rhs.shape):  # too thin to gain: as a Dense, no state
            return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
        meta = self.variable(META, "meta", init_meta, self.recipe)
        amax_probe = self.variable(PROBES, "amax", probe)
        # fp8 operands, fp32 accumulation, the result in lhs's dtype (precision has no say)
        return matmul(lhs, rhs, meta.value, amax_probe.value, self.recipe)


def update_state(
    model_state: dict,
    amaxes: dict,
    recipe: Recipe = Recipe(),
    applied: jax.Array | bool = True,
    micro_batches: jax.Array | int = 1,
) -> dict:
    """`model_state` with every fp8 layer's `meta` updated (`update`) by the amaxes its probe
    received (`amaxes`: the gradient of `model_state[PROBES]`)."""
    from flax import traverse_util

    metas = traverse_util.flatten_dict(model_state[META])
    for path, found in traverse_util.flatten_dict(amaxes).items():
        layer = path[:-1]  # (..., "amax") -> the layer's path
        old = {k[-1]: v for k, v in metas.items() if k[:-2] == layer and k[-2] == "meta"}
        one = functools.partial(update, recipe=recipe, applied=applied, micro_batches=micro_batches)
        # a scanned stack's layers: `[layers, 3]` amaxes, the state stacked on the same axis
        new = one(old, found) if found.ndim == 1 else jax.vmap(one)(old, found)
        for key, value in new.items():
            metas[(*layer, "meta", key)] = value
    return {**model_state, META: traverse_util.unflatten_dict(metas)}


def counters(model_state: Any, key: str = "saturated") -> jax.Array:
    """Traced: every fp8 layer's `saturated` counters (or, with `key="amax"`, the amaxes of
    its newest history entry) in one vector, in the order of `fp8_names.counter_names` (the step's
    metrics `fp8_saturated` and `fp8_amax`)."""
    from flax import traverse_util

    flat = sorted(traverse_util.flatten_dict(model_state[META]).items())
    if (
        key == "amax"
    ):  # (a stacked layer's rows one layer after another, as `fp8_names.counter_names`)
        found = [v[..., 0] for path, v in flat if path[-1] == "amax_history"]
    else:
        found = [v for path, v in flat if path[-1] == key]
    return jnp.concatenate([v.reshape(-1) for v in found])
