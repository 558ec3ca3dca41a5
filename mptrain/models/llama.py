"""The decoder of the Llama and of the families that differ from it by a few switches (Mistral,
Qwen2, Qwen3, Gemma 2 and 3, OLMo 2, SmolLM3, Phi-3: `FAMILIES`), with its fp32 islands, its
layers scanned (a period of layer kinds at a time where they differ: `stack`) and
rematerialised by name.

The blocks (`mptrain.models.blocks`): RMSNorm, grouped-query attention with rotary positions
(RoPE, with Llama 3's frequency scaling), RMSNorm, a SwiGLU MLP; tied or untied embeddings; and
the families' switches: biases on the attention's projections, RMSNorm on each head's q and k,
a sliding window (on the layers `layer_types` names, each with its own RoPE base), Gemma's
norms, scales, soft-caps and GELU, OLMo 2's norm placement, NoPE layers, partial RoPE and
longrope (`blocks`). Every matmul takes compute-dtype
(``dtype``) operands, as in ``transformer_lm``. The fp32 islands:

  * RMSNorm: the mean square, its rsqrt and the scaling in fp32 (the scale is a param the
    default casting rule keeps in fp32; Gemma's ``1 + w`` too); only the result is cast back;
  * RoPE: the angles ``position * inv_freq`` from fp32 positions, their sin and cos in fp32, and
    the rotation of q and k applied in fp32, cast back to ``dtype`` just before the attention
    matmul (torchtitan rotates in fp32; HF transformers casts cos/sin to the activations' dtype
    and rotates in bf16). At position 8,000 an angle has fp32 rounding of about 5e-4 rad; in
    bf16 a cos/sin value keeps 8 bits. ``docs/models-and-data.md`` gives the measured error of
    q.k scores both ways;
  * attention's softmax statistics (``attention.causal_attention``: cuDNN, the Pallas TPU
    kernel and the materialised path all keep them in fp32);
  * soft-caps (Gemma 2's): on the fp32 scores and on the fp32 logits;
  * the logits: 16-bit operands, fp32 accumulation and result, never rounded to 16 bits;
    with targets, ``lm_loss.token_loss`` computes them chunk by chunk, so the fp32
    ``[tokens, vocab]`` array never exists.

Layout (what a HuggingFace ``LlamaForCausalLM`` checkpoint maps onto, each torch ``[out, in]``
weight transposed to flax's ``[in, out]`` kernel, nothing else reordered; ``L`` is
``stacked_layers`` with layer ``i`` on each array's leading axis, or ``layers_i`` unscanned):

    embed/embedding [V, D]         model.embed_tokens.weight
    L/attn_norm/scale [D]          model.layers.i.input_layernorm.weight
    L/attn/{q,k,v,o}/kernel        model.layers.i.self_attn.{q,k,v,o}_proj.weight (T)
    L/mlp_norm/scale [D]           model.layers.i.post_attention_layernorm.weight
    L/mlp/{gate,up,down}/kernel    model.layers.i.mlp.{gate,up,down}_proj.weight (T)
    L/attn/{q,k,v,o}/bias          model.layers.i.self_attn.{q,k,v,o}_proj.bias (attn_bias)
    L/attn/{q,k}_norm/scale        model.layers.i.self_attn.{q,k}_norm.weight (qk_norm)
    with post_norms (Gemma): L/attn_post_norm/scale is post_attention_layernorm.weight,
    L/mlp_norm/scale pre_feedforward_layernorm.weight, L/mlp_post_norm/scale
    post_feedforward_layernorm.weight
    final_norm/scale [D]           model.norm.weight
    head/kernel [D, V] (untied)    lm_head.weight (T)

q/k rotation convention: HF's "rotate half": a head's dimension j pairs with j + head_dim/2
(not the adjacent pairs of Meta's original code, torchtitan and MaxText, which permute q and k
on import). Keeping HF's order means an HF checkpoint loads with transposes only.

Scan (``scan_layers``): the blocks' params are one stack (``sharding.STACKED``) walked by
``jax.lax.scan``; each layer's slice is cast (under FSDP gathered) inside the loop
(``sharding.layer_params``). Unscanned, block ``i`` is ``layers_i``, another checkpoint layout.
Remat: ``mptrain.models.remat``, per block.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging

from mptrain import errors
from mptrain.models import attention as attention_lib
from mptrain.models import blocks, grouped, layers, lm_loss, moe, rope, stack
from mptrain.models import remat as remat_lib
from mptrain.models import segments as segments_lib
from mptrain.models.blocks import Block, Shape
from mptrain.models.record import Record
from mptrain.recipe import fp8 as fp8_lib
from mptrain.recipe import sharding


class Llama(nn.Module):
    """``int32[B, L]`` tokens -> ``float32[B, L, V]`` logits; with ``targets`` (``int[B, L]``,
    below 0 masked) the loss instead, ``lm_loss.token_loss``'s dict, computed chunk by chunk
    (``loss_chunk``: positions per chunk, None: its automatic choice) with ``z_loss``. A row of
    packed examples gives ``positions`` (``int[B, L]``, from 0 in each example) and
    ``segment_ids`` (``int[B, L]``): RoPE reads the one, attention keeps to the other; and
    ``segment_lengths`` (``int[B, M]``), which cuDNN's packed layout reads on a GPU.

    Decoding (`mptrain.models.decode`, layers unrolled) gives a ``cache`` (a ``KVCache`` a
    layer) and each row's ``positions`` and gets ``(logits, cache)``: a prompt (from 0)
    attends over its own keys as in training, one token a row over the cache; ``logits_at``
    (``int[B]``) keeps one position's logits a row."""

    vocab_size: int
    num_layers: int
    shape: Shape
    max_len: int
    dtype: layers.Dtype = jnp.float32
    tie_embeddings: bool = False
    implementation: str = "materialized"
    scan_layers: bool = True
    remat: str = "none"
    loss_chunk: int | None = None
    z_loss: float = 0.0
    fp8: Any = None
    lora: Any = None  # a `lora.Spec`: low-rank adapters on the projections (`models.lora`)
    layer_shapes: tuple[Shape, ...] = ()  # each layer's, where they differ; else `shape`'s
    embed_scale: bool = False  # the embeddings times sqrt(d_model), in the compute dtype
    final_softcap: float | None = None  # the logits' soft-cap (`lm_loss.capped`)
    aux_loss_coef: float = 0.0  # the load-balancing loss's weight (a mixture of experts)
    computes_loss = True  # takes `targets` (the Trainer's loss_fn hands them over)

    @nn.compact
    def __call__(
        self, tokens, *, train=False, targets=None, positions=None, segment_ids=None,
        segment_lengths=None, cache=None, logits_at=None,
    ) -> Any:  # fmt: skip
        del train  # no dropout in a Llama but the adapters', which follows the "dropout" rng
        segments = segments_lib.segments(segment_ids, segment_lengths)
        length = layers.check_tokens(tokens, self.max_len)
        init = nn.initializers.normal(stddev=0.02)
        split = sharding.tensor_axis() if cache is None else None  # `mptrain.recipe.tensor`
        vocab = self.vocab_size // (split.size if split else 1)
        embed = layers.Embed(vocab, self.shape.d_model, self.dtype, init, name="embed")
        if split is None:
            x = embed(tokens)
        else:  # this device's part of the vocabulary, summed over the group by tokens
            ids = tokens - split.index() * vocab
            mine = (ids >= 0) & (ids < vocab)
            x = split.scatter(jnp.where(mine[..., None], embed(jnp.where(mine, ids, 0)), 0))
        if self.embed_scale:  # Gemma's: the scalar in the activations' dtype, as in transformers
            x = x * jnp.asarray(self.shape.d_model**0.5, x.dtype)
        if positions is None:
            positions = jnp.arange(length, dtype=jnp.int32)
        experts = [self._shape(i).experts for i in range(self.num_layers)]
        routed = max(experts) and cache is None  # the routers' statistics ride with x
        x = (x, jnp.zeros((2, max(experts)), jnp.float32)) if routed else x
        x = self._blocks(x, positions, segments, cache)
        if cache is not None:
            x, cache = x
        x, stats = x if routed else (x, None)
        x = self.shape.norm(self.dtype, "final_norm")(x)
        x = x if split is None else split.gather(x)  # every token, the head's part of the vocab
        if logits_at is not None:  # [B, 1, D]: one position a row
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        head = lm_loss.Head(self.vocab_size, init, self.loss_chunk, self.z_loss,
                            self.final_softcap, dict_out=bool(routed), name="head")  # fmt: skip
        kernel = None
        if self.tie_embeddings:
            kernel = embed.variables["params"]["embedding"].T.astype(self.dtype)
        out = head(x, targets, kernel)
        if routed and targets is not None:  # the load-balancing loss, over the real tokens
            real = tokens.size if segments is None else jnp.sum(segments.ids > 0)
            aux, share = moe.aux_loss(stats, real * sum(e > 0 for e in experts))
            out = {**out, "loss": out["loss"] + self.aux_loss_coef * aux}
            out |= {"moe/aux_loss": aux, "moe/expert_share": share}
        return out if cache is None else (out, cache)

    def _shape(self, layer: int) -> Shape:
        return self.layer_shapes[layer] if self.layer_shapes else self.shape

    def _blocks(self, x: jax.Array, positions: jax.Array, segments=None, cache=None) -> Any:
        policy = None if cache is not None else remat_lib.make_policy(self.remat)
        # fp8 in blocks [start, stop); the first and last `fp8.bf16_layers` stay in bf16
        start, stop = fp8_lib.fp8_layers(self.fp8, self.num_layers)
        args = lambda i: (self._shape(i), self.dtype, self.implementation, self._fp8(i), self.lora)
        if not self.scan_layers:
            cls = Block if policy is None else nn.remat(Block, policy=policy)
            caches = []
            for i in range(self.num_layers):
                layer = None if cache is None else cache[i]
                x = cls(*args(i), name=f"layers_{i}")(x, positions, segments, layer)
                if cache is not None:
                    x, layer = x
                    caches.append(layer)
            return x if cache is None else (x, tuple(caches))
        if cache is not None:
            raise ValueError("decoding runs the layers unrolled: decode.unscanned(model, params)")
        # every layer's params have one shape (the layers differ in window and RoPE only)
        block = lambda shape, fp8: Block(
            shape, self.dtype, self.implementation, fp8, self.lora, parent=None
        )  # applied to one layer's slice at a time
        bf16 = block(self._shape(0), None)

        def init(rng, x, positions):
            keys = jax.random.split(rng, self.num_layers)
            return jax.vmap(lambda k: bf16.init(k, x, positions)["params"])(keys)

        # Read as it is when it exists: under FSDP the loop gets each device's shard of the
        # stack (gathered one layer at a time), which `self.param` would refuse by shape.
        if self.has_variable("params", sharding.STACKED):
            stacked = self.get_variable("params", sharding.STACKED)
        else:
            stacked = self.param(sharding.STACKED, init, x, positions)
        # the adapters' dropout: a key per layer, when training (the Trainer's "dropout" rng)
        dropout = self.make_rng("dropout") if self.lora and self.has_rng("dropout") else None
        run = functools.partial(stack.scan, x=x, args=(positions, segments), dropout=dropout)

        def period(a: int, b: int) -> tuple:  # layers a..b-1's blocks: one period of them
            shapes = [self._shape(i) for i in range(a, b)]
            return tuple(block(s, self._fp8(a)) for s in shapes[: stack.period(shapes)])

        if start == stop:
            return run(period(0, self.num_layers), stacked=stacked, policy=policy)
        fp8 = Block(*args(start), parent=None)
        state = stack.fp8_state(self, fp8, (x, positions), start, stop)
        return stack.spans(run, stacked, period, state, start, stop, policy)

    def _fp8(self, layer: int | None) -> Any:
        """Block `layer`'s fp8 recipe, or None where it runs in the compute dtype."""
        start, stop = fp8_lib.fp8_layers(self.fp8, self.num_layers)
        return self.fp8 if layer is not None and start <= layer < stop else None


# The families whose HuggingFace folders this decoder reads and writes (`mptrain.hf`): each a
# setting of the switches of `blocks.Shape`, and the names its folder gives them.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "smollm3", "phi3")
FAMILIES += ("qwen3_moe", "mixtral")  # with a mixture of experts (`moe`)
SLIDING, FULL = blocks.SLIDING, blocks.FULL  # `layer_types`' values, transformers'


# The keys `create_model` reads under `config.model`, with their defaults: a small byte-level
# model. `head_dim` None: d_model / num_heads; `rope_scaling` None, or Llama 3's
# (factor, low_freq_factor, high_freq_factor, original_max_len), ("linear", factor), or
# ("longrope", short factors, long factors, original_max_len, attention_factor) (Phi-3's);
# `family`: the folder it exports as; `attn_bias`, `qk_norm`, `sliding_window` and Gemma's
# `norm_plus_one`, `post_norms`, `attn_softcap`, `mlp_act`: `blocks.Shape`'s switches;
# `query_pre_attn_scalar` (None: head_dim) scales the scores by its -1/2 power.
# `layer_types` (None: every layer sliding where `sliding_window` is set, else full) names each
# layer's attention, SLIDING or FULL; `rope_local_theta` (None: rope_theta) is the RoPE base of
# the sliding layers, unscaled (Gemma 3's). `embed_scale`: embeddings times sqrt(d_model);
# `final_softcap`: the logits' soft-cap. OLMo 2's `pre_norms` False and `qk_norm_width` (the
# q and k norms over the whole projection); `nope_layers`: the layers without RoPE (SmolLM3's).
# `token_ids`: a folder's (pad, bos, eos) ids, which the model never reads and an export writes
# back to config.json. `partial_rotary_factor`: the part of each head that RoPE rotates (Phi's).
CONFIG_KEYS = {
    "vocab_size": 256,
    "d_model": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": None,
    "d_ff": 688,
    "max_len": 256,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "norm_eps": 1e-5,
    "tie_embeddings": False,
    "attention": "auto",
    "scan_layers": True,
    "remat": "none",
    "family": "llama",
    "attn_bias": "none",
    "qk_norm": False,
    "sliding_window": None,
    "layer_types": None,
    "rope_local_theta": None,
    "norm_plus_one": False,
    "post_norms": False,
    "query_pre_attn_scalar": None,
    "attn_softcap": None,
    "final_softcap": None,
    "mlp_act": "silu",
    "embed_scale": False,
    "pre_norms": True,
    "qk_norm_width": False,
    "nope_layers": None,
    "token_ids": None,
    "partial_rotary_factor": 1.0,
    **moe.CONFIG_KEYS,
}


def settings(model_config: Any) -> dict[str, Any]:
    """The keys of `CONFIG_KEYS` as `model_config` sets them; a `ValueError` names a bad one."""
    keys = errors.settings(model_config, CONFIG_KEYS)
    for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff"):
        errors.check_integer(f"model.{key}", keys[key], 1, errors.INT32_MAX)
    errors.check_integer("model.max_len", keys["max_len"], 1, errors.INT32_MAX)  # only a bound
    heads, kv = keys["num_heads"], keys["num_kv_heads"]
    if heads % kv:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(
            f"model.num_kv_heads={kv}: must divide model.num_heads={heads} (each kv head serves "
            f"an equal group of query heads), e.g. {', '.join(map(str, fits))}"
        )
    if keys["head_dim"] is None:
        if keys["d_model"] % heads:
            raise ValueError(
                f"model.num_heads={heads}: does not divide model.d_model={keys['d_model']}; "
                "set model.head_dim, or a head count that divides the width"
            )
        keys["head_dim"] = keys["d_model"] // heads
    head_dim = errors.check_integer("model.head_dim", keys["head_dim"], 2, 2**16)
    if head_dim % 2:
        raise ValueError(
            f"model.head_dim={head_dim}: RoPE rotates pairs of dimensions; use an even size"
        )
    errors.check_number("model.rope_theta", keys["rope_theta"], 1.0, open_low=True)
    errors.check_number("model.norm_eps", keys["norm_eps"], 0.0, 1.0, open_low=True)
    keys["rope_scaling"] = rope.scaling(keys["rope_scaling"])
    bools = ("tie_embeddings", "scan_layers", "qk_norm", "norm_plus_one", "post_norms")
    for key in (*bools, "pre_norms", "qk_norm_width"):
        if not isinstance(keys[key], bool):
            raise ValueError(f"model.{key}={keys[key]!r}: must be True or False")
    errors.check_choice("model.family", keys["family"], FAMILIES)
    errors.check_choice("model.attn_bias", keys["attn_bias"], blocks.ATTN_BIASES)
    if not isinstance(keys["embed_scale"], bool):
        raise ValueError(f"model.embed_scale={keys['embed_scale']!r}: must be True or False")
    errors.check_choice("model.mlp_act", keys["mlp_act"], blocks.MLP_ACTS)
    if keys["sliding_window"] is not None:
        errors.check_integer("model.sliding_window", keys["sliding_window"], 1, errors.INT32_MAX)
    factor = keys["partial_rotary_factor"]
    factor = errors.check_number("model.partial_rotary_factor", factor, 0.0, 2.0, open_low=True)
    if factor > 1 or int(keys["head_dim"] * factor) < 2:
        raise ValueError(
            f"model.partial_rotary_factor={factor}: the part of a head's {keys['head_dim']} "
            "dimensions RoPE rotates, at most 1 and at least 2 dimensions"
        )
    keys["partial_rotary_factor"] = factor
    scaling, rotary = keys["rope_scaling"], int(keys["head_dim"] * factor) // 2 * 2
    if scaling is not None and scaling[0] == "longrope" and len(scaling[1]) != rotary // 2:
        raise ValueError(
            f"model.rope_scaling: {len(scaling[1])} longrope factors for the {rotary // 2} "
            "frequencies of the rotated part of a head"
        )
    for key in ("rope_local_theta", "query_pre_attn_scalar", "attn_softcap", "final_softcap"):
        if keys[key] is not None:
            keys[key] = errors.check_number(f"model.{key}", keys[key], 0.0, open_low=True)
    keys["layer_types"] = blocks.layer_types(keys)
    keys["nope_layers"] = blocks.nope_layers(keys["nope_layers"], keys["num_layers"])
    moe.check(keys)
    return keys


def create_model(
    model_config: Any,
    compute_dtype: layers.Dtype = jnp.float32,
    fp8: Any = None,
    backend: attention_lib.Backend | None = None,
    loss: Any = None,
    host_memory: bool = True,
    lora: Any = None,
) -> Llama:
    """Builds a ``Llama`` from ``config.model`` (``CONFIG_KEYS``; host-side, no params). A bad
    value is a ``ConfigError`` naming its key. ``backend``: what the step is compiled for, which
    ``attention="auto"`` decides by; ``host_memory``: whether its devices have pinned host
    memory (the ``*_offloaded`` remat policies need it); ``loss``: ``config.loss``
    (``chunk_tokens``, ``z_loss``); ``fp8``: the projections' matmuls in fp8; ``lora``: a
    ``lora.Spec``, adapters on the projections it names (`mptrain.models.lora`)."""
    with errors.config_errors():
        keys = settings(model_config)
        choice = attention_lib.choose_attention(
            keys["attention"],
            dtype=compute_dtype,
            head_dim=keys["head_dim"],
            backend=backend,
            length=keys["max_len"],
            softcap=keys["attn_softcap"],
        )
        platform = backend.platform if backend else jax.default_backend()
        keys["remat"] = remat_lib.check(keys["remat"], host_memory, platform)
        chunk, z_loss = (None, 0.0) if loss is None else lm_loss.settings(loss)
    logging.info("mptrain: attention: %s", choice)
    machine = backend or attention_lib.local_backend()  # the experts' matmuls: by the chip
    keys["expert_kernel"] = (
        grouped.kernel_for(keys["expert_matmul"], machine, compute_dtype),
        machine.sms,
    )
    shapes = blocks.layer_shapes(keys)
    return Llama(
        vocab_size=keys["vocab_size"],
        num_layers=keys["num_layers"],
        shape=shapes[0],
        layer_shapes=shapes if len(set(shapes)) > 1 else (),
        embed_scale=keys["embed_scale"],
        final_softcap=keys["final_softcap"],
        aux_loss_coef=keys["router_aux_loss_coef"] if keys["num_experts"] else 0.0,
        max_len=keys["max_len"],
        dtype=compute_dtype,
        tie_embeddings=keys["tie_embeddings"],
        implementation=choice.implementation,
        scan_layers=keys["scan_layers"],
        remat=keys["remat"],
        loss_chunk=chunk,
        z_loss=z_loss,
        fp8=fp8_lib.on(fp8, platform),
        lora=lora,
    )


# ---------------------------------------------------------------- what a layout needs of it


def check_mesh(config, model: Llama, example: Any) -> None:
    """What the decoder needs of its settings and the data under `config.mesh`'s expert,
    context and tensor axes (its `RECORD.mesh`); a `ValueError` naming the keys."""
    mesh = config.mesh
    context, tensor = mesh.get("context", 1), mesh.get("tensor", 1)
    if (expert := mesh.get("expert", 1)) != 1:  # an equal part of every layer's experts
        experts = {s.experts for s in (model.shape, *model.layer_shapes)} - {0}
        if not experts:
            raise ValueError(
                f"mesh.expert={expert}: model.num_experts="
                f"{config.model.get('num_experts')}: no experts to split over devices"
            )
        if max(experts) % expert:
            raise ValueError(
                f"mesh.expert={expert}: does not divide model.num_experts={max(experts)}; "
                "each device holds an equal part of every layer's experts"
            )
    if context != 1:
        _check_context(config, model, context, example)
    if tensor != 1:
        _check_tensor(config, model, tensor, context, example)


def _check_context(config, model: Llama, context: int, example: Any) -> None:
    """What a sequence split over `mesh.context` devices needs (`recipe.layout`): the
    materialised attention, the TPU's splash kernel (`splash.split_attention`), or cuDNN's
    (`models.context_attention`) on rows of one sequence each without a sliding window; no
    longrope (a row's switch reads its largest position, which one device's tokens do not
    know); and sequences that `2 x context` equal chunks divide."""
    where = f"mesh.context={context}"
    attention = f"model.attention={config.model.get('attention', 'auto')!r}"
    windows = any(s.window for s in (model.shape, *model.layer_shapes))
    packed = example is not None and "segment_ids" in example
    if model.implementation == "cudnn" and (windows or packed):
        what = "a sliding window (model.sliding_window)" if windows else "packed rows"
        raise ValueError(
            f"{where}: {attention} runs cuDNN here, whose split attention does not take "
            f"{what} yet; set model.attention='materialized'"
        )
    if any(s.longrope for s in (model.shape, *model.layer_shapes)):
        raise ValueError(
            f"{where}: model.rope_scaling is longrope, whose switch reads a row's largest "
            "position, which a split sequence's devices do not each hold; use mesh.context=1"
        )
    length = None if example is None else example["inputs"].shape[1]
    if length is not None and length % (2 * context):
        raise ValueError(
            f"{where}: data.seq_len={length} tokens, which {2 * context} equal chunks (two a "
            f"device, balanced for causal attention) do not divide; use a multiple of "
            f"{2 * context}"
        )


def _check_tensor(config, model: Llama, tensor: int, context: int, example: Any) -> None:
    """What a tensor group of `tensor` devices needs (`mptrain.recipe.tensor`): no experts,
    heads, key-value heads, MLP units and a vocabulary it divides, and a part of every sequence
    (per context device) it divides by tokens."""
    where = f"mesh.tensor={tensor}"
    s, keys = model.shape, config.model
    if any(shape.experts for shape in (s, *model.layer_shapes)):
        raise ValueError(f"{where}: model.num_experts={keys.num_experts}: a mixture of experts "
                         "is split by mesh.expert, not by a tensor axis yet")  # fmt: skip
    kv = s.num_kv_heads
    if kv % tensor and tensor % kv == 0:
        raise ValueError(
            f"{where}: model.num_kv_heads={kv}: each device needs whole key-value heads; "
            f"copying a head to {tensor // kv} devices is not built yet; use a mesh.tensor "
            f"that divides {kv}"
        )
    sizes = {"num_heads": s.num_heads, "num_kv_heads": kv, "d_ff": s.d_ff}
    for key, value in {**sizes, "vocab_size": model.vocab_size}.items():
        if value % tensor:
            raise ValueError(
                f"{where}: does not divide model.{key}={value}; each device of the group holds "
                f"an equal part of it"
            )
    if s.attn_bias == "all" or s.qk_norm_width:
        key = "attn_bias='all'" if s.attn_bias == "all" else "qk_norm_width=True"
        raise ValueError(
            f"{where}: model.{key} is not split over a tensor axis yet (the out projection's "
            "bias, a norm across every head); use mesh.fsdp"
        )
    length = None if example is None else example["inputs"].shape[-1]
    if length is not None and (length // context) % tensor:
        raise ValueError(
            f"{where}: data.seq_len={length}: each device's part of a sequence "
            f"({length // context} tokens) does not divide into {tensor} equal parts between "
            f"the blocks; use a multiple of {context * tensor}"
        )


# What the decoder can do. fp8's defaults follow the recipes that train a Llama in fp8 today:
# current scaling (torchtitan, Megatron), the first and last blocks in bf16 (NVIDIA's
# Megatron-Bridge Llama 3 recipes), and no fp8 for matmuls too thin to gain (torchao's filter,
# whose rowwise rule drops an output of 1,024 or fewer: Llama 3 8B's and 70B's k and v).
RECORD = Record(
    name="llama",
    language_model=True,
    adapters=True,
    fp8={"scaling": "current", "bf16_layers": 1, "min_size": 1024},
    mesh=frozenset({"expert", "context", "tensor"}),
    decodes=True,
    hf=True,
    check_mesh=check_mesh,
)
