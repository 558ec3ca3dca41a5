"""Decoding a zoo Llama with a KV cache: the cache, the sampler and the compiled token loop
that `mptrain.generate` runs (its module doc says how it decodes).

The cache (`KVCache`) is what the Llama's attention reads and writes when it is given one; the
decoder (`make_decoder`) reads a batch of right-padded prompts in one pass and then takes one
token a row a step inside a `lax.while_loop`; `sample` draws from fp32 logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PAD = -1  # a row's tokens after it stopped


class KVCache(NamedTuple):
    """One layer's keys and values while decoding, ``k`` and ``v`` ``[B, K, S, Dh]``: K kv
    heads (grouped as trained, never repeated to the query heads), S slots, slot ``j`` holding
    position ``j``, heads first (the layout the attention's matmuls read it in: no transposed
    copy a token), in the cache's dtype (the compute dtype by default). The decoder holds a
    tuple of them, one a layer, each updated in place."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(cls, layers_: int, batch: int, slots: int, kv_heads: int, head_dim: int, dtype):
        """A tuple of `layers_` empty caches."""
        zeros = lambda: jnp.zeros((batch, kv_heads, slots, head_dim), dtype)
        return tuple(cls(zeros(), zeros()) for _ in range(layers_))

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
        """The cache with ``[B, L, K, Dh]`` k, v written at each row's ``positions`` (``[B,
        L]``), cast to the cache's dtype: a scatter of distinct slots, in place."""
        rows = jnp.arange(k.shape[0])[:, None]  # with positions: the [B, L] slots, K, Dh
        return KVCache(
            self.k.at[rows, :, positions].set(k.astype(self.k.dtype)),
            self.v.at[rows, :, positions].set(v.astype(self.v.dtype)),
        )


def unscanned(model: Any, params: Any) -> tuple[Any, Any]:
    """`(model, params)` with the layers unrolled, for decoding: a scanned stack would slice
    each layer's weights out of it every token (a copy XLA's GPU GEMMs do not fuse: three
    times the bytes a token must read); the unrolled layers read each weight where it lies.
    MaxText's advice for its decoding too. The params' stack is split once (a copy per call
    of the decoder, not per token)."""
    from mptrain.parallel import sharding

    if not getattr(model, "scan_layers", False):
        return model, params
    layers = {}
    for tree, first in sharding.stacks(params[sharding.STACKED]).values():  # each its layers
        for i in range(jax.tree.leaves(tree)[0].shape[0]):
            layers[f"layers_{first + i}"] = jax.tree.map(lambda a, i=i: a[i], tree)
    rest = {k: v for k, v in params.items() if k != sharding.STACKED}
    return model.clone(scan_layers=False, lora=_unrolled(model)), rest | layers


def _unrolled(model: Any) -> Any:
    """The model's LoRA spec as its unrolled layers see themselves: a scanned block's projection
    is `attn/q` to itself, the same unrolled `layers_3/attn/q`; a spec's targets name the
    first, so each is named both ways (else the unrolled model would drop every adapter)."""
    from mptrain.models import lora as lora_lib

    spec = getattr(model, "lora", None)
    if spec is None or spec.targets == lora_lib.ALL:
        return spec
    layers = range(model.num_layers)
    each = lambda paths: frozenset(paths) | {f"layers_{i}/{p}" for p in paths for i in layers}
    return dataclasses.replace(spec, targets=each(spec.targets), projections=each(spec.projections))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from fp32 logits: `temperature` 0 is greedy (argmax);
    otherwise the logits over `temperature`, cut to the `top_k` largest (0: all) and to the
    fewest whose probabilities sum to `top_p` (1: all), then one draw."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise ValueError(f"--temperature={self.temperature!r}: must be 0 (greedy) or more")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"--top_k={self.top_k!r}: must be 0 (all tokens) or more")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"--top_p={self.top_p!r}: must be in (0, 1]")

    def values(self) -> np.ndarray:
        """The three as the compiled decoder takes them (run-time values: one program serves
        greedy decoding and every sampling setting)."""
        return np.asarray([self.temperature, self.top_k, self.top_p], np.float32)


def sample(logits, rng, sampling):
    """`[B]` int32 tokens from `[B, V]` fp32 logits; `sampling`: `Sampling.values()` (see
    `Sampling`), traced values."""
    temperature, top_k, top_p = sampling[0], sampling[1].astype(jnp.int32), sampling[2]
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    lowest, vocab = jnp.finfo(jnp.float32).min, logits.shape[-1]
    order = jnp.sort(scaled, axis=-1)[:, ::-1]  # largest first
    kth = jnp.take(order, jnp.clip(top_k, 1, vocab) - 1, axis=-1)[:, None]
    scaled = jnp.where((top_k > 0) & (scaled < kth), lowest, scaled)
    # top-p: keep the largest logits while the probability before each is below top_p
    order = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(order, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    floor = jnp.min(jnp.where(before < top_p, order, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < floor, lowest, scaled)
    drawn = jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


MAX_STOPS = 8  # stop tokens a decoder takes (`stops`)


def stops(ids: Sequence[int]) -> np.ndarray:
    """The decoder's `stops` argument: up to `MAX_STOPS` token ids, padded with -2 (no token)."""
    ids = list(dict.fromkeys(int(i) for i in ids))
    if len(ids) > MAX_STOPS:
        raise ValueError(f"{len(ids)} stop tokens: at most {MAX_STOPS}")
    return np.asarray(ids + [-2] * (MAX_STOPS - len(ids)), np.int32)


def token_logps(logits: jax.Array, tokens: jax.Array, sampling: jax.Array) -> jax.Array:
    """fp32 `[B]`: each drawn token's log-probability under the distribution it was drawn from
    before top-k and top-p cut it (`log_softmax(logits / temperature)` over the whole
    vocabulary; the logits themselves where greedy), what a trainer's log-probability of the
    same token is compared with (TRL's and vLLM's processed log-probs). 0 at `PAD`."""
    temperature = sampling[0]
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    picked = jnp.take_along_axis(scaled, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(tokens == PAD, 0.0, picked - jax.nn.logsumexp(scaled, axis=-1))


def make_decoder(
    model: Any,
    max_new_tokens: int,
    cache_dtype: Any = None,
    keep_logits: bool = False,
    keep_logps: bool = False,
) -> Callable:
    """`decode(params, prompts, lengths, sampling, seed, stop) -> tokens` (jitted): `prompts`
    int32 `[B, T]` right-padded, `lengths` `[B]` (each at least 1), `sampling` a `Sampling`'s
    `values()`, `seed` an int, `stop` the stop tokens (`stops(ids)`): all run-time values, so
    one program serves every setting; `tokens` int32 `[B, max_new_tokens]`,
    `PAD` after a row's stop token. With `keep_logits` the fp32 logits `[max_new_tokens, B, V]`
    each token was drawn from (what the tests hold against a full forward pass), and with
    `keep_logps` each token's log-probability `[B, max_new_tokens]` (`token_logps`), follow
    `tokens` in a tuple, in that order. `model` is a zoo Llama (`models.create`)."""
    shape = model.specs[0].shape  # the cache's heads and head size: every layer's

    layers_model = model

    def decode(params, prompts, lengths, sampling, seed, stop):
        model, params = unscanned(layers_model, params)
        batch, prompt_len = prompts.shape
        slots = prompt_len + max_new_tokens
        dtype = cache_dtype or model.dtype
        cache = KVCache.create(
            model.num_layers, batch, slots, shape.num_kv_heads, shape.head_dim, dtype
        )
        positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompts.shape)
        logits, cache = model.apply(
            {"params": params}, prompts, positions=positions, cache=cache, logits_at=lengths - 1
        )
        key = jax.random.key(seed)
        first = sample(logits[:, 0], jax.random.fold_in(key, 0), sampling)
        tokens = jnp.full((batch, max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
        kept = jnp.zeros((max_new_tokens, *logits[:, 0].shape), jnp.float32)
        kept = kept.at[0].set(logits[:, 0]) if keep_logits else kept
        logps = jnp.zeros((batch, max_new_tokens), jnp.float32)
        if keep_logps:
            logps = logps.at[:, 0].set(token_logps(logits[:, 0], first, sampling))
        done = jnp.isin(first, stop)

        def more(carry):
            t, _, _, _, done, _, _ = carry
            return (t < max_new_tokens) & ~jnp.all(done)

        def step(carry):
            t, last, cache, tokens, done, kept, logps = carry
            position = (lengths + t - 1)[:, None]  # the last token's: it goes in slot n + t - 1
            logits, cache = model.apply(
                {"params": params}, last[:, None], positions=position, cache=cache
            )
            token = sample(logits[:, 0], jax.random.fold_in(key, t), sampling)
            token = jnp.where(done, PAD, token)
            kept = kept.at[t].set(logits[:, 0]) if keep_logits else kept
            if keep_logps:
                logps = logps.at[:, t].set(token_logps(logits[:, 0], token, sampling))
            tokens = tokens.at[:, t].set(token)
            return t + 1, token, cache, tokens, done | jnp.isin(token, stop), kept, logps

        carry = (jnp.int32(1), first, cache, tokens, done, kept, logps)
        _, _, _, tokens, _, kept, logps = jax.lax.while_loop(more, step, carry)
        out = (tokens, *([kept] if keep_logits else []), *([logps] if keep_logps else []))
        return out if len(out) > 1 else tokens

    return jax.jit(decode)


def longrope_switch(model: Any) -> int | None:
    """Where a model's longrope (Phi-3's) switches to its long frequencies, or None."""
    ropes = [spec.attention.longrope for spec in model.specs]
    return next((rope.switch for rope in ropes if rope is not None), None)


def pad_prompts(
    prompts: Sequence[Sequence[int]], max_len: int, max_new_tokens: int, switch=None
) -> tuple:
    """`(prompts [B, T], lengths [B])` of token lists, right-padded with 0; a `ValueError`
    names a prompt that is empty or leaves no room for `max_new_tokens` in `max_len`. With a
    longrope `switch`, every row must stay on one side of it for the whole decoding: past it,
    transformers recomputes the whole context with the long frequencies, which this decoder's
    cache does not do, and a batch's prompt pass takes one side for all its rows."""
    if not prompts:
        raise ValueError("no prompt: give --prompt or --prompts")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"prompt {i} is empty")
        if n + max_new_tokens > max_len:
            raise ValueError(
                f"prompt {i} has {n} tokens: with --max_new_tokens={max_new_tokens} that is "
                f"past the model's context of {max_len} (model.max_len)"
            )
    if switch is not None:
        ends = lengths + max_new_tokens - 1  # each row's last length, its last token fed back
        if not ((ends <= switch).all() or (lengths > switch).all()):
            raise ValueError(
                f"prompts of {lengths.min()} to {lengths.max()} tokens with --max_new_tokens="
                f"{max_new_tokens} cross the longrope switch at {switch} tokens (config.json's "
                "original_max_position_embeddings); keep every row on one side of it"
            )
    out = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, lengths


def strip(tokens: np.ndarray, stop_ids: Sequence[int]) -> list[list[int]]:
    """Each row's tokens up to (without) its stop token and the padding after it."""
    rows = []
    for row in np.asarray(tokens).tolist():
        out = []
        for t in row:
            if t == PAD or t in stop_ids:
                break
            out.append(t)
        rows.append(out)
    return rows
