"""The decoder's module, `Llama`: tokens to fp32 logits, or to its own chunked loss; the
settings, the families and what it can do are the package's (`mptrain.models.decoder`).

Scanned, its stacks (`stack.stacks`) run one after another; under fp8-mixed the blocks between
the first and last `fp8.bf16_layers` run their selected matmuls in fp8, so each stack is cut
into bf16 and fp8 pieces (`_pieces`), each a scan over a static slice, and the fp8 pieces'
scaling state and probes (`fp8.META`, `fp8.PROBES`) are stacked on the layer axis under
`STACKED/layers_<a>-<b>` (`fp8_names.stack_name`, `_fp8_state`), carried through their scan."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain.models import layers, lm_loss
from mptrain.models import remat as remat_lib
from mptrain.models import segments as segments_lib
from mptrain.models.decoder import moe, stack
from mptrain.models.decoder.blocks import Block, BlockSpec
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import sharding, view
from mptrain.recipe import fp8 as fp8_lib
from mptrain.recipe import fp8_names


class Llama(nn.Module):
    """``int32[B, L]`` tokens -> ``float32[B, L, V]`` logits; with ``targets`` (``int[B, L]``,
    below 0 masked) the loss instead, ``lm_loss.token_loss``'s dict, computed chunk by chunk
    (``loss_chunk``: positions per chunk, None: its automatic choice) with ``z_loss``. A row of
    packed examples gives ``positions`` (``int[B, L]``, from 0 in each example) and
    ``segment_ids`` (``int[B, L]``): RoPE reads the one, attention keeps to the other; and
    ``segment_lengths`` (``int[B, M]``), which cuDNN's packed layout reads on a GPU.

    Decoding (`mptrain.models.decoder.decode`, layers unrolled) gives a ``cache`` (a ``KVCache`` a
    layer) and each row's ``positions`` and gets ``(logits, cache)``: a prompt (from 0)
    attends over its own keys as in training, one token a row over the cache; ``logits_at``
    (``int[B]``) keeps one position's logits a row."""

    vocab_size: int
    num_layers: int
    specs: tuple[BlockSpec, ...]  # each layer's (`blocks.BlockSpec`)
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
    embed_scale: bool = False  # the embeddings times sqrt(d_model), in the compute dtype
    final_softcap: float | None = None  # the logits' soft-cap (`lm_loss.capped`)
    aux_loss_coef: float = 0.0  # the load-balancing loss's weight (a mixture of experts)
    # the logits (and the loss's and log-probabilities') over it: a GRPO run scores its
    # completions at its sampling temperature (`mptrain.train.grpo`); 1 otherwise
    temperature: float = 1.0
    entropy: bool = False  # with targets, each token's entropy in the dict (GRPO's record)
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
        local = view.current() if cache is None else None  # the step's per-device layout
        split = local and local.tensor()  # `mptrain.parallel.tensor`
        vocab = self.vocab_size // (split.size if split else 1)
        width = self.specs[0].shape.d_model
        embed = layers.Embed(vocab, width, self.dtype, init, name="embed")
        if split is None:
            x = embed(tokens)
        else:  # this device's part of the vocabulary, summed over the group by tokens
            ids = tokens - split.index() * vocab
            mine = (ids >= 0) & (ids < vocab)
            x = split.scatter(jnp.where(mine[..., None], embed(jnp.where(mine, ids, 0)), 0))
        if self.embed_scale:  # Gemma's: the scalar in the activations' dtype, as in transformers
            x = x * jnp.asarray(width**0.5, x.dtype)
        if positions is None:
            positions = jnp.arange(length, dtype=jnp.int32)
        experts = [spec.experts for spec in self.specs]
        routed = max(experts) and cache is None  # the routers' statistics ride with x
        x = (x, jnp.zeros((2, max(experts)), jnp.float32)) if routed else x
        x = self._blocks(x, positions, segments, cache)
        if cache is not None:
            x, cache = x
        x, stats = x if routed else (x, None)
        x = self.specs[-1].norms.make(self.dtype, "final_norm")(x)
        x = x if split is None else split.gather(x)  # every token, the head's part of the vocab
        if logits_at is not None:  # [B, 1, D]: one position a row
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        head = lm_loss.Head(self.vocab_size, init, self.loss_chunk, self.z_loss,
                            self.final_softcap, dict_out=bool(routed),
                            temperature=self.temperature, entropy=self.entropy,
                            lora=self.lora, name="head")  # fmt: skip
        kernel = None
        if self.tie_embeddings:
            kernel = axes_lib.unboxed(embed.variables["params"]["embedding"]).T.astype(self.dtype)
        out = head(x, targets, kernel)
        if routed and targets is not None:  # the load-balancing loss, over the real tokens
            real = tokens.size if segments is None else jnp.sum(segments.ids > 0)
            aux, share = moe.aux_loss(stats, real * sum(e > 0 for e in experts))
            out = {**out, "loss": out["loss"] + self.aux_loss_coef * aux}
            out |= {"moe/aux_loss": aux, "moe/expert_share": share}
        return out if cache is None else (out, cache)

    def _blocks(self, x: jax.Array, positions: jax.Array, segments=None, cache=None) -> Any:
        policy = None if cache is not None else remat_lib.make_policy(self.remat)
        # fp8 in blocks [start, stop); the first and last `fp8.bf16_layers` stay in bf16
        start, stop = fp8_lib.fp8_layers(self.fp8, self.num_layers)
        args = lambda i: (self.specs[i], self.dtype, self.implementation, self._fp8(i), self.lora)
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
        # the stacks: runs of layers whose params have one shape (`stack.stacks`)
        stacks = stack.stacks(list(self.specs))
        block = lambda spec, fp8: Block(
            spec, self.dtype, self.implementation, fp8, self.lora, parent=None
        )  # applied to one layer's slice at a time

        def init(rng, x, positions):  # a key a layer, as one stack of every layer would have
            keys, found = jax.random.split(rng, self.num_layers), {}
            for s in stacks:
                first = block(self.specs[s.first], None)
                layer = jax.vmap(lambda k, b=first: b.init(k, x, positions)["params"])
                found[s.key] = axes_lib.stacked(layer(keys[s.first : s.stop]))  # `layers` first
            return found[()] if () in found else {s.key[0]: found[s.key] for s in stacks}

        # Read as it is when it exists: under FSDP the loop gets each device's shard of the
        # stack (gathered one layer at a time), which `self.param` would refuse by shape.
        if self.has_variable("params", sharding.STACKED):
            stacked = self.get_variable("params", sharding.STACKED)
        else:
            stacked = self.param(sharding.STACKED, init, x, positions)
        # the stack as stored, and what makes a layer's slice the params a block computes with
        # (the step's: cast, and on a mesh gathered; `sharding.Layers`)
        stacked, per_layer = sharding.layers_of(stacked)
        # the adapters' dropout: a key per layer, when training (the Trainer's "dropout" rng)
        dropout = self.make_rng("dropout") if self.lora and self.has_rng("dropout") else None
        run = functools.partial(
            stack.scan, args=(positions, segments), dropout=dropout, per_layer=per_layer
        )

        def period(a: int, b: int) -> tuple:  # layers a..b-1's blocks: one period of them
            specs = list(self.specs[a:b])
            return tuple(block(s, self._fp8(a)) for s in specs[: stack.period(specs)])

        parts = _pieces(stacks, start, stop)
        spans = [(Block(*args(a), parent=None), a, b) for _, a, b, fp8 in parts if fp8]
        states = _fp8_state(self, spans, (x, positions)) if spans else {}
        for s, a, b in ((s, a, b) for s, a, b, _ in parts):  # the layers in order
            params = stacked if not s.key else stacked[s.key[0]]
            if (a, b) != (s.first, s.stop):  # a static slice of the stack: its fp8 piece's
                params = jax.tree.map(lambda p, a=a - s.first, b=b - s.first: p[a:b], params)
            fp8 = states.get((a, b))
            x = run(period(a, b), x=x, stacked=params, policy=policy, fp8=fp8, first=a, where=s)
        return x

    def _fp8(self, layer: int | None) -> Any:
        """Block `layer`'s fp8 recipe, or None where it runs in the compute dtype."""
        start, stop = fp8_lib.fp8_layers(self.fp8, self.num_layers)
        return self.fp8 if layer is not None and start <= layer < stop else None


def _fp8_state(module: nn.Module, spans: list, init_args: tuple) -> dict:
    """`{(start, stop): {collection: stacked tree} or None}`: each span's fp8 scaling state and
    probes, one layer a row, for `spans` of `(block, start, stop)` (blocks `start..stop-1`,
    each of one kind), variables of `module` (in the Trainer's `model_state` like any other):
    None for a span whose block the size filter left without an fp8 matmul."""
    blocks = {}
    for block, start, stop in spans:
        if block.fp8.block:  # the state's init runs the blocks under vmap, which JAX's MXFP8
            # matmul cannot batch: the emulation's values are the same shapes (and unused)
            block = block.clone(fp8=dataclasses.replace(block.fp8, emulate=True))
        if fp8_lib.META in jax.eval_shape(lambda b=block: b.init(jax.random.key(0), *init_args)):
            blocks[start, stop] = block
    found = {(start, stop): None for _, start, stop in spans} | {span: {} for span in blocks}
    if not blocks:
        return found
    for collection in (fp8_lib.META, fp8_lib.PROBES):

        def init(collection=collection):  # what `fp8.DotGeneral` starts from: no randomness
            out = {}
            for (start, stop), block in blocks.items():
                keys = jax.random.split(jax.random.key(0), stop - start)
                one = lambda k, block=block: block.init(k, *init_args)[collection]
                out[fp8_names.stack_name(start, stop)] = jax.vmap(one)(keys)
            return out

        value = module.variable(collection, sharding.STACKED, init).value
        for start, stop in blocks:
            found[start, stop][collection] = value[fp8_names.stack_name(start, stop)]
    return found


def _pieces(stacks: tuple, start: int, stop: int) -> list[tuple[stack.Stack, int, int, bool]]:
    """`(stack, a, b, fp8)` in the order of the layers: each stack cut where the fp8 layers
    `[start, stop)` begin and end (the first and last `fp8.bf16_layers` stay in bf16), each
    piece a static slice of its stack scanned on its own."""
    found = []
    for s in stacks:
        for a, b, fp8 in ((0, start, False), (start, stop, True), (stop, s.stop, False)):
            a, b = max(a, s.first), min(b, s.stop)
            if a < b:
                found.append((s, a, b, fp8))
    return found
