"""A language model's loss from its last hidden states: the head's matmul, the fp32 log-softmax
and the cross-entropy, chunk by chunk over the sequence, so no fp32 ``[tokens, vocab]`` exists.

The loss is an fp32 island (see ``layers``): the head's matmul takes 16-bit operands but sums
in fp32 and returns fp32 logits, and the log-softmax runs on those, so no logit is rounded to
16 bits. Done whole, that island is a step's largest array: at Llama 3's vocabulary of 128,256
the fp32 logits of 2 x 8192 tokens are 8.4 GB, and autodiff keeps them (or their softmax) for
the backward pass, then makes their gradient, as large again. ``token_loss`` takes ``chunk``
sequence positions at a time, of every sequence of the batch together: the batch axis is the
one data parallelism and FSDP shard, and a reshape across it would make XLA gather it.

  * Forward, a ``lax.scan`` over the chunks computes each chunk's logits, their logsumexp
    and the target's logit (picked by a compare-and-select: a gather's gradient would be a
    scatter, which a GPU runs with atomics), and keeps per token only the logsumexp.
  * Backward, a second scan recomputes each chunk's logits (the head's forward matmul again)
    and turns the per-token cotangents into the logits' gradient, ``softmax * g_lse`` plus
    ``onehot * g_picked``; casts it to the compute dtype, as ``layers.einsum_f32_out``'s
    gradient does, for the two gradient matmuls; and adds the kernel's gradient to an fp32 carry.

It is a ``jax.custom_vjp`` rather than autodiff of a ``jax.checkpoint``-ed scan because that
would carry the kernel's gradient in the kernel's dtype: in bf16, one rounding per chunk (16
of them for 8192 tokens in chunks of 512), where the unchunked matmul sums all the tokens in
its fp32 accumulator and rounds once. The fp32 carry (``[D, V]``, 2 GB at Llama 3 8B's head)
keeps that, and the result is cast to the kernel's dtype once. The masking, the means and the
z-loss are plain JAX on fp32 ``[B, L]`` values outside the rule, differentiated by JAX into the
per-token cotangents the rule takes. torchtune's ``LinearCrossEntropyLoss`` and torchtitan's
``ChunkedLossWrapper`` chunk the head and the loss over tokens in the same way in PyTorch.

The matmuls, each run on XLA:CPU with bf16 and fp16 operands (jax 0.10.2): the logits and the
kernel's gradient are 16-bit x 16-bit -> fp32 dots (``preferred_element_type``), so the chunk's
partial sum enters the carry unrounded; the hidden states' gradient is a 16-bit dot with a
16-bit result, one per chunk and never summed across chunks, as ``einsum_f32_out`` has it.
"""

from __future__ import annotations

import functools
import numbers
from math import inf
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain.models import layers
from mptrain.models import lora as lora_lib
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import view

# Under ``chunk=None``: one chunk while a sequence's logits are at most AUTO_CHUNK_ELEMENTS
# (64 MiB of fp32); else chunks of a power of two within that, but of AUTO_MIN_POSITIONS or
# more where a sequence's chunk stays within AUTO_MAX_ELEMENTS (256 MiB of fp32).
AUTO_CHUNK_ELEMENTS = 2**24
AUTO_MIN_POSITIONS = 512
AUTO_MAX_ELEMENTS = 2**26


def auto_chunk(length: int, vocab: int, width: int = 0) -> int:
    """Positions per chunk for ``chunk=None``: the whole ``length`` (one chunk) while
    ``length * vocab <= 2**24``; else the largest power of two ``c`` with ``c * vocab <= 2**24``
    (at least 1), raised to ``min(length, 512)`` where that many positions' logits stay within
    ``2**26``, or within the head's own fp32 gradient carry (``width * vocab``, ``width`` the
    hidden size) where that is larger.

    The floor of 512 is for the head's gradient: each chunk reads and writes the fp32 carry
    (``[D, V]``, 2.1 GB at Llama 3 8B's head) once, so its traffic is the number of chunks
    times 4.2 GB. At Llama 3's vocabulary of 128,256 the 2**24 rule alone gave chunks of 128,
    64 for 8192 tokens: 273 GB a step for the 8B on 8 H100s, 8.7% of its planned floor; chunks
    of 512 make it 72 GB (2.3%), and the plan's peak memory stayed 63.04 GiB (the 1b on one
    H100 stayed 69.55 GiB): the loss's chunk is not where the step peaks. Gemma 3's vocabulary
    of 262,208 is past 2**26 at 512 positions: 2**24's rule gave chunks of 32, 256 passes over
    its 3.75 GiB carry (Gemma-3-12B on 8 H100s, 16 x 8,192); 512 positions' logits are a
    seventh of that carry, so the carry's size allows them."""
    if length * vocab <= AUTO_CHUNK_ELEMENTS:
        return length
    chunk = 1 << max(0, (AUTO_CHUNK_ELEMENTS // vocab).bit_length() - 1)
    wide = min(length, AUTO_MIN_POSITIONS)
    bound = max(AUTO_MAX_ELEMENTS, width * vocab)
    return wide if chunk < wide and wide * vocab <= bound else chunk


def _check_chunk(chunk: Any, name: str) -> None:
    if chunk is not None and (
        isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1
    ):
        raise ValueError(f"{name}={chunk!r}: a positive number of sequence positions, or None")


def settings(loss: Any) -> tuple[int | None, float]:
    """``(chunk, z_loss)`` from a config's ``loss`` (``chunk_tokens``, ``z_loss``), checked by
    the rule ``token_loss`` applies; a ValueError names the key, the value and what is valid."""
    _check_chunk(loss.chunk_tokens, "loss.chunk_tokens")
    z_loss = loss.z_loss
    if isinstance(z_loss, bool) or not isinstance(z_loss, numbers.Real) or not 0 <= z_loss < inf:
        raise ValueError(f"loss.z_loss={z_loss!r}: a finite coefficient >= 0 (0: no z-loss)")
    return loss.chunk_tokens, float(z_loss)


def _logits(h: jax.Array, kernel: jax.Array, softcap: float | None = None) -> jax.Array:
    logits = jnp.einsum("bcd,dv->bcv", h, kernel, preferred_element_type=jnp.float32)
    return logits if softcap is None else capped(logits, softcap)


def tempered(logits: jax.Array, temperature: float) -> jax.Array:
    """fp32 ``logits / temperature`` (a sampling temperature's distribution); 1: as they are."""
    return logits if temperature == 1.0 else logits / jnp.float32(temperature)


def capped(logits: jax.Array, softcap: float) -> jax.Array:
    """Gemma 2's soft-cap, ``cap * tanh(logits / cap)``, on fp32 logits."""
    return softcap * jnp.tanh(logits / softcap)


def _is_target(targets: jax.Array, vocab: int) -> jax.Array:
    return jnp.arange(vocab, dtype=targets.dtype) == targets[..., None]


def _statistics(logits, targets, axis, entropy=False):
    """Per token: the logsumexp of ``logits``, the target's logit and whether the argmax is the
    target; with ``axis`` (a tensor group's), of the group's parts of the vocabulary together:
    the max over the group, the sum of exponentials under it summed over the group, the target
    logit from the device whose part holds it, the first index of the largest logit, in fp32.
    With ``entropy``, a fourth: the distribution's entropy, ``lse - sum(p * logits)``."""
    vocab = logits.shape[-1]
    if axis is None:
        picked = jnp.sum(jnp.where(_is_target(targets, vocab), logits, 0.0), axis=-1)
        correct = jnp.argmax(logits, axis=-1) == targets
        lse = jax.nn.logsumexp(logits, axis=-1)
        out = lse, picked, correct.astype(jnp.float32)
        if entropy:
            p = jnp.exp(logits - lse[..., None])
            out += (lse - jnp.sum(p * logits, axis=-1),)
        return out
    offset = jax.lax.axis_index(axis) * vocab
    picked = jnp.sum(jnp.where(_is_target(targets - offset, vocab), logits, 0.0), axis=-1)
    top = jnp.max(logits, axis=-1)
    most = jax.lax.pmax(top, axis)
    e = jnp.exp(logits - most[..., None])
    total = jax.lax.psum(jnp.sum(e, axis=-1), axis)
    first = jnp.where(top == most, jnp.argmax(logits, axis=-1) + offset, jnp.iinfo(jnp.int32).max)
    correct = (jax.lax.pmin(first, axis) == targets).astype(jnp.float32)
    lse = most + jnp.log(total)
    out = lse, jax.lax.psum(picked, axis), correct
    if entropy:
        out += (lse - jax.lax.psum(jnp.sum(e * logits, axis=-1), axis) / total,)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_head(hidden, kernel, targets, softcap, axis, temperature, entropy):
    """Per token of ``hidden [N, B, c, D]`` (N chunks), fp32 ``[N, B, c]`` each: the logsumexp
    of its logits (soft-capped by ``softcap`` where given, then over ``temperature``), its
    target's logit (0 for a target < 0) and whether the argmax is the target (`_statistics`;
    ``axis``: a tensor group's, whose devices each hold a part of the vocabulary, ``kernel``'s
    columns); with ``entropy``, each token's entropy too, without gradient)."""
    return _chunked_head_fwd(hidden, kernel, targets, softcap, axis, temperature, entropy)[0]


def _chunked_head_fwd(hidden, kernel, targets, softcap, axis, temperature, entropy):
    compute_kernel = kernel.astype(hidden.dtype)

    def body(_, chunk):
        h, t = chunk
        logits = tempered(_logits(h, compute_kernel, softcap), temperature)
        return None, _statistics(logits, t, axis, entropy)

    _, per_token = jax.lax.scan(body, None, (hidden, targets))
    return per_token, (hidden, kernel, targets, per_token[0])


def _chunked_head_bwd(softcap, axis, temperature, entropy, residuals, cotangents):
    del entropy  # a figure, as ``correct`` is a count: no gradient
    hidden, kernel, targets, lse = residuals
    g_lse, g_picked = cotangents[:2]
    compute_kernel = kernel.astype(hidden.dtype)
    if axis is not None:  # this device's part of the vocabulary: no collective backward
        targets = targets - jax.lax.axis_index(axis) * kernel.shape[-1]

    def body(d_kernel, chunk):
        h, t, lse_c, g_lse_c, g_picked_c = chunk
        logits = _logits(h, compute_kernel, softcap)
        softmax = jnp.exp(tempered(logits, temperature) - lse_c[..., None])
        picked = jnp.where(_is_target(t, logits.shape[-1]), g_picked_c[..., None], 0.0)
        d_logits = tempered(softmax * g_lse_c[..., None] + picked, temperature)
        if softcap is not None:  # through cap * tanh(z / cap): times 1 - tanh^2
            d_logits = d_logits * (1.0 - jnp.square(logits / softcap))
        d_logits = d_logits.astype(h.dtype)  # the island's end
        d_h = jnp.einsum("bcv,dv->bcd", d_logits, compute_kernel)
        d_kernel += jnp.einsum("bcd,bcv->dv", h, d_logits, preferred_element_type=jnp.float32)
        return d_kernel, d_h

    chunks = (hidden, targets, lse, g_lse, g_picked)
    d_kernel, d_hidden = jax.lax.scan(body, jnp.zeros(kernel.shape, jnp.float32), chunks)
    return d_hidden, d_kernel.astype(kernel.dtype), None


_chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)


def token_loss(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    *,
    chunk: int | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    split: Any = None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> dict[str, jax.Array]:
    """The next-token loss of ``hidden [B, L, D] @ kernel [D, V]`` against ``targets [B, L]``.

    ``hidden`` is in the compute dtype; ``kernel`` too, or fp32 where a casting rule kept it
    (it is cast to ``hidden.dtype`` for the matmuls; its gradient comes back in its own dtype).
    A target below 0 is masked. ``chunk``: sequence positions per chunk (``None``:
    ``auto_chunk``; ``L`` or more: one chunk); where it does not divide ``L``, the last chunk is
    padded with zero hidden states and masked targets.

    Returns fp32 scalars, each mean over the valid tokens (all 0 when there are none, with
    zero gradients): ``cross_entropy``; ``z_loss``, the mean of ``logsumexp(logits)**2`` (the
    z-loss of MaxText and Levanter, which pulls log Z to 0); ``loss``, ``cross_entropy +
    z_loss * z_loss-mean``, the one to differentiate; ``accuracy``, the fraction whose argmax
    is the target; and ``tokens``, the number of valid tokens. The last two have no gradient.
    ``logps``: fp32 ``[B, L]``, each target's log-probability (0 where masked), which DPO sums
    per sequence (``dpo_loss``); XLA drops it where nothing reads it.
    ``softcap``: the logits are ``cap * tanh(logits / cap)`` (Gemma 2's final soft-cap), in fp32.
    ``temperature``: the (capped) logits over it, the distribution a sampler at that
    temperature draws from (a GRPO run's log-probabilities, `mptrain.train.grpo`).
    ``entropy``: ``entropy`` too, fp32 ``[B, L]``, each position's entropy of that distribution
    (0 where masked), without gradient (GRPO's record).
    ``split``: a tensor group's (`mptrain.parallel.tensor.Split`): ``kernel`` is this device's
    part of the vocabulary, ``hidden`` and ``targets`` every token of the group; the per-token
    values are the whole vocabulary's, and each device keeps its own part of the tokens.
    """
    batch, length, _ = hidden.shape
    _check_chunk(chunk, "chunk")
    width, vocab = kernel.shape
    chunk = min(auto_chunk(length, vocab, width) if chunk is None else chunk, length)
    padded = -(-length // chunk) * chunk
    valid = targets >= 0
    if padded > length:
        hidden = jnp.pad(hidden, ((0, 0), (0, padded - length), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padded - length)), constant_values=-1)

    def to_chunks(x):  # [B, N * c, ...] -> [N, B, c, ...]: the batch axis stays whole
        return jnp.moveaxis(x.reshape(batch, padded // chunk, chunk, *x.shape[2:]), 1, 0)

    axis = None if split is None else split.axis
    per_token = _chunked_head(
        to_chunks(hidden), kernel, to_chunks(targets), softcap, axis, temperature, entropy
    )
    per_token = [jnp.moveaxis(x, 0, 1).reshape(batch, padded)[:, :length] for x in per_token]
    lse, picked, correct = per_token[:3]
    if split is not None:  # each token's loss counted once: on the device that holds it
        lse, picked, correct, valid = (split.part(lse), split.part(picked),
                                       split.own(correct), split.own(valid))  # fmt: skip
        per_token[3:] = [split.own(x) for x in per_token[3:]]
    tokens = jnp.sum(valid, dtype=jnp.float32)
    mean = lambda x: layers.masked_mean(x, valid)  # layers.cross_entropy's
    cross_entropy, z = mean(lse - picked), mean(jnp.square(lse))
    return {
        "loss": cross_entropy + z_loss * z,
        "cross_entropy": cross_entropy,
        "z_loss": z,
        "accuracy": mean(jax.lax.stop_gradient(correct)),
        "tokens": tokens,
        "logps": jnp.where(valid, picked - lse, 0.0),
    } | ({"entropy": jnp.where(valid, per_token[3], 0.0)} if entropy else {})


class Head(nn.Module):
    """A language model's head, inside a compact module: ``x [B, L, D] @ kernel [D, V]`` as fp32
    logits (16-bit operands, fp32 accumulation: ``layers.einsum_f32_out``), or with ``targets``
    ``token_loss``'s dict (``chunk``, ``z_loss``) where it needs more than one chunk or has a
    z-loss; otherwise the logits, whose loss the caller takes (the Trainer takes either): a
    whole-sequence chunk would hold the same fp32 logits, and the loss then stays outside the
    model's module calls, which the per-layer numerics follow. Its kernel is its param
    ``kernel`` (as ``nn.Dense`` names it), or one handed over (tied embeddings, cast by the
    caller). The matmul runs in the wider of the two dtypes: a kernel the casting rule keeps in
    fp32 makes it fp32."""

    vocab_size: int
    kernel_init: Any = nn.initializers.lecun_normal()  # nn.Dense's
    chunk: int | None = None
    z_loss: float = 0.0
    softcap: float | None = None  # the logits' soft-cap (`capped`), Gemma 2's
    dict_out: bool = False  # with targets, always `token_loss`'s dict (a model that adds to it)
    temperature: float = 1.0  # the logits over it (`token_loss`'s); 1 but in a GRPO run
    entropy: bool = False  # with targets, `token_loss`'s dict with each token's entropy
    lora: Any = None  # a `lora.Spec`: an adapter on its own kernel where it names the head

    @nn.compact
    def __call__(self, x: jax.Array, targets: Any = None, kernel: Any = None) -> Any:
        local = view.current()  # a tensor group's part of the vocabulary
        split = local and local.tensor()
        vocab = self.vocab_size // (1 if split is None else split.size)
        adapted = kernel is None and self.lora is not None and self.lora.adapts(self.path)
        if kernel is None:
            init = axes_lib.declare(self.kernel_init, (axes_lib.EMBED, axes_lib.VOCAB))
            kernel = self.param("kernel", init, (x.shape[-1], vocab))
        x = x.astype(jnp.promote_types(x.dtype, kernel.dtype))
        if adapted:  # x and the kernel widened by the adapter's rank (`lora.head`)
            x, kernel = lora_lib.head(self, x, kernel)
        length = x.shape[1]
        whole = (self.chunk or auto_chunk(length, self.vocab_size, x.shape[-1])) >= length
        if split is not None and targets is None:
            raise ValueError("on a tensor axis the head takes targets: each device its part")
        if split is not None:
            return token_loss(x, kernel, targets, chunk=self.chunk, z_loss=self.z_loss,
                              softcap=self.softcap, split=split,
                              temperature=self.temperature, entropy=self.entropy)  # fmt: skip
        plain = not (self.z_loss or self.dict_out or self.entropy)
        if targets is None or (whole and plain):
            logits = layers.einsum_f32_out("bld,dv->blv", x, kernel.astype(x.dtype))
            logits = logits if self.softcap is None else capped(logits, self.softcap)
            return tempered(logits, self.temperature)
        return token_loss(
            x,
            kernel,
            targets,
            chunk=self.chunk,
            z_loss=self.z_loss,
            softcap=self.softcap,
            temperature=self.temperature,
            entropy=self.entropy,
        )
