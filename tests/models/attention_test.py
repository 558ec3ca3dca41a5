"""Attention: cuDNN's fused kernel where it can run, the materialised fp32 island elsewhere;
which one a model picks, and that all three implementations compute the same thing, grouped
(fewer key/value heads than query heads) or not."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers import (
    A100,
    BACKEND_NAMES,
    CPU,
    H100,
    H100_WITHOUT_CUDNN,
    TPU,
    V100,
    cudnn_as_xla,
    matmul_dtypes,
    normal,
    pretend_gpu,
    run_cli,
)
from transformer_lm_test import NUM_LAYERS, NUM_MATMULS, _apply, _model, _to_bf16, _tokens

from mptrain.models import attention, segments, transformer_lm


@pytest.fixture(scope="module")
def params():
    return jax.jit(_model().init)(jax.random.key(0), _tokens())


@pytest.mark.parametrize(
    ("backend", "dtype", "head_dim", "dropout_rate", "reason"),
    [
        (H100, jnp.bfloat16, 64, 0.0, None),
        (H100, jnp.float16, 64, 0.0, None),
        (H100, jnp.bfloat16, 256, 0.0, None),
        (A100, jnp.bfloat16, 128, 0.0, None),
        (CPU, jnp.bfloat16, 64, 0.0, "not on a GPU: the backend is cpu"),
        (TPU, jnp.float32, 64, 0.0, "not on a GPU: the backend is tpu"),
        (H100, jnp.float32, 64, 0.0, "float32 compute"),
        (H100, jnp.bfloat16, 64, 0.1, "dropout_rate=0.1"),
        (H100, jnp.bfloat16, 12, 0.0, "head_dim=12: cuDNN takes multiples of 8 up to 256"),
        (H100, jnp.bfloat16, 264, 0.0, "head_dim=264"),
        (A100, jnp.bfloat16, 256, 0.0, "head_dim=256: cuDNN takes multiples of 8 up to 128"),
        (V100, jnp.bfloat16, 64, 0.0, "compute capability 8.0"),
        (H100_WITHOUT_CUDNN, jnp.bfloat16, 64, 0.0, "finds no cuDNN"),
    ],
    ids=lambda value: BACKEND_NAMES.get(value) if isinstance(value, attention.Backend) else None,
)
def test_auto_is_cudnn_on_a_gpu_with_16_bit_compute_and_says_why_not_elsewhere(
    backend, dtype, head_dim, dropout_rate, reason
):
    kwargs = {"dtype": dtype, "head_dim": head_dim, "dropout_rate": dropout_rate}
    choice = attention.choose_attention("auto", backend=backend, **kwargs)
    if reason is None:
        assert choice == attention.AttentionChoice("cudnn")
        assert str(choice) == "cuDNN fused (jax.nn.dot_product_attention)"
        return
    assert choice.implementation == "materialized", choice
    assert backend == TPU or reason in choice.reason, choice
    assert str(choice) == f"materialized [B, H, L, L] in fp32 ({choice.reason})"
    # Asked for by name where it cannot run: an error naming the key and the reason.
    with pytest.raises(ValueError, match=rf"model\.attention='cudnn' cannot run here: .*{reason}"):
        attention.choose_attention("cudnn", backend=backend, **kwargs)


def test_materialized_is_kept_where_cudnn_could_run_and_bad_names_are_refused():
    choice = attention.choose_attention(
        "materialized", dtype=jnp.bfloat16, head_dim=64, backend=H100
    )
    assert choice.implementation == "materialized"
    assert str(choice) == "materialized [B, H, L, L] in fp32 (model.attention='materialized')"
    with pytest.raises(
        ValueError,
        match="model.attention='splash': not supported; valid values: auto, cudnn, flash",
    ):
        attention.choose_attention("splash", dtype=jnp.bfloat16, head_dim=64, backend=H100)


def _lm_config(**keys):
    base = {"d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 48, "max_len": 8}
    return ml_collections.ConfigDict({**base, **keys})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what 'auto' picks on a CPU")
def test_create_model_on_this_cpu_materializes_and_logs_why_once(caplog):
    with caplog.at_level(logging.INFO, logger="absl"):
        model = transformer_lm.create_model(_lm_config(), jnp.bfloat16)
    assert attention.local_backend() == CPU and model.attention == "materialized"
    lines = [r.getMessage() for r in caplog.records if "attention" in r.getMessage()]
    assert lines == [
        "mptrain: attention: materialized [B, H, L, L] in fp32 (not on a GPU: the backend is cpu)"
    ]
    with pytest.raises(ValueError, match=r"model\.attention='cudnn' cannot run here"):
        transformer_lm.create_model(_lm_config(attention="cudnn"), jnp.bfloat16)


def test_create_model_on_a_gpu_takes_cudnn_for_16_bit_compute_only(monkeypatch, caplog):
    pretend_gpu(monkeypatch)
    with caplog.at_level(logging.INFO, logger="absl"):
        model = transformer_lm.create_model(_lm_config(), jnp.bfloat16)
    assert model.attention == "cudnn"
    lines = [r.getMessage() for r in caplog.records if "attention" in r.getMessage()]
    assert lines == ["mptrain: attention: cuDNN fused (jax.nn.dot_product_attention)"]
    assert transformer_lm.create_model(_lm_config(), jnp.float32).attention == "materialized"
    dropout = _lm_config(dropout_rate=0.1)
    assert transformer_lm.create_model(dropout, jnp.bfloat16).attention == "materialized"
    pinned = _lm_config(attention="materialized")
    assert transformer_lm.create_model(pinned, jnp.bfloat16).attention == "materialized"


def _qkv(shape, seed=0, *, kv_heads=None, dtype=jnp.bfloat16):
    """Random q of `shape` ([B, L, H, D]) and k, v of `kv_heads` heads (default: H)."""
    batch, length, heads, depth = shape
    kv_shape = (batch, length, kv_heads or heads, depth)
    return [normal(3 * seed + i, s, dtype) for i, s in enumerate((shape, kv_shape, kv_shape))]


def _repeated_kv_attention(q, k, v):
    """Causal attention as HuggingFace's Llama computes grouped queries: `repeat_kv` copies
    each kv head to the H // K query heads that follow one another (`jnp.repeat`, not
    `jnp.tile`), then plain multi-head attention in fp32 at full precision."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    highest = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=highest) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=highest)


# [B, L, H, D] = 2 x 16 x 8 x 8 q: 4 query heads a kv head; one kv head (multi-query); 8
# (multi-head, the program of before grouping). make test keeps the grouped case.
@pytest.mark.parametrize(
    "kv_heads",
    [2, pytest.param(1, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)],
)
def test_grouped_materialized_attention_is_attention_over_kv_heads_repeated_per_query_head(
    kv_heads,
):
    shape = (2, 16, 8, 8)
    q, k, v = _qkv(shape, kv_heads=kv_heads, dtype=jnp.float32)
    weights = normal(9, shape)

    def loss(attend, q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * weights), out

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    materialized = functools.partial(attention.causal_attention, implementation="materialized")
    grads, out = grad(materialized, q, k, v)
    want_grads, want = grad(_repeated_kv_attention, q, k, v)
    assert out.shape == shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, want_grads, strict=True):
        assert got.shape == expected.shape  # dk, dv at the kv heads: summed over each group
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_the_dropout_hook_sees_grouped_probabilities_as_b_h_l_l():
    """Grouped or not, the materialised path's dropout gets the ``[B, H, L, L]`` probabilities,
    head ``h`` at index ``h``: here it silences query head 1 alone."""
    q, k, v = _qkv((2, 16, 4, 8), kv_heads=2, dtype=jnp.float32)
    seen = []

    def silence_head_1(probs):
        seen.append(probs.shape)
        return probs * (jnp.arange(4) != 1)[:, None, None]

    out = attention.causal_attention(q, k, v, "materialized", dropout=silence_head_1)
    want = _repeated_kv_attention(q, k, v)
    assert seen == [(2, 4, 16, 16)]
    np.testing.assert_array_equal(out[:, :, 1], 0)
    np.testing.assert_allclose(out[:, :, [0, 2, 3]], want[:, :, [0, 2, 3]], rtol=1e-5, atol=1e-6)


# The test model's heads ([B, L, H, D] = 2 x 16 x 4 x 8) and GPT-2 small's (12 heads of 64),
# each also grouped: 2 query heads a kv head, one kv head, 3 query heads a kv head. make test
# keeps the test model's heads; the other shapes and groupings run in make test-slow.
@pytest.mark.parametrize(
    ("shape", "kv_heads"),
    [
        ((2, 16, 4, 8), 4),
        pytest.param((2, 64, 12, 64), 12, marks=pytest.mark.slow),
        pytest.param((2, 16, 4, 8), 2, marks=pytest.mark.slow),
        pytest.param((2, 16, 4, 8), 1, marks=pytest.mark.slow),
        pytest.param((2, 64, 12, 64), 4, marks=pytest.mark.slow),
    ],
    ids=["mha-4", "mha-12", "gqa-4-2", "mqa-4-1", "gqa-12-4"],
)
def test_the_cudnn_call_computes_what_the_materialized_path_does(monkeypatch, shape, kv_heads):
    asked = cudnn_as_xla(monkeypatch)
    q, k, v = _qkv(shape, kv_heads=kv_heads)
    weights = normal(9, shape)

    def loss(implementation, q, k, v):
        out = attention.causal_attention(q, k, v, implementation)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (dq, dk, dv), out = grad("cudnn", q, k, v)
    assert asked == ["cudnn"] and out.dtype == jnp.bfloat16 and out.shape == shape
    (want_dq, want_dk, want_dv), want = grad("materialized", q, k, v)
    np.testing.assert_allclose(
        out.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2, rtol=2e-2
    )  # bf16 outputs of up to ~4: an ulp is 1/64
    for got, expected in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
        assert got.dtype == jnp.bfloat16 and got.shape == expected.shape
        got, expected = got.astype(jnp.float32), expected.astype(jnp.float32)
        np.testing.assert_allclose(got, expected, atol=0.02 * float(jnp.abs(expected).max()))


def _windowed(q, k, v, window, scale=None, softcap=None):
    """A query's softmax over itself and the `window - 1` keys before it, in numpy float64,
    k and v repeated to every query head (transformers' `repeat_kv` and sliding mask); the
    scores scaled by `scale` (else 1 / sqrt(D)) and soft-capped as Gemma 2's eager attention."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    at = np.arange(q.shape[1])
    seen = (at[None, :] <= at[:, None]) & (at[None, :] > at[:, None] - window)
    scores = np.where(seen, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), v)


def test_a_sliding_window_is_the_same_window_on_every_path(monkeypatch):
    """Mistral's and Qwen's sliding window (a query sees itself and the `window - 1` keys
    before it): the materialised mask, cuDNN's call (jax's `local_window_size`, run with its
    reference semantics here), and the KV cache a token at a time, all as transformers
    masks."""
    q, k, v = _qkv((2, 12, 4, 8), kv_heads=2, dtype=jnp.float32)
    want = _windowed(q, k, v, window=5)
    got = attention.causal_attention(q, k, v, "materialized", window=5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    asked = cudnn_as_xla(monkeypatch)
    fused = attention.causal_attention(q, k, v, "cudnn", window=5)
    assert asked == ["cudnn"]
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-6)
    cache = [jnp.swapaxes(x, 1, 2) for x in (k, v)]  # the cache's [B, K, S, D]
    for t in (3, 8, 11):  # before the window fills, and after
        step = attention.cached_attention(q[:, t : t + 1], *cache, jnp.full((2, 1), t), window=5)
        np.testing.assert_allclose(step[:, 0], want[:, t], rtol=1e-5, atol=1e-6)


def test_cudnns_window_is_in_the_program_a_gpu_compiles(monkeypatch):
    """The program lowered for CUDA (as the test above lowers it): cuDNN's forward and backward
    fused attention carry the sliding window, so no mask or [L, L] buffer stands in for it."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
    q, k, v = _qkv((2, 64, 4, 16), kv_heads=2)

    def loss(q, k, v):
        return attention.causal_attention(q, k, v, "cudnn", window=5).astype(jnp.float32).sum()

    traced = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, v)
    program = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in program.splitlines() if "custom_call @__cudnn$fmha" in line]
    assert len(calls) == 2 and all("sliding_window_length\\22: 5" in c for c in calls), calls
    assert "64x64x" not in program  # no [L, L] array, forward or backward


@pytest.mark.slow  # Pallas's interpret mode: the other paths' window runs in make test
def test_the_tpu_kernels_sliding_window_is_the_same_window_in_interpret_mode():
    from jax.experimental.pallas import tpu as pltpu

    q, k, v = _qkv((1, 256, 2, 64), kv_heads=1, dtype=jnp.float32)  # two tiles of 128
    with pltpu.force_tpu_interpret_mode():
        got = attention.causal_attention(q, k, v, "flash", window=100)
    np.testing.assert_allclose(got, _windowed(q, k, v, window=100), rtol=1e-4, atol=1e-5)


def test_layers_of_two_kinds_lower_to_cudnn_with_each_layers_own_window_and_scale(monkeypatch):
    """A Gemma 3 shaped decoder (two sliding layers, then a global one, scanned as one period)
    lowered for an H100: each sliding layer's cuDNN calls carry its window, the global one's
    none, and every call the scale query_pre_attn_scalar ** -0.5 (that the compiled program
    holds no [B, H, L, L] buffer is the plan's to say: Gemma-3-12B's in docs/fine-tuning.md)."""
    from jax._src.cudnn import fused_attention_stablehlo

    from mptrain.models import decoder as llama

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
    pretend_gpu(monkeypatch)
    kinds = ("sliding_attention", "sliding_attention", "full_attention")
    section = {"d_model": 32, "num_layers": 3, "num_heads": 2, "num_kv_heads": 1, "d_ff": 64}
    section |= {"max_len": 64, "sliding_window": 5, "layer_types": kinds}
    section |= {"query_pre_attn_scalar": 24.0, "norm_plus_one": True, "post_norms": True}
    model = llama.create_model(ml_collections.ConfigDict(section), jnp.bfloat16)
    tokens = jnp.zeros((2, 64), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

    def loss(p):
        return model.apply({"params": p}, tokens).astype(jnp.float32).sum()

    traced = jax.jit(jax.grad(loss)).trace(params)
    program = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in program.splitlines() if "custom_call @__cudnn$fmha" in line]
    windows = [re.search(r"sliding_window_length\\22: (\d+)", c) for c in calls]
    assert sorted(int(w[1]) if w else 0 for w in windows) == [0, 0, 5, 5, 5, 5], calls
    scales = {float(re.search(r"fmha_scale\\22: ([-+.e\d]+)", c)[1]) for c in calls}
    np.testing.assert_allclose(sorted(scales), [24.0**-0.5], rtol=1e-6)


@pytest.mark.slow  # Pallas's interpret mode: a second variant of the kernel's window
def test_gemmas_scale_and_soft_cap_are_the_same_on_the_materialised_path_and_the_tpu_kernel():
    """Gemma 2's scores: scaled by query_pre_attn_scalar ** -0.5, soft-capped before the mask."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v = _qkv((1, 256, 2, 64), kv_heads=1, dtype=jnp.float32)
    q = q * 8.0  # scores of order ten, where a cap of 2 bites
    how = {"window": 100, "scale": 24.0**-0.5, "softcap": 2.0}
    want = _windowed(q, k, v, **how)
    assert np.abs(want - _windowed(q, k, v, window=100, scale=how["scale"])).max() > 0.05
    got = attention.causal_attention(q, k, v, "materialized", **how)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pltpu.force_tpu_interpret_mode():
        got = attention.causal_attention(q, k, v, "flash", **how)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_scores_with_a_soft_cap_are_not_cudnns(monkeypatch):
    """cuDNN's fused kernel has no soft-cap: "auto" takes the materialised path and says why,
    "cudnn" by name is refused naming the key; a call that asks for both is refused too."""
    pretend_gpu(monkeypatch)
    how = {"dtype": jnp.bfloat16, "head_dim": 64, "length": 128}
    assert attention.choose_attention("auto", **how).implementation == "cudnn"
    choice = attention.choose_attention("auto", **how, softcap=50.0)
    assert choice.implementation == "materialized" and "model.attn_softcap=50.0" in choice.reason
    with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run here: cuDNN has no"):
        attention.choose_attention("cudnn", **how, softcap=50.0)
    q, k, v = _qkv((1, 8, 2, 16), kv_heads=1, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"cudnn attention has no soft-cap"):
        attention.causal_attention(q, k, v, "cudnn", softcap=50.0)


def test_the_model_on_cudnn_matches_the_materialized_model_and_stays_causal(monkeypatch, params):
    pretend_gpu(monkeypatch)
    asked = cudnn_as_xla(monkeypatch)
    bf16 = _to_bf16(params)
    tokens = _tokens()
    fused = _apply(_model(jnp.bfloat16, attention="auto"), bf16, tokens)
    assert asked == ["cudnn"] * NUM_LAYERS  # "auto" took cuDNN on the pretend GPU
    materialized = _apply(_model(jnp.bfloat16), bf16, tokens)
    np.testing.assert_allclose(fused, materialized, atol=0.1)  # seen: 0.027, logits up to 3.7
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    after = _apply(_model(jnp.bfloat16, attention="auto"), bf16, changed)
    np.testing.assert_array_equal(fused[:, :10], after[:, :10])
    assert not np.allclose(fused[:, 10:], after[:, 10:])


def test_the_cudnn_path_lowers_to_cudnns_fused_kernels_for_cuda(monkeypatch, params):
    # On a machine without CUDA, jax stops while tracing, before lowering, at its check for an
    # installed cuDNN ("cuDNN is not detected"). Test-only: that check answers with a version,
    # so the program a GPU would compile can be lowered for the "cuda" platform and read here.
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
    pretend_gpu(monkeypatch)
    model = _model(jnp.bfloat16, attention="auto")
    tokens = _tokens(length=17)

    def loss_fn(p):
        return transformer_lm.lm_loss(model.apply(_to_bf16(p), tokens[:, :-1]), tokens[:, 1:])

    lowered = jax.jit(jax.grad(loss_fn)).trace(params).lower(lowering_platforms=("cuda",))
    program = lowered.as_text()
    lines = program.splitlines()
    forward = [line for line in lines if "custom_call @__cudnn$fmhaSoftmax(" in line]
    backward = [line for line in lines if "custom_call @__cudnn$fmhaSoftmaxBackward(" in line]
    assert len(forward) == len(backward) == NUM_LAYERS, (forward, backward)
    qkv = "tensor<2x16x4x8xbf16>"  # [B, L, H, D]: the heads as the model splits them
    for line in forward:
        assert re.search(r"mask_type\\22: \\22CAUSAL\\22", line), line
        scale = float(re.search(r"fmha_scale\\22: ([-+.e\d]+)", line).group(1))
        np.testing.assert_allclose(scale, 8**-0.5, rtol=1e-12)
        # bf16 q, k, v in; bf16 output and the fp32 log-sum-exp [B, H, L] out, kept for the
        # backward pass (which takes it back as its fourth operand)
        assert f"({qkv}, {qkv}, {qkv}) -> (tensor<2x4x16x8xbf16>, tensor<2x4x16xf32>" in line
    for line in backward:
        assert f"({qkv}, {qkv}, {qkv}, tensor<2x4x16xf32>, " in line, line
    assert "tensor<2x4x16x16x" not in program  # no [B, H, L, L] scores, forward or backward
    # What is left as matmuls (qkv, attention out, mlp in and out per block, the one-hot
    # embedding, the logits) and their gradients runs in bf16.
    dots = matmul_dtypes(program)
    assert len(dots) == 3 * (NUM_MATMULS - 2 * NUM_LAYERS) - 1, dots
    assert all(operands == ("bf16", "bf16") for operands, _ in dots), dots


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_cudnn_attention_lowers_with_k_and_v_read_at_their_own_heads(monkeypatch, kv_heads):
    # As above: the cuDNN version check answers, so the cuda program lowers on this CPU.
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
    q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 16, kv_heads, 8), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(attention.causal_attention(q, k, v, "cudnn").astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    program = grad.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    lines = program.splitlines()
    (forward,) = [line for line in lines if "custom_call @__cudnn$fmhaSoftmax(" in line]
    (backward,) = [line for line in lines if "custom_call @__cudnn$fmhaSoftmaxBackward(" in line]
    types = {"q": "tensor<2x16x4x8xbf16>", "kv": f"tensor<2x16x{kv_heads}x8xbf16>"}
    # the kernels read the arguments themselves (%arg1, %arg2: k, v), at their kv heads: no
    # broadcast or copy of k or v to the 4 query heads comes before them
    assert "@__cudnn$fmhaSoftmax(%arg0, %arg1, %arg2)" in forward, forward
    assert f"({types['q']}, {types['kv']}, {types['kv']}) -> " in forward, forward
    assert "@__cudnn$fmhaSoftmaxBackward(%arg0, %arg1, %arg2, " in backward, backward
    # and the backward kernel returns dk, dv at the kv heads ([B, K, L, D]: its layout)
    dkv = f"tensor<2x{kv_heads}x16x8xbf16>"
    assert f"-> (tensor<2x4x16x8xbf16>, {dkv}, {dkv}, " in backward, backward


@pytest.mark.plan
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
@pytest.mark.parametrize(("chip", "implementation"), [("h100", "cudnn"), ("v5e", "flash")])
def test_grouped_attention_compiles_for_an_h100_and_a_tpu_with_kv_gradients_at_kv_heads(
    chip, implementation
):
    """XLA:GPU's cuDNN and a TPU's Mosaic compiler, not only jax, take the grouped call (the
    extra mptrain[plan]: compile-only devices, nothing runs): the dk, dv kernels write
    ``[B, K, L, D]`` (cuDNN) or ``[B * K, L, D]`` (splash), never a copy at the query heads."""
    from mptrain import target

    sharding = jax.sharding.SingleDeviceSharding(target.targets()[chip].devices(1)[0])
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((2, 256, 1, 64), jnp.bfloat16, sharding=sharding)

    def loss(q, k, v):
        return jnp.sum(attention.causal_attention(q, k, v, implementation).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower().compile()
    kernels = [
        line.split(" custom-call(")[0]
        for line in compiled.as_text().splitlines()
        if " custom-call(" in line and re.search(r"__cudnn\$fmha|tpu_custom_call", line)
    ]
    (dkv,) = [line for line in kernels if re.search(r"attention_bwd|dkv", line)]
    kv_grad = "bf16[2,1,256,64]" if chip == "h100" else "bf16[2,256,64]"
    assert dkv.count(kv_grad) == 2, kernels  # dk and dv, at the one kv head


def test_a_bad_attention_on_the_command_line_exits_2_naming_the_key(tmp_path, capsys):
    code, err = run_cli(tmp_path / "run", "--config.model.attention=flash", capsys=capsys)
    assert code == 2 and "config.model.attention='flash'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("dtype", "length", "dropout_rate", "reason"),
    [
        (jnp.bfloat16, 1024, 0.0, None),
        (jnp.float16, 128, 0.0, None),
        (jnp.float32, 1024, 0.0, "float32 compute: the TPU flash kernel takes bfloat16"),
        (jnp.bfloat16, 100, 0.0, "a sequence of 100: the TPU flash kernel tiles it by multiples"),
        (jnp.bfloat16, 1024, 0.1, "dropout_rate=0.1: the TPU flash kernel has no dropout"),
    ],
)
def test_auto_is_the_pallas_flash_kernel_on_a_tpu_and_says_why_not(
    dtype, length, dropout_rate, reason
):
    kwargs = {"dtype": dtype, "head_dim": 64, "dropout_rate": dropout_rate, "length": length}
    choice = attention.choose_attention("auto", backend=TPU, **kwargs)
    if reason is None:
        assert choice.implementation == "flash", choice
        assert str(choice) == "Pallas TPU flash attention (jax.experimental.pallas.ops.tpu)"
        return
    assert choice.implementation == "materialized" and reason in choice.reason, choice
    with pytest.raises(ValueError, match=rf"model\.attention='flash' cannot run here: {reason}"):
        attention.choose_attention("flash", backend=TPU, **kwargs)
    with pytest.raises(
        ValueError, match="'flash' cannot run here: not on a TPU: the backend is gpu"
    ):
        attention.choose_attention("flash", backend=H100, **kwargs)


_BF16_GAPS, _FP32_GAPS = (jnp.bfloat16, 2e-2, 6e-2), (jnp.float32, 2e-5, 1e-4)


# Interpret mode is slow (seconds a case, 8 s cold), so all of it runs in `make test-slow`: each
# grouping once, 4:2 in fp32, whose tight gaps would catch a kv head read for the wrong query
# head or example.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "forward", "gradient"),
    [
        (2, 2, *_BF16_GAPS),
        (2, 2, *_FP32_GAPS),
        (4, 2, *_FP32_GAPS),
        (4, 1, *_BF16_GAPS),
    ],
    ids=["mha-2-bf16", "mha-2-fp32", "gqa-4-2-fp32", "mqa-4-1-bf16"],
)
def test_the_tpu_flash_kernel_matches_the_materialized_path_in_interpret_mode(
    heads, kv_heads, dtype, forward, gradient
):
    """The Pallas TPU kernel, run on this CPU by Pallas's TPU interpret mode, against the
    materialised island: outputs and q, k, v gradients, causal, in bf16 and fp32 (the gaps are
    a few units in the last place of bf16; fp32's are summation order), with as many kv heads
    as query heads, half as many, and one."""
    from jax.experimental.pallas import tpu as pltpu

    shape = (2, 256, heads, 64)  # [B, L, H, D]: two tiles of 128 along the sequence
    kv_shape = (2, 256, kv_heads, 64)
    q, k, v = (normal(3 + i, s, dtype) for i, s in enumerate((shape, kv_shape, kv_shape)))
    weights = normal(7, shape)

    def loss(implementation, q, k, v):
        out = attention.causal_attention(q, k, v, implementation)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    with pltpu.force_tpu_interpret_mode():
        (_, flash), grads = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)("flash", q, k, v)
    (_, reference), expected = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)(
        "materialized", q, k, v
    )
    assert flash.dtype == dtype and flash.shape == shape
    assert jnp.abs(flash.astype(jnp.float32) - reference.astype(jnp.float32)).max() < forward
    for got, want in zip(grads, expected, strict=True):
        assert got.shape == want.shape
        scale = jnp.abs(want.astype(jnp.float32)).max()
        gap = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
        assert gap < gradient * scale, (gap, scale)
    # causal: the first query sees the first key only, so later keys change nothing there
    later = k.at[:, 1:].set(0)
    with pltpu.force_tpu_interpret_mode():
        changed = attention.causal_attention(q, later, v, "flash")
    assert (changed[:, 0] == flash[:, 0]).all()


@pytest.mark.parametrize("implementation", ["materialized", "cudnn", "flash"])
@pytest.mark.parametrize(
    ("kv_heads", "v_heads", "message"),
    [
        (3, 3, "4 query heads and 3 key/value heads: grouped-query attention needs the "),
        (8, 8, "4 query heads and 8 key/value heads"),
        (2, 1, "k has 2 heads and v 1"),
    ],
    ids=["3-of-4", "8-of-4", "k-2-v-1"],
)
def test_head_counts_that_do_not_group_are_refused_naming_both(
    implementation, kv_heads, v_heads, message
):
    q = jnp.zeros((1, 128, 4, 8), jnp.bfloat16)
    k = jnp.zeros((1, 128, kv_heads, 8), jnp.bfloat16)
    v = jnp.zeros((1, 128, v_heads, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape(message)):
        attention.causal_attention(q, k, v, implementation)


def test_a_packed_row_attends_within_each_example_as_each_alone_does():
    """Examples packed into one row (issue 44): with their segment ids, the materialised path
    gives each example, at every position of the row, the attention it gets alone; grouped
    query heads, fp32. cuDNN takes the segments' lengths too (the next test)."""
    lengths = (5, 7, 4)  # three examples and no padding: one row of 16
    shape = (1, sum(lengths), 4, 8)
    q, k, v = _qkv(shape, kv_heads=2, dtype=jnp.float32)
    segment_ids = jnp.asarray([np.repeat(np.arange(1, 4), lengths)])
    attend = jax.jit(functools.partial(attention.causal_attention, implementation="materialized"))
    packed = attend(q, k, v, segment_ids=segment_ids)
    start = 0
    for n in lengths:
        piece = slice(start, start + n)
        alone = attend(q[:, piece], k[:, piece], v[:, piece])
        np.testing.assert_allclose(packed[:, piece], alone, rtol=1e-6, atol=1e-6)
        start += n
    assert not np.allclose(attend(q, k, v)[:, 5:], packed[:, 5:])  # unmasked, it would differ
    with pytest.raises(ValueError, match="^cudnn attention of packed rows takes their segment"):
        attention.causal_attention(q, k, v, "cudnn", segment_ids=segment_ids)


def test_cudnns_packed_layout_describes_the_materialised_paths_mask():
    """The GPU path (issue 44): cuDNN's packed layout reads each row's segments as lengths and
    offsets (`packed_layout`), causal within each. The mask they describe, as cuDNN reads
    them, is the materialised path's (same segment, key not after query) on every real token,
    for rows of 1 to 4 segments and padding, M above the most a row holds; the lengths come
    from the ids as `data.sft` computes them. Run on an H100: scripts/gpu_check.py."""
    rows = [(5, 7, 4), (16,), (3, 3, 3, 2), (9, 1)]  # the rest of each 16-token row: padding
    ids = np.zeros((len(rows), 16), np.int32)
    for r, lengths in enumerate(rows):
        ids[r, : sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    lengths = segments.segment_lengths(jnp.asarray(ids), 6)
    from mptrain.data import packing

    np.testing.assert_array_equal(lengths, packing.segment_lengths(ids, 6))
    seqlen, offsets = (np.asarray(x) for x in segments.packed_layout(lengths))
    assert seqlen.shape == (4, 6) and offsets.shape == (4, 7)
    for r in range(len(rows)):
        cudnn = np.zeros((16, 16), bool)  # query i sees key j: the same segment, j <= i
        for s in range(6):
            if seqlen[r, s] > 0:
                at = range(offsets[r, s], offsets[r, s] + seqlen[r, s])
                for i in at:
                    cudnn[i, at.start : i + 1] = True
            else:
                assert seqlen[r, s] == -1 and offsets[r, s] == -1
        assert offsets[r, 6] == -1
        real = ids[r] > 0
        materialised = np.tril(np.ones((16, 16), bool)) & (ids[r][:, None] == ids[r][None, :])
        np.testing.assert_array_equal(cudnn[real], materialised[real])
        assert not cudnn[~real].any()  # padding queries see nothing (their loss is masked)


@pytest.mark.slow  # make test keeps the materialised path's test of it
def test_the_tpu_kernel_keeps_to_each_rows_own_segments_in_interpret_mode():
    """The splash kernel with `SegmentIds` (issue 44), one call an example since rows differ
    in their segments: the materialised path's outputs and gradients, in fp32."""
    from jax.experimental.pallas import tpu as pltpu

    shape = (2, 128, 4, 64)  # [B, L, H, D]: one tile of 128, the kernel's least
    q, k, v = _qkv(shape, kv_heads=2, dtype=jnp.float32)
    segment_ids = jnp.asarray([np.repeat([1, 2, 3], (40, 50, 38)), np.repeat([1, 2], (64, 64))])
    weights = normal(9, shape)

    def loss(implementation, q, k, v):
        out = attention.causal_attention(q, k, v, implementation, segment_ids=segment_ids)
        return jnp.sum(out * weights), out

    with pltpu.force_tpu_interpret_mode():
        (_, flash), grads = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)("flash", q, k, v)
    (_, want), expected = jax.value_and_grad(loss, (1, 2, 3), has_aux=True)("materialized", q, k, v)
    np.testing.assert_allclose(flash, want, rtol=1e-5, atol=1e-5)
    for got, wanted in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, wanted, rtol=1e-4, atol=1e-5)
