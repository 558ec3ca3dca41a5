"""The pieces of the model zoo that more than one model needs: its fp32 islands and its loss.

Every model gets its params already cast to the compute dtype ``dtype`` (e.g. bf16), but those
``keep_fp32`` keeps in fp32, and runs its matmuls and convolutions in it (``run_in``). The
helpers here are the places where a value must leave 16 bits; where the model goes on after
one, the helper ends with the cast back to ``dtype``:

  * ``einsum_f32_out``: a matmul with ``dtype`` operands and an fp32 accumulation and result, for
    values that go straight into a softmax (attention scores, LM logits), so they are never
    rounded to 16 bits first. Left to JAX, a matmul with ``preferred_element_type=float32`` is
    differentiated with the fp32 cotangent and the other operand upcast, i.e. its two gradient
    matmuls would run in fp32; its custom gradient casts the cotangent to the operands' dtype
    first, as plain 16-bit autodiff would, so the backward matmuls are 16-bit too (the LMs'
    heads, ``lm_loss.Head``, run it);
  * ``layer_norm_f32`` and ``batch_norm_f32``: normalisation with its statistics in fp32 (a 16-bit
    sum of squares over many activations overflows fp16 and loses bits in bf16). Only the result
    is cast back to ``dtype``, so the next matmul still gets 16-bit operands instead of being
    silently promoted to fp32;
  * ``logits_f32``: a classification head, a plain ``nn.Dense`` in ``dtype`` whose result is then
    cast to fp32, so the logits leave the model as fp32 and the softmax never sees 16 bits;
  * ``cross_entropy`` and ``classification_metrics``: the loss, computed from fp32 logits, so the
    softmax and the log never run in 16 bits, whatever dtype the logits arrive in.

Two helpers keep scatters out of the step, since a GPU runs a scatter-add with atomics: slow in
16 bits and nondeterministic in any dtype, which would break bit-identical runs and resumes:

  * ``embed`` (and the linen ``Embed``): a token lookup whose gradient is a matmul. For small
    vocabularies it multiplies a one-hot matrix by the table; for large ones it gathers from the
    table in whatever dtype it comes in and casts the rows after;
  * ``cross_entropy`` picks each target's logit with a compare-and-select over the vocabulary
    instead of ``take_along_axis``, whose gradient would be a scatter into the logits.

``kernel_init_as_matrix`` is no fp32 island: it makes conv kernel initialisation compile fast.
``Dtype`` is the models' annotation for a dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain.optim import q8
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import view

Dtype = Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_f32_out(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` with fp32 accumulation and an fp32 result, for fp32 islands.

    The gradient casts the incoming fp32 cotangent to ``a.dtype`` and runs both gradient matmuls
    on operands of that dtype (see the module docstring). ``spec`` is explicit (``"ij,jk->ik"``),
    without ``...`` or repeated indices, and each operand's indices appear in the other operand or
    in the output (true of every matmul).
    """
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _split_spec(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.replace(" ", "").split("->")
    sa, sb = inputs.split(",")
    if "." in spec or not set(sa) <= set(sb + out) or not set(sb) <= set(sa + out):
        raise ValueError(f"einsum_f32_out cannot differentiate {spec!r}")
    return sa, sb, out


def _einsum_f32_out_fwd(spec, a, b):
    _split_spec(spec)
    return einsum_f32_out(spec, a, b), (a, b)


def _einsum_f32_out_bwd(spec, residuals, g):
    a, b = residuals
    sa, sb, out = _split_spec(spec)
    g = g.astype(a.dtype)  # the end of the fp32 island, seen from the backward pass
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b.astype(a.dtype))
    db = jnp.einsum(f"{sa},{out}->{sb}", a, g)
    return da.astype(a.dtype), db.astype(b.dtype)


einsum_f32_out.defvjp(_einsum_f32_out_fwd, _einsum_f32_out_bwd)


def layer_norm_f32(x: jax.Array, dtype: Dtype, name: str) -> jax.Array:
    """LayerNorm computed in fp32 (mean, variance, rsqrt), result cast back to ``dtype``.

    Call it inside a compact module (it adds ``name`` there).
    """
    norm = nn.LayerNorm(
        dtype=jnp.float32,
        scale_init=axes_lib.declare(nn.initializers.ones, (axes_lib.EMBED,), fp32=True),
        bias_init=axes_lib.declare(nn.initializers.zeros, (axes_lib.EMBED,), fp32=True),
        name=name,
    )
    return norm(x).astype(dtype)


def batch_norm_f32(
    x: jax.Array,
    *,
    train: bool,
    dtype: Dtype,
    momentum: float,
    name: str,
    scale_init: Any = nn.initializers.ones,
) -> jax.Array:
    """BatchNorm as an fp32 island; call it inside a compact module (it adds ``name`` there).

    ``dtype=float32`` makes flax promote ``x`` to fp32 before the mean and variance reductions
    and keep the normalisation in fp32; the running statistics in ``batch_stats`` are created
    as fp32 zeros and ones and updated in fp32. With ``train=True`` it normalises with the
    batch's statistics and updates the running ones; with ``train=False`` it uses the running
    ones. Only the result is cast back to ``dtype``. Under a per-device gradient on a mesh, the
    batch statistics are averaged over the devices the batch is split over
    (``parallel.view``'s ``batch``), so they are those of the whole global batch.
    """
    y = nn.BatchNorm(
        use_running_average=not train,
        axis_name=_batch_axes() if train else None,
        momentum=momentum,
        epsilon=1e-5,
        dtype=jnp.float32,
        scale_init=axes_lib.declare(scale_init, (axes_lib.MLP,), fp32=True),
        bias_init=axes_lib.declare(nn.initializers.zeros, (axes_lib.MLP,), fp32=True),
        name=name,
    )(x)
    return y.astype(dtype)  # end of the island


def run_in(dtype: Dtype, layer: nn.Module, x: jax.Array, output: Dtype | None = None):
    """``layer(x)`` for a flax layer built with ``dtype=None`` (it computes in the widest dtype of
    its input and params), its input cast to ``dtype`` first: only a param the casting rule keeps
    in fp32 makes its matmul fp32, as the rule says. The result is cast to ``output`` (default
    ``dtype``), so it never widens the next layer."""
    return layer(x.astype(dtype)).astype(output or dtype)


def check_tokens(tokens: jax.Array, max_len: int) -> int:
    """The length of a language model's ``int[batch, length]`` tokens; a ``ValueError`` for
    other inputs, or a length past ``max_len`` (naming the key, for ``models.check_config``)."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be an integer [batch, length] array, got {tokens.dtype}"
            f"{list(tokens.shape)}"
        )
    length = tokens.shape[1]
    if length > max_len:
        raise ValueError(
            f"max_len={max_len}: shorter than the input (sequence length {length} exceeds "
            f"max_len={max_len}); raise it, or shorten the data's sequences (data.seq_len)"
        )
    return length


def logits_f32(x: jax.Array, num_classes: int, dtype: Dtype, name: str = "head") -> jax.Array:
    """A classification head, ``nn.Dense`` in ``dtype`` (``run_in``), whose logits leave as fp32,
    inside a compact module (as ``name``). The matmul's result is rounded to ``dtype`` (not every
    XLA backend has a bf16 x bf16 -> f32 dot), fp32 from the cast on: the loss never sees 16 bits.
    """
    head = nn.Dense(num_classes, dtype=None, name=name, **dense_inits((axes_lib.EMBED, None)))
    return run_in(dtype, head, x, jnp.float32)


def dense_inits(names: tuple, kernel_init: Any = nn.linear.default_kernel_init) -> dict:
    """`nn.Dense`'s (or `nn.Conv`'s) `kernel_init` and `bias_init` declaring the kernel's
    logical axes `names` (`parallel.axes`; a conv kernel's with its window's None first) and the
    bias's, the kernel's output."""
    return {
        "kernel_init": axes_lib.declare(kernel_init, names),
        "bias_init": axes_lib.declare(nn.initializers.zeros, names[-1:]),
    }


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Each token's ``logsumexp(logits) - logits[target]`` (``cross_entropy``'s, unmasked), the
    target's logit picked by a select over the vocabulary."""
    vocab = jnp.arange(logits.shape[-1], dtype=targets.dtype)
    picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy in nats over integer ``targets``, computed from fp32 logits.

    ``logsumexp(logits) - logits[target]``, the target's logit taken by a select over the
    vocabulary (exact: one term is non-zero), so the gradient is elementwise and XLA fuses it;
    a gather (``take_along_axis``) would be differentiated into a scatter.

    A target below 0 is masked (padding, a prompt): the mean is over the other tokens, so a
    batch's loss does not depend on how much of it is padding. A batch without masks takes
    ``jnp.mean`` of the losses as before masks existed, and the masked mean is computed apart,
    behind an optimization barrier: any masking fused with that mean made XLA:CPU evaluate the
    losses differently in a step and in a scan of steps (``steps_per_call``), an ulp apart. The
    second pass costs one more read of the logits, small beside the head's matmul that made them.
    """

    logits = logits.astype(jnp.float32)
    whole = jax.lax.optimization_barrier(jnp.mean(token_nll(logits, targets)))
    masked = masked_mean(token_nll(*jax.lax.optimization_barrier((logits, targets))), targets >= 0)
    return jnp.where(jnp.all(targets >= 0), whole, masked)


def masked_mean(values: jax.Array, valid: jax.Array) -> jax.Array:
    """The mean of ``values`` where ``valid``: their sum over the count, at least 1 (with none
    valid: 0 and zero gradients, not the NaN of 0 / 0).

    While a per-device gradient is traced (``parallel.view``'s ``batch``) the count is every
    device's: each device returns its sum over the global count, times the devices (which the
    gradient's reduction divides by), so the mean is the one device's mean of the whole batch
    even where devices hold different numbers of valid tokens (packed rows, a split sequence).
    """
    count = jnp.sum(valid, dtype=jnp.float32)
    total = jnp.sum(jnp.where(valid, values, 0.0))
    axes = _batch_axes()
    if axes is None:
        return total / jnp.maximum(count, 1.0)
    return total / jnp.maximum(jax.lax.psum(count, axes), 1.0) * jax.lax.psum(1, axes)


def classification_metrics(logits: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
    """Mean cross-entropy (nats) and accuracy over integer targets (those >= 0), computed from
    fp32 logits."""
    logits = logits.astype(jnp.float32)
    loss = cross_entropy(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return {"loss": loss, "accuracy": masked_mean(correct, targets >= 0)}


# A one-hot lookup costs 2 * vocab * features FLOPs per token each way, what an LM head of that
# vocabulary costs; up to this size that is a few percent of a transformer step, and it buys a
# deterministic, atomics-free gradient. Above it, a gather is cheaper.
ONE_HOT_MAX_VOCAB = 4096


def embed(table: jax.Array, ids: jax.Array, dtype: Dtype, one_hot: bool | None = None):
    """Rows ``table[ids]`` in ``dtype``, differentiable in ``table`` without a scatter-add.

    ``one_hot`` (default: vocabulary <= ``ONE_HOT_MAX_VOCAB``): ``one_hot(ids) @ table`` with
    ``dtype`` operands. The forward pass is exact (each output sums one row times 1.0 and zeros)
    and the table's gradient is the matmul ``one_hot.T @ grad``: no atomics, the same bits on
    every run. Otherwise the rows are gathered from the table as it comes (fp32 when the step
    keeps embeddings in fp32) and cast after, and the gradient is the same one-hot matmul taken
    chunk by chunk over the tokens (``_gathered``), accumulated in fp32.
    """
    vocab = table.shape[0]
    if one_hot if one_hot is not None else vocab <= ONE_HOT_MAX_VOCAB:
        return jax.nn.one_hot(ids, vocab, dtype=dtype) @ table.astype(dtype)
    return _gathered(table, ids, jnp.dtype(dtype))


# Elements of one chunk's one-hot matrix in a large table's gradient: 2**27 bf16 values (256 MiB;
# 1,024 tokens at Llama 3's 128,256 words). Fewer, larger chunks re-read the fp32 sum less often.
EMBED_GRAD_CHUNK_ELEMENTS = 2**27


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gathered(table: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """``table[ids]`` cast to ``dtype``, whose gradient is a matmul, not a scatter-add.

    Left to autodiff, a gather's gradient is a scatter-add into the table, which a GPU runs with
    atomics (nondeterministic; slow in 16 bits). Here it is ``one_hot(ids).T @ grad`` over
    chunks of tokens (the one-hot of all of them at once would be ``[tokens, vocab]``), with
    ``dtype`` operands (one-hot values are exact in any float) and the sum in fp32: at Llama 3's
    vocabulary about 2% of a step's FLOPs, for the same bits on every run.
    """
    return jnp.take(table, ids, axis=0).astype(dtype)


def _gathered_fwd(table, ids, dtype):
    return _gathered(table, ids, dtype), (table, ids)


def _gathered_bwd(dtype, residuals, grad):
    table, ids = residuals
    vocab, width = table.shape
    ids, grad = ids.reshape(-1), grad.reshape(-1, width).astype(dtype)
    chunk = max(1, min(ids.shape[0], EMBED_GRAD_CHUNK_ELEMENTS // vocab))
    pad = -ids.shape[0] % chunk  # padded tokens have id -1: a row of zeros in the one-hot
    ids = jnp.pad(ids, (0, pad), constant_values=-1).reshape(-1, chunk)
    grad = jnp.pad(grad, ((0, pad), (0, 0))).reshape(-1, chunk, width)

    def add(total, chunk):
        ids, grad = chunk
        hot = jax.nn.one_hot(ids, vocab, dtype=dtype)
        return total + jnp.einsum("cv,cd->vd", hot, grad, preferred_element_type=jnp.float32), None

    total, _ = jax.lax.scan(add, jnp.zeros((vocab, width), jnp.float32), (ids, grad))
    return total.astype(table.dtype), None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


class Embed(nn.Module):
    """``nn.Embed``'s lookup (same param name, ``embedding``) through ``embed``: no scatter."""

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32
    embedding_init: Any = nn.initializers.normal(stddev=1.0)
    one_hot: bool | None = None

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        shape = (self.num_embeddings, self.features)
        if self.has_variable("params", "embedding"):  # a frozen 8-bit table has no array shape
            table = self.get_variable("params", "embedding")
            if q8.is_q8(table):  # rows of whole blocks (`recipe.frozen`): gathered, then decoded
                rows = table.replace(codes=table.codes[ids], scales=table.scales[ids])
                return q8.dequantize(rows).astype(self.dtype)
        init = axes_lib.declare(self.embedding_init, (axes_lib.VOCAB, axes_lib.EMBED), fp32=True)
        table = self.param("embedding", init, shape)
        return embed(table, ids, self.dtype, self.one_hot)


def kernel_init_as_matrix(init: Any) -> Any:
    """Draws a conv kernel ``[..., in, out]`` as a ``[prod(...) * in, out]`` matrix, reshaped.

    The fan-in, and so the distribution of fan-in initialisers, is unchanged. It is a compile
    time fix: XLA:CPU takes seconds to compile a random draw of rank 3 or more (with jax's
    default partitionable threefry), and a fraction of a second for a rank-2 one.
    """

    def wrapped(key: jax.Array, shape: Sequence[int], dtype: Dtype = jnp.float32) -> jax.Array:
        return init(key, (math.prod(shape[:-1]), shape[-1]), dtype).reshape(shape)

    return wrapped


def _batch_axes() -> tuple[str, ...] | None:
    """The mesh axes the batch's work is split over while a per-device function is traced
    (`parallel.view`), else None: the batch is whole here."""
    local = view.current()
    return None if local is None else local.batch
