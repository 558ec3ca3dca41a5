"""The chunked LM loss (`lm_loss.token_loss`) against the unchunked one, `layers.cross_entropy` on
the fp32 logits of `layers.einsum_f32_out`: the same loss and gradients, the masks, the z-loss,
an fp32 sum of the kernel's gradient, and no `[B, L, V]` array in the program."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import integers, needs_devices, normal

from mptrain.models import layers, lm_loss

B, L, D, V = 2, 16, 8, 64


def _inputs(dtype, length=L, seed=0, batch=B):
    hidden = normal(3 * seed, (batch, length, D), dtype)
    kernel = normal(3 * seed + 1, (D, V), dtype, scale=3 / np.sqrt(D))
    return hidden, kernel, integers(3 * seed + 2, (batch, length), V)


def _logits(hidden, kernel):
    return layers.einsum_f32_out("bld,dv->blv", hidden, kernel.astype(hidden.dtype))


def _reference(hidden, kernel, targets):
    return layers.cross_entropy(_logits(hidden, kernel), targets)


def _chunked(chunk=None, z_loss=0.0, key="loss"):
    return lambda h, k, t: lm_loss.token_loss(h, k, t, chunk=chunk, z_loss=z_loss)[key]


def _value_and_grads(fn, *args):
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(*args)


def _ulps(found, expected, dtype):
    """|found - expected| in units of the last place of ``expected`` in ``dtype``."""
    expected, info = np.asarray(expected, np.float32), jnp.finfo(dtype)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(expected), float(info.tiny)))) - info.nmant)
    return np.abs(np.asarray(found, np.float32) - expected) / ulp


# make test keeps four of the twelve: chunks that pad L (3) and one chunk (None) in fp32, L in
# bf16 and 4 L in fp32; the rest, the same function at more chunkings, in make test-slow
_CHUNKINGS_KEPT = {(3, jnp.float32), (None, jnp.float32), (L, jnp.bfloat16), (4 * L, jnp.float32)}


@pytest.mark.parametrize(
    "chunk, dtype",
    [
        (c, d) if (c, d) in _CHUNKINGS_KEPT else pytest.param(c, d, marks=pytest.mark.slow)
        for c in [1, 3, 4, None, L, 4 * L]  # 3 pads L; None: one chunk here
        for d in [jnp.float32, jnp.bfloat16]
    ],
)
def test_chunked_loss_and_gradients_are_the_unchunked_ones(dtype, chunk):
    args = _inputs(dtype)
    expected, (d_hidden, d_kernel) = _value_and_grads(_reference, *args)
    found, (f_hidden, f_kernel) = _value_and_grads(_chunked(chunk), *args)
    np.testing.assert_allclose(found, expected, rtol=1e-6)
    assert f_hidden.dtype == f_kernel.dtype == dtype
    if dtype == jnp.float32:  # fp32 sums in another order
        np.testing.assert_allclose(f_hidden, d_hidden, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(f_kernel, d_kernel, rtol=1e-5, atol=1e-7)
    else:  # the same 16-bit logits' gradient, the same matmuls, rounded once
        assert _ulps(f_hidden, d_hidden, dtype).max() <= 1
        assert _ulps(f_kernel, d_kernel, dtype).max() <= 1


@pytest.mark.slow  # a second variant of the chunked rule (the fixtures' Gemma 2 in make test)
@pytest.mark.parametrize("chunk", [3, None])
def test_soft_capped_chunked_loss_and_gradients_are_those_of_the_capped_logits(chunk):
    """Gemma 2's final soft-cap inside the chunked rule's forward and backward: the loss and
    gradients of autodiff through ``cap * tanh(logits / cap)`` on the whole fp32 logits."""
    args, cap = _inputs(jnp.float32), 2.0

    def reference(h, k, t):
        return layers.cross_entropy(lm_loss.capped(_logits(h, k), cap), t)

    def chunked(h, k, t):
        return lm_loss.token_loss(h, k, t, chunk=chunk, softcap=cap)["loss"]

    expected, (d_hidden, d_kernel) = _value_and_grads(reference, *args)
    found, (f_hidden, f_kernel) = _value_and_grads(chunked, *args)
    assert abs(float(expected) - float(_value_and_grads(_reference, *args)[0])) > 0.05
    np.testing.assert_allclose(found, expected, rtol=1e-6)
    np.testing.assert_allclose(f_hidden, d_hidden, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(f_kernel, d_kernel, rtol=1e-5, atol=1e-7)


def _masked(targets):
    """Targets with a third of the tokens masked (-1 and -100), and the indices of the rest."""
    mask = np.arange(B * L).reshape(B, L) % 3 == 1
    masked = np.where(mask, np.where(np.arange(L) % 2, -1, -100), np.asarray(targets))
    return jnp.asarray(masked, jnp.int32), np.nonzero(~mask)


def test_masked_targets_are_left_out_of_the_mean():
    hidden, kernel, targets = _inputs(jnp.float32)
    targets, kept = _masked(targets)
    # the reference never sees the masked tokens
    dropped = lambda h, k, t: layers.cross_entropy(_logits(h, k)[kept], t[kept])
    expected, (d_hidden, d_kernel) = _value_and_grads(dropped, hidden, kernel, targets)
    for loss_fn in (_chunked(chunk=3), _reference):
        found, (f_hidden, f_kernel) = _value_and_grads(loss_fn, hidden, kernel, targets)
        np.testing.assert_allclose(found, expected, rtol=1e-6)
        np.testing.assert_allclose(f_hidden, d_hidden, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(f_kernel, d_kernel, rtol=1e-5, atol=1e-7)
        assert not np.any(np.asarray(f_hidden)[np.asarray(targets) < 0])


@pytest.mark.slow  # a variant: make test keeps the chunked loss against the unchunked
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_batch_without_a_valid_target_has_loss_0_and_zero_gradients(dtype):
    hidden, kernel, _ = _inputs(dtype)
    targets = jnp.full((B, L), -1, jnp.int32)
    grad = jax.jit(jax.grad(_chunked(chunk=4, z_loss=1e-4), argnums=(0, 1)))
    for g in grad(hidden, kernel, targets):
        assert np.all(np.asarray(g, np.float32) == 0)
    out = jax.jit(lambda *a: lm_loss.token_loss(*a, chunk=4, z_loss=1e-4))(hidden, kernel, targets)
    assert {key: float(np.abs(v).max()) for key, v in out.items()} == dict.fromkeys(out, 0.0)


@pytest.mark.slow  # make test keeps the z-loss's value at the model (transformer_lm_test)
def test_z_loss_is_the_mean_squared_log_normaliser():
    hidden, kernel, targets = _inputs(jnp.float32)
    targets, kept = _masked(targets)
    coef = 0.1  # large, so its gradient is a large part of the total
    out = jax.jit(lambda *a: lm_loss.token_loss(*a, chunk=3, z_loss=coef))(hidden, kernel, targets)
    logits = np.einsum("bld,dv->blv", *(np.asarray(x, np.float64) for x in (hidden, kernel)))
    lse = np.log(np.sum(np.exp(logits), axis=-1))
    picked = np.take_along_axis(logits, np.maximum(np.asarray(targets), 0)[..., None], -1)[..., 0]
    ce, z = np.mean((lse - picked)[kept]), np.mean((lse**2)[kept])
    np.testing.assert_allclose(out["cross_entropy"], ce, rtol=1e-6)
    np.testing.assert_allclose(out["z_loss"], z, rtol=1e-6)
    np.testing.assert_allclose(out["loss"], ce + coef * z, rtol=1e-6)

    def unchunked(h, k, t):
        logits = _logits(h, k)[kept]
        return layers.cross_entropy(logits, t[kept]) + coef * jnp.mean(
            jax.nn.logsumexp(logits, axis=-1) ** 2
        )

    _, expected = _value_and_grads(unchunked, hidden, kernel, targets)
    _, found = _value_and_grads(_chunked(chunk=3, z_loss=coef), hidden, kernel, targets)
    for f, e in zip(found, expected, strict=True):
        np.testing.assert_allclose(f, e, rtol=1e-5, atol=1e-7)


def test_accuracy_tokens_and_log_probabilities_count_the_valid_targets():
    hidden, kernel, targets = _inputs(jnp.float32)
    best = np.argmax(np.einsum("bld,dv->blv", hidden, kernel), -1)
    right = np.arange(B * L).reshape(B, L) % 4 == 0  # a quarter predicted right
    targets = np.where(right, best, (best + 1) % V)
    targets[:, -3:] = -1  # masked: out of the count, and of the accuracy's denominator
    out = jax.jit(lambda *a: lm_loss.token_loss(*a, chunk=5))(hidden, kernel, jnp.asarray(targets))
    valid = targets >= 0
    assert float(out["tokens"]) == valid.sum()
    np.testing.assert_allclose(out["accuracy"], right[valid].mean(), rtol=1e-6)
    # each target's log-probability (DPO's sums), 0 where masked: the float64 log-softmax's
    logits = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.maximum(targets, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(out["logps"], np.where(valid, picked - lse, 0), atol=1e-5)


@needs_devices(2)
def test_each_tokens_entropy_is_that_of_its_tempered_capped_distribution_split_or_whole():
    """GRPO's `entropy`: each position's entropy of softmax(cap(logits) / temperature), 0 where
    masked, from chunks that pad the length and from a tensor group holding half the vocabulary
    each (the group's sums), against float64."""
    from mptrain.parallel import tensor

    hidden, kernel, targets = _inputs(jnp.float32)
    targets, _ = _masked(targets)
    cap, temperature = 3.0, 0.7
    logits = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
    logits = cap * np.tanh(logits / cap) / temperature
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = np.where(np.asarray(targets) >= 0, -np.sum(p * np.log(p), -1), 0.0)
    kwargs = {"softcap": cap, "temperature": temperature, "entropy": True}
    whole = lambda h, k, t: lm_loss.token_loss(h, k, t, chunk=3, **kwargs)["entropy"]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (tensor.AXIS,))
    P = jax.sharding.PartitionSpec

    def local(h, k, t):  # every token, this device's half of the vocabulary; its half of rows
        split = tensor.split(2, as_bits=True)
        return lm_loss.token_loss(h, k, t, chunk=4, split=split, **kwargs)["entropy"]

    specs = (P(), P(None, tensor.AXIS), P())
    split = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(None, tensor.AXIS))
    for fn in (whole, split):
        np.testing.assert_allclose(jax.jit(fn)(hidden, kernel, targets), expected, atol=1e-5)


def _sizes(program: str) -> set[int]:
    """The element counts of the arrays an HLO program (compiled or StableHLO) names."""
    shapes = re.findall(r"\b(?:f64|f32|bf16|f16|s32|pred)\[([\d,]*)\]", program)
    shapes += [s.replace("x", ",") for s in re.findall(r"tensor<([\dx]+)x\w+>", program)]
    return {int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes}


@pytest.mark.parametrize(
    # a variant: make test keeps the automatic rule's chunks
    "chunk",
    [pytest.param(4, marks=pytest.mark.slow), None],
)
def test_no_array_of_the_batch_times_the_vocabulary_exists(chunk, monkeypatch):
    # chunk=None takes 4 positions here: the automatic rule, with a budget of 4 x V logits
    monkeypatch.setattr(lm_loss, "AUTO_CHUNK_ELEMENTS", 4 * V)
    monkeypatch.setattr(lm_loss, "AUTO_MIN_POSITIONS", 4)
    hidden, kernel, targets = _inputs(jnp.bfloat16)
    targets, _ = _masked(targets)

    def programs(loss_fn):
        step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))  # as a train step takes it
        lowered = step.lower(hidden, kernel, targets)
        return lowered.as_text(), lowered.compile().as_text()

    stablehlo, compiled = programs(_chunked(chunk, z_loss=1e-4))
    assert max(_sizes(stablehlo) | _sizes(compiled)) < B * L * V
    assert "gather" not in stablehlo and "scatter" not in stablehlo
    assert max(_sizes(programs(_reference)[1])) == B * L * V  # the check can see one


@needs_devices(4)
@pytest.mark.parametrize("chunk", [4, pytest.param(3, marks=pytest.mark.slow)])  # a variant
def test_a_batch_split_over_devices_is_not_gathered(chunk):
    """The chunks split the sequence axis, so each device keeps its rows: the step's only
    collectives are the all-reduces of the sums (loss, token count, the kernel's gradient)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    hidden, kernel, targets = _inputs(jnp.bfloat16, batch=4)
    hidden, targets = jax.device_put((hidden, targets), rows)
    step = jax.jit(jax.value_and_grad(_chunked(chunk), argnums=(0, 1)))
    program = step.lower(hidden, kernel, targets).compile().as_text()
    assert "all-reduce" in program
    assert not re.search(r"all-gather|all-to-all|collective-permute", program)


def test_the_kernel_gradient_is_summed_over_the_chunks_in_fp32():
    length, dtype = 64, jnp.bfloat16  # 64 chunks of one position
    hidden, kernel, targets = _inputs(dtype, length=length, seed=1)
    _, (_, expected) = _value_and_grads(_reference, hidden, kernel, targets)
    _, (_, found) = _value_and_grads(_chunked(chunk=1), hidden, kernel, targets)
    assert _ulps(found, expected, dtype).max() <= 1

    # The setup can tell: the same 64 partial sums, added in a bf16 running sum, land far off.
    d_logits = jax.grad(layers.cross_entropy)(_logits(hidden, kernel), targets).astype(dtype)
    h, g = np.asarray(hidden, np.float32), np.asarray(d_logits, np.float32)
    running = np.zeros((D, V), dtype)
    for i in range(length):
        running = (running.astype(np.float32) + h[:, i].T @ g[:, i]).astype(dtype)
    assert _ulps(running, expected, dtype).max() > 8


def test_an_fp32_kernel_is_used_in_the_compute_dtype_and_gets_an_fp32_gradient():
    hidden, kernel, targets = _inputs(jnp.bfloat16)
    kernel32 = kernel.astype(jnp.float32) * 1.001  # not representable in bf16
    expected, (_, d_kernel) = _value_and_grads(
        _reference, hidden, kernel32.astype(hidden.dtype), targets
    )
    found, (f_hidden, f_kernel) = _value_and_grads(_chunked(chunk=4), hidden, kernel32, targets)
    assert (f_hidden.dtype, f_kernel.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_allclose(found, expected, rtol=1e-6)
    assert _ulps(f_kernel, d_kernel, jnp.bfloat16).max() <= 0.5  # d_kernel is that, rounded
    assert np.any(f_kernel != f_kernel.astype(jnp.bfloat16).astype(jnp.float32))  # f_kernel isn't


def test_auto_chunk_keeps_a_chunk_within_2_to_the_24_logits_and_512_positions_within_2_to_the_26():
    assert lm_loss.auto_chunk(1024, 256) == 1024  # 2**18 logits: one chunk
    assert lm_loss.auto_chunk(2**14, 2**10) == 2**14  # exactly 2**24
    assert lm_loss.auto_chunk(2**15, 2**10) == 2**14
    # Llama 3: 2**24 / 128,256 = 130.8 -> 128 positions, raised to 512 (65.7 M logits): 16
    # chunks of 8192, each one read and write of the head's fp32 gradient carry, not 64
    assert lm_loss.auto_chunk(8192, 128_256) == 512
    assert lm_loss.auto_chunk(300, 128_256) == 300  # 512 is more than the sequence: one chunk
    assert lm_loss.auto_chunk(8192, 200_000) == 64  # 512 x 200,000 is over 2**26: 2**24's rule
    # ... unless the head's fp32 gradient carry (width x vocabulary) is larger: Gemma 3's
    assert lm_loss.auto_chunk(8192, 262_208, 3840) == 512
    assert lm_loss.auto_chunk(8192, 262_208, 256) == 32
    assert lm_loss.auto_chunk(3000, 10_000) == 1024
    assert lm_loss.auto_chunk(4, 2**25) == 1  # a vocabulary over the budget: one position


def test_settings_name_the_key_and_the_value():
    loss = lambda chunk, z: types.SimpleNamespace(chunk_tokens=chunk, z_loss=z)
    assert lm_loss.settings(loss(None, 0.0)) == (None, 0.0)
    assert lm_loss.settings(loss(128, 1e-4)) == (128, 1e-4)
    for chunk in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match=re.escape(f"loss.chunk_tokens={chunk!r}")):
            lm_loss.settings(loss(chunk, 0.0))
    for z in (-1e-4, float("nan"), float("inf"), "1e-4"):  # inf: every step non-finite
        with pytest.raises(ValueError, match=re.escape(f"loss.z_loss={z!r}")):
            lm_loss.settings(loss(None, z))
    with pytest.raises(ValueError, match="chunk=0"):
        lm_loss.token_loss(*_inputs(jnp.float32), chunk=0)


def _optax_mean(logits, targets):
    """The peer's cross-entropy (a log-softmax and a gather), averaged over every token given."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def test_cross_entropy_averages_over_the_valid_targets_only():
    logits = normal(0, (B, L, V), scale=3.0)
    targets, kept = _masked(integers(1, (B, L), V))
    loss, grad = jax.jit(jax.value_and_grad(layers.cross_entropy))(logits, targets)
    dropped = lambda x: _optax_mean(x[kept], targets[kept])  # never sees the masked tokens
    expected, expected_grad = jax.value_and_grad(dropped)(logits)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert not np.any(np.asarray(grad)[np.asarray(targets) < 0])


def test_cross_entropy_with_every_target_valid_is_the_plain_mean():
    logits = normal(0, (B, L, V), scale=3.0)
    targets = integers(1, (B, L), V)
    loss, grad = jax.jit(jax.value_and_grad(layers.cross_entropy))(logits, targets)
    expected, expected_grad = jax.value_and_grad(_optax_mean)(logits, targets)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-8)


def test_cross_entropy_of_a_batch_without_a_valid_target_is_0_with_zero_gradient():
    logits = normal(0, (B, L, V))
    targets = jnp.full((B, L), -1, jnp.int32)
    loss, grad = jax.jit(jax.value_and_grad(layers.cross_entropy))(logits, targets)
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0)
