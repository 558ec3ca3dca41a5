"""Attention sinks (gpt-oss's, issue 73): each head's learned logit joins its scores in the fp32
softmax's denominator, and its probability is dropped. Against transformers' eager formula in
numpy (float64), on the training path, the decoding cache's, and through the decoder; through
a fused kernel that has none (cuDNN's) as one more key, against the materialised path."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mptrain.models import attention
from mptrain.models import decoder as llama


def _reference(q, k, v, sinks, window=None):
    """transformers' `eager_attention_forward` of gpt-oss: scores, mask, the sink a column of
    its own, the max subtracted, softmax, the sink's column dropped (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    heads, kv = q.shape[2], k.shape[2]
    k, v = (np.repeat(x, heads // kv, axis=2) for x in (k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    n = q.shape[1]
    seen = np.tril(np.ones((n, n), bool))
    if window is not None:
        seen &= ~np.tril(np.ones((n, n), bool), -window)
    scores = np.where(seen, scores, -np.inf)
    sink = np.broadcast_to(
        np.asarray(sinks, np.float64)[None, :, None, None], (*scores.shape[:3], 1)
    )
    logits = np.concatenate([scores, sink], -1)
    logits = logits - logits.max(-1, keepdims=True)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs[..., :-1], v)


def test_sinks_take_a_share_of_each_heads_attention_as_transformers_computes_it():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 12, n, 8)), jnp.float32) for n in (4, 2, 2))
    sinks = jnp.asarray(rng.normal(size=4) * 2, jnp.float32)
    for window in (None, 5):
        got = attention.causal_attention(q, k, v, "materialized", sinks=sinks, window=window)
        want = _reference(q, k, v, sinks, window)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        plain = attention.causal_attention(q, k, v, "materialized", window=window)
        assert np.abs(np.asarray(plain) - want).max() > 0.05  # the sinks show
    # decoding: the cache's path, one token at a time, gives the same rows
    cache_k, cache_v = (jnp.swapaxes(x, 1, 2) for x in (k, v))
    positions = jnp.full((2, 1), 7, jnp.int32)
    got = attention.cached_attention(q[:, 7:8], cache_k, cache_v, positions, sinks=sinks)
    np.testing.assert_allclose(got[:, 0], _reference(q, k, v, sinks)[:, 7], rtol=1e-5, atol=1e-6)


def test_cudnn_takes_sinks_as_one_more_key_and_the_tpu_kernel_does_not():
    """cuDNN runs them (`sunk_attention`), its head size counted with the sink's channels (256
    plus them is past its limit); the TPU flash kernel has no way to: the materialised path."""
    gpu = attention.Backend("gpu", (9, 0), cudnn=True, sms=132)
    choose = lambda backend, depth: attention.choose_attention(
        "auto", dtype=jnp.bfloat16, head_dim=depth, backend=backend, sinks=True, length=1024
    )
    assert choose(gpu, 64).implementation == "cudnn"
    too_wide = choose(gpu, 256)
    assert too_wide.implementation == "materialized" and "head_dim=264" in too_wide.reason
    tpu = choose(attention.Backend("tpu"), 64)
    assert tpu.implementation == "materialized" and "no attention sinks" in tpu.reason


def test_the_decoders_sinks_are_a_param_a_head_in_fp32():
    section = {"vocab_size": 32, "d_model": 32, "num_layers": 2, "num_heads": 4}
    section |= {"num_kv_heads": 2, "d_ff": 48, "attn_sinks": True, "attention": "materialized"}
    model = llama.create_model(ml_collections.ConfigDict(section), jnp.bfloat16)
    tokens = jnp.zeros((1, 8), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    box = shapes["stacked_layers"]["attn"]["sinks"]
    assert box.value.shape == (2, 4) and box.fp32


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_through_a_kernel_that_has_none_are_one_more_key_and_give_the_same(window):
    """cuDNN's way (`sunk_attention`: the sink a key every query sees, value zero, carried in
    extra channels), run here by XLA's implementation of the same call: the sinks' attention
    and gradients, the sinks' own gradient included, equal the materialised path's in fp32;
    the sink carried in three bf16 parts is the fp32 sink (a bf16 run within its band)."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 12, n, 8)), jnp.float32) for n in (4, 2, 2))
    sinks = jnp.asarray(rng.normal(size=4) * 2, jnp.float32)
    weights = jnp.asarray(rng.normal(size=(2, 12, 4, 8)), jnp.float32)
    fused = lambda q, k, v, s: attention.sunk_attention(q, k, v, s, "xla", window)
    plain = lambda q, k, v, s: attention.causal_attention(
        q, k, v, "materialized", sinks=s, window=window
    )
    loss = lambda f: lambda *a: jnp.sum(f(*a) * weights)
    np.testing.assert_allclose(fused(q, k, v, sinks), plain(q, k, v, sinks), rtol=1e-5, atol=1e-6)
    got = jax.grad(loss(fused), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(loss(plain), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    low = fused(*half, sinks).astype(jnp.float32)
    assert np.abs(np.asarray(low) - np.asarray(plain(q, k, v, sinks))).max() < 0.05


def test_a_sequence_split_over_context_with_cudnns_sinks_is_refused_by_name():
    """cuDNN's split attention (`context_attention`) takes no sinks yet: one line naming the
    keys, before anything compiles."""
    section = {"vocab_size": 32, "d_model": 32, "num_layers": 2, "num_heads": 4}
    section |= {"num_kv_heads": 2, "d_ff": 48, "attn_sinks": True, "max_len": 64}
    gpu = attention.Backend("gpu", (9, 0), cudnn=True, sms=132)
    model = llama.create_model(ml_collections.ConfigDict(section), jnp.bfloat16, backend=gpu)
    assert model.implementation == "cudnn"
    mesh = {"expert": 1, "tensor": 1, "context": 2}
    config = ml_collections.ConfigDict({"mesh": mesh, "model": section})
    with pytest.raises(ValueError, match=r"mesh.context=2: .*takes no sinks .*'materialized'"):
        llama.check_mesh(config, model, None)
