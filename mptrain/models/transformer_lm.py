"""A byte-level, decoder-only transformer language model with fp32 islands.

It stays a model of its own rather than a family of the decoder (`models/decoder`): it is the
yardstick (`make run`, the PyTorch comparison of `configs/lm_gpt2s.py`), whose figures must not
move when the decoder changes.

Mixed-precision contract: the framework passes parameters already cast to the compute dtype
(``dtype``; e.g. bf16) while fp32 master copies live in the train state. Inside the model:

  * every matmul (QKV, attention scores, attention-weighted values, output projection, MLP,
    logits) takes ``dtype`` operands. Each ``nn.Dense`` runs through ``layers.run_in``, which
    casts its input to that dtype and its result back, and every fp32 island ends with an
    explicit cast back, so an fp32 tensor never silently promotes the next matmul to fp32; only
    a kernel the casting rule keeps in fp32 (``keep_fp32``) makes its own matmul fp32;
  * the fp32 islands are the LayerNorm statistics (``layers.layer_norm_f32``), the attention
    softmax, and the logits: the logits use ``dtype`` operands with fp32 results
    (``lm_loss.Head``: ``layers.einsum_f32_out``), so they never round to 16 bits before the
    loss, and its custom gradient keeps the backward matmuls in ``dtype`` too. Given targets and
    ``config.loss`` asking for chunks or a z-loss, the head computes the loss chunk by chunk.

Attention (``attention``, config key ``model.attention``) has two implementations, both with
``dtype`` operands and fp32 softmax statistics (``attention_lib.causal_attention``):

  * ``"cudnn"``: cuDNN's fused flash attention (``jax.nn.dot_product_attention``). It walks the
    keys block by block, keeping each query row's running max and running sum of exponentials
    in fp32 inside the kernel, and rescales the partial output when the max grows; it never
    writes the ``[B, H, L, L]`` scores or probabilities to memory. For the backward pass it
    stores only the fp32 log-sum-exp per row (``[B, H, L]``) and recomputes the probabilities
    from it. Its result is ``dtype``;
  * ``"materialized"``: the scores come out of ``layers.einsum_f32_out`` in fp32 (16-bit
    operands, fp32 accumulation), are masked and go through an explicit fp32 softmax; the
    probabilities are cast to ``dtype`` for the matmul with the values. The ``[B, H, L, L]``
    tensors are held for the backward pass, whose matmuls the custom gradient keeps 16-bit.

``"auto"`` (the default) runs cuDNN where it can: a CUDA GPU with cuDNN, bf16/fp16 compute, no
attention dropout, a head size cuDNN takes; on a TPU the Pallas flash kernel (``"flash"``, for
16-bit compute, no dropout, sequences of a multiple of 128); the materialised path elsewhere
(CPU, fp32, ``dropout_rate > 0``). ``create_model`` logs the choice and why
(``attention.choose_attention``).
Parameter names are the same either way. XLA counts cuDNN's attention among its GPU kernels
whose results may vary from run to run; ``config.deterministic`` makes XLA ask cuDNN for its
deterministic backward pass.

``param_dtype`` is left at flax's default (fp32), so ``model.init`` creates fp32 master params.

On CPU, XLA runs a bf16 x bf16 -> bf16 matmul as convert-to-fp32, fp32 matmul, convert back, so
bf16 compute is emulated there and costs about as much as fp32. (Giving every matmul, forward and
backward, fp32 accumulation would reach XLA:CPU's native bf16 kernels, but in jax 0.10.2 some of
the resulting backward matmuls fail at run time with "Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32"; so only the materialised attention scores and the
logits use it.)
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.ad_checkpoint import checkpoint_name

from mptrain import errors
from mptrain.models import attention as attention_lib
from mptrain.models import layers
from mptrain.models import lm_loss as lm_loss_lib
from mptrain.models import lora as lora_lib
from mptrain.models import remat as remat_lib
from mptrain.models import segments as segments_lib
from mptrain.models.record import Record
from mptrain.parallel import axes as axes_lib
from mptrain.recipe import fp8 as fp8_lib

# each projection's kernel `[in, out]` by its logical axes (`parallel.axes`)
PROJECTIONS = {
    "qkv": (axes_lib.EMBED, axes_lib.Q_HEADS),
    "out": (axes_lib.Q_HEADS, axes_lib.EMBED),
    "fc_in": (axes_lib.EMBED, axes_lib.MLP),
    "fc_out": (axes_lib.MLP, axes_lib.EMBED),
}


def _dense(features: int, name: str, fp8: Any = None, lora: Any = None, **kwargs: Any):
    """A bias-free ``nn.Dense`` for ``layers.run_in``: its matmul runs in the compute dtype, or in
    fp32 where the casting rule hands its kernel over in fp32 (``keep_fp32``).

    No biases: with pre-LN blocks they add next to nothing (the LayerNorms have their own), and on
    XLA:CPU their gradients (column sums over batch x length) cost about a quarter of the step.
    """
    if fp8:  # the matmul in fp8, its scaling state in model_state (`mptrain.recipe.fp8`)
        kwargs["dot_general_cls"] = functools.partial(fp8_lib.DotGeneral, recipe=fp8)
    return lora_lib.dense(features, name, lora, names=PROJECTIONS[name], **kwargs)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; fp32 softmax statistics, everything else in ``dtype``.

    ``attention``: ``"auto" | "cudnn" | "materialized"`` (see the module docstring).
    """

    num_heads: int
    dtype: layers.Dtype = jnp.float32
    dropout_rate: float = 0.0
    attention: str = "auto"
    fp8: Any = None  # an `fp8.Recipe`: the dense layers' matmuls in fp8 (`mptrain.recipe.fp8`)
    backend: attention_lib.Backend | None = None  # what it is compiled for (None: this process)
    lora: Any = None  # a `lora.Spec`: adapters on the projections it names (`models.lora`)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False, segments=None) -> jax.Array:
        batch, length, d_model = x.shape
        if d_model % self.num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={self.num_heads}")
        head_dim = d_model // self.num_heads
        choice = attention_lib.choose_attention(
            self.attention,
            dtype=self.dtype,
            head_dim=head_dim,
            dropout_rate=self.dropout_rate,
            backend=self.backend,
            length=length,
        )
        qkv = layers.run_in(self.dtype, _dense(3 * d_model, "qkv", self.fp8, self.lora), x)
        qkv = checkpoint_name(qkv, "qkv_proj")
        qkv = qkv.reshape(batch, length, 3, self.num_heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, L, H, D]
        dropout = None
        if choice.implementation == "materialized":
            dropout = functools.partial(nn.Dropout(self.dropout_rate), deterministic=not train)
        out = attention_lib.causal_attention(
            q, k, v, choice.implementation, dropout=dropout, segment_ids=segments
        )
        out = checkpoint_name(out.reshape(batch, length, d_model), remat_lib.CONTEXT)
        return checkpoint_name(
            layers.run_in(self.dtype, _dense(d_model, "out", self.fp8, self.lora), out), "out_proj"
        )


class MLP(nn.Module):
    """Two-layer feed-forward block with GELU."""

    d_ff: int
    dtype: layers.Dtype = jnp.float32
    dropout_rate: float = 0.0
    fp8: Any = None
    lora: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        d_model = x.shape[-1]
        h = layers.run_in(self.dtype, _dense(self.d_ff, "fc_in", self.fp8, self.lora), x)
        h = nn.gelu(checkpoint_name(h, "mlp_up"))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=not train)
        return checkpoint_name(
            layers.run_in(self.dtype, _dense(d_model, "fc_out", self.fp8, self.lora), h), "mlp_down"
        )


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    num_heads: int
    d_ff: int
    dtype: layers.Dtype = jnp.float32
    dropout_rate: float = 0.0
    attention: str = "auto"
    fp8: Any = None  # an `fp8.Recipe`: the dense layers' matmuls in fp8 (`mptrain.recipe.fp8`)
    backend: attention_lib.Backend | None = None  # what it is compiled for (None: this process)
    lora: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False, segments=None) -> jax.Array:
        drop = nn.Dropout(self.dropout_rate)
        h = layers.layer_norm_f32(x, self.dtype, "ln_attn")
        attn = CausalSelfAttention(
            self.num_heads,
            self.dtype,
            self.dropout_rate,
            self.attention,
            self.fp8,
            self.backend,
            self.lora,
            name="attn",
        )
        h = attn(h, train=train, segments=segments)
        x = x + drop(h, deterministic=not train)
        h = layers.layer_norm_f32(x, self.dtype, "ln_mlp")
        h = MLP(self.d_ff, self.dtype, self.dropout_rate, self.fp8, self.lora, name="mlp")(
            h, train=train
        )
        return x + drop(h, deterministic=not train)


class TransformerLM(nn.Module):
    """Decoder-only LM: ``int32[B, L]`` tokens -> ``float32[B, L, vocab_size]`` logits.

    ``dtype`` is the compute dtype; params are created in fp32 (flax's ``param_dtype``
    default). Positions are learned, up to ``max_len``. Dropout needs a ``"dropout"`` rng when
    called with ``train=True`` and ``dropout_rate > 0``. ``attention``: ``"auto" | "cudnn" |
    "materialized"`` (see the module docstring). A row of packed examples gives ``positions``
    (``int[B, L]``, from 0 in each example: the learned positions are looked up by them) and
    ``segment_ids`` (``int[B, L]``: attention keeps to each example's own), with
    ``segment_lengths`` (``int[B, M]``) for cuDNN's packed layout on a GPU.
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 2
    d_ff: int = 512
    max_len: int = 128
    dtype: layers.Dtype = jnp.float32
    dropout_rate: float = 0.0
    attention: str = "auto"
    fp8: Any = None  # an `fp8.Recipe`: the dense layers' matmuls in fp8 (`mptrain.recipe.fp8`)
    backend: attention_lib.Backend | None = None  # what it is compiled for (None: this process)
    remat: str = "none"  # `remat.POLICIES`: what each block keeps for the backward pass
    loss_chunk: int | None = None  # `config.loss`: see `lm_loss_lib.token_loss`
    z_loss: float = 0.0
    lora: Any = None  # a `lora.Spec`: low-rank adapters on the projections (`models.lora`)
    computes_loss = True  # takes `targets` (the Trainer's loss_fn hands them over)

    @nn.compact
    def __call__(
        self, tokens, *, train=False, targets=None, positions=None, segment_ids=None,
        segment_lengths=None,
    ) -> Any:  # fmt: skip
        length = layers.check_tokens(tokens, self.max_len)
        segments = segments_lib.segments(segment_ids, segment_lengths)
        init = nn.initializers.normal(stddev=0.02)
        # No nn.Embed: its gradient is a scatter-add (atomics on a GPU); see layers.embed.
        x = layers.Embed(self.vocab_size, self.d_model, self.dtype, init, name="Embed_0")(tokens)
        pos_init = axes_lib.declare(init, (None, axes_lib.EMBED), fp32=True)
        table = self.param("pos_embedding", pos_init, (self.max_len, self.d_model))
        if positions is None:
            # Broadcast over the batch before the cast: the table's gradient, a sum over the
            # batch, is then taken in the table's dtype (fp32 under the default casting rule),
            # as every kept param's is, not in 16 bits before the cast.
            x = x + jnp.broadcast_to(table[:length], x.shape).astype(self.dtype)
        else:  # each row's own positions: looked up as the tokens are, without a scatter
            x = x + layers.embed(table, positions, self.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        policy = remat_lib.make_policy(self.remat)  # `train` (argument 2) stays a Python bool
        cls = Block if policy is None else nn.remat(Block, policy=policy, static_argnums=(2,))
        for i in range(self.num_layers):
            block = cls(
                self.num_heads,
                self.d_ff,
                self.dtype,
                self.dropout_rate,
                self.attention,
                self.fp8,
                self.backend,
                self.lora,
                name=f"block_{i}",
            )
            x = block(x, train, segments)
        x = layers.layer_norm_f32(x, self.dtype, "ln_final")
        # Logits: 16-bit operands, fp32 accumulation and result; the loss never sees bf16 logits.
        # With targets, the loss itself, chunked (`lm_loss.token_loss`).
        head = lm_loss_lib.Head(
            self.vocab_size, chunk=self.loss_chunk, z_loss=self.z_loss, name="head"
        )
        return head(x, targets)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats (per byte for a byte-level model), in fp32."""
    return layers.cross_entropy(logits, targets)


def bits_per_byte(loss_nats: float) -> float:
    """Converts a per-byte loss in nats to bits."""
    return float(loss_nats) / float(np.log(2.0))


# The keys `create_model` reads under `config.model`, with their defaults (those of
# `TransformerLM`): bytes as the vocabulary, a 2-block model of width 128 over 128 positions.
CONFIG_KEYS = {
    "vocab_size": 256,
    "d_model": 128,
    "num_layers": 2,
    "num_heads": 2,
    "d_ff": 512,
    "max_len": 128,
    "dropout_rate": 0.0,
    "attention": "auto",
    "remat": "none",
}


def _settings(model_config: Any) -> dict[str, Any]:
    """The keys of `CONFIG_KEYS` as `model_config` sets them; a `ValueError` names a bad one."""
    keys = errors.settings(model_config, CONFIG_KEYS)
    for key in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len"):
        errors.check_integer(f"model.{key}", keys[key], 1, errors.INT32_MAX)
    d_model, heads = keys["d_model"], keys["num_heads"]
    if d_model % heads:
        divisors = [h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]
        raise ValueError(
            f"model.num_heads={heads}: must divide model.d_model={d_model} (each head takes an "
            f"equal share of the width), e.g. {', '.join(map(str, divisors))}"
        )
    errors.check_number("model.dropout_rate", keys["dropout_rate"], 0.0, 1.0)
    return keys


def create_model(
    model_config: Any,
    compute_dtype: layers.Dtype = jnp.float32,
    fp8: Any = None,
    backend: attention_lib.Backend | None = None,
    host_memory: bool = True,
    loss: Any = None,
    lora: Any = None,
) -> TransformerLM:
    """Builds a ``TransformerLM`` from a config with the keys below (host-side, no params).

    ``model_config`` keys (`CONFIG_KEYS`, with their defaults): ``d_model, num_layers,
    num_heads, d_ff, max_len``, ``vocab_size`` (256: bytes), ``dropout_rate`` (0.0) and
    ``attention`` (``"auto"``). The attention implementation is resolved here, once, and
    logged. A bad value (a size below 1, heads that do not divide ``d_model``, an unknown
    ``attention`` or an explicit ``"cudnn"`` that cannot run here) is a ``ConfigError`` (a
    ``ValueError``) naming its key, e.g. ``config.model.num_heads``. ``fp8`` (an
    ``fp8.Recipe``): the attention and MLP projections run in fp8 (``mptrain.recipe.fp8``; the
    embedding and the head do not). ``backend``: what the model is compiled for
    (``attention_lib.backend_of`` the mesh's devices; None: this process's own), which ``"auto"``
    decides by. ``remat`` (``"none"``): what each block keeps for the backward pass
    (``mptrain.models.remat``; ``host_memory``: whether the devices have pinned host memory, for
    the offloading policies). ``loss``: ``config.loss`` (``chunk_tokens``, ``z_loss``), for the
    loss the model computes when handed targets (``lm_loss.Head``).
    """
    with errors.config_errors():
        keys = _settings(model_config)
        choice = attention_lib.choose_attention(
            keys["attention"],
            dtype=compute_dtype,
            head_dim=keys["d_model"] // keys["num_heads"],
            dropout_rate=keys["dropout_rate"],
            backend=backend,
            length=keys["max_len"],
        )
        platform = backend.platform if backend else jax.default_backend()
        remat = remat_lib.check(keys["remat"], host_memory, platform)
        chunk, z_loss = (None, 0.0) if loss is None else lm_loss_lib.settings(loss)
    logging.info("mptrain: attention: %s", choice)
    return TransformerLM(
        vocab_size=keys["vocab_size"],
        d_model=keys["d_model"],
        num_layers=keys["num_layers"],
        num_heads=keys["num_heads"],
        d_ff=keys["d_ff"],
        max_len=keys["max_len"],
        dtype=compute_dtype,
        dropout_rate=keys["dropout_rate"],
        attention=choice.implementation,
        fp8=fp8_lib.on(fp8, platform),
        backend=backend,
        remat=remat,
        loss_chunk=chunk,
        z_loss=z_loss,
        lora=lora,
    )


# A language model that trains on one device's whole layers (data and fsdp meshes), with
# adapters and fp8 projections (every dense layer, delayed scaling: the recipe's defaults).
RECORD = Record(name="transformer_lm", language_model=True, adapters=True, fp8={})
