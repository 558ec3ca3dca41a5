"""The Llama model: its fp32 forward against a numpy reference written here, its fp32 islands
under bf16 compute, scan against unrolled layers, remat policies against none, and its config
errors."""

import math
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers import (
    LLAMA_SCALING,
    integers,
    llama_config,
    matmul_dtypes,
    needs_devices,
    normal,
    packed_and_alone,
)
from jax.sharding import PartitionSpec

from mptrain.models import decoder as llama
from mptrain.models import layers
from mptrain.models.decoder import rope
from mptrain.parallel import axes, layout, sharding
from mptrain.recipe import precision

SCALING = LLAMA_SCALING
_config = llama_config


def _tokens(batch=2, length=48, vocab=64, seed=1):
    return integers(seed, (batch, length), vocab)


def _init(model, tokens):
    return axes.unboxed(jax.jit(model.init)(jax.random.key(0), tokens)["params"])


def _loss(model, params, tokens, targets):
    """The model's loss: its own (chunked), or the cross-entropy of the logits it returns."""
    out = model.apply({"params": params}, tokens, targets=targets)
    return out["loss"] if isinstance(out, dict) else layers.cross_entropy(out, targets)


# ---- the reference, in numpy, float64 ------------------------------------------------------


def _ref_inv_freq(head_dim, theta, scaling):
    factor, low, high, original = scaling
    out = []
    for j in range(0, head_dim, 2):
        f = theta ** (-j / head_dim)
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            t = (original / wavelength - low) / (high - low)
            out.append((1 - t) * f / factor + t * f)
    return np.array(out)


def _ref_rope(x, inv_freq):
    """x [B, L, H, Dh]: dims j and j + Dh/2 as one complex number, turned by position * freq."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    angle = np.arange(x.shape[1])[:, None] * inv_freq[None, :]
    z = z * np.exp(1j * angle)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _ref_rms(x, scale, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def _ref_forward(p, tokens, c):
    f64 = lambda a: np.asarray(a, np.float64)
    inv_freq = _ref_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    x = f64(p["embed"]["embedding"])[np.asarray(tokens)]
    b, length, _ = x.shape
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        w = jax.tree.map(lambda a, i=i: f64(a[i]), p[sharding.STACKED])
        h = _ref_rms(x, w["attn_norm"]["scale"], c.norm_eps)
        q = (h @ w["attn"]["q"]["kernel"]).reshape(b, length, c.num_heads, c.head_dim)
        k = (h @ w["attn"]["k"]["kernel"]).reshape(b, length, c.num_kv_heads, c.head_dim)
        v = (h @ w["attn"]["v"]["kernel"]).reshape(b, length, c.num_kv_heads, c.head_dim)
        q, k = _ref_rope(q, inv_freq), _ref_rope(k, inv_freq)
        out = np.zeros_like(q)
        for head in range(c.num_heads):
            kv = head // group
            s = q[:, :, head] @ k[:, :, kv].transpose(0, 2, 1) / math.sqrt(c.head_dim)
            s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, :, head] = (s / s.sum(-1, keepdims=True)) @ v[:, :, kv]
        x = x + out.reshape(b, length, -1) @ w["attn"]["o"]["kernel"]
        h = _ref_rms(x, w["mlp_norm"]["scale"], c.norm_eps)
        gate = h @ w["mlp"]["gate"]["kernel"]
        up = h @ w["mlp"]["up"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["mlp"]["down"]["kernel"]
    x = _ref_rms(x, f64(p["final_norm"]["scale"]), c.norm_eps)
    head = f64(p["embed"]["embedding"]).T if c.tie_embeddings else f64(p["head"]["kernel"])
    return x @ head


@pytest.mark.parametrize(
    "overrides",
    [  # make test keeps the grouped heads; the other two are variants, in make test-slow
        {"num_kv_heads": 1},
        pytest.param({"num_kv_heads": 4}, marks=pytest.mark.slow),
        pytest.param({"num_kv_heads": 2, "tie_embeddings": True}, marks=pytest.mark.slow),
    ],
    ids=["gqa_4to1", "mha_1to1", "gqa_2to1_tied"],
)
def test_the_fp32_forward_equals_a_numpy_reference_past_the_original_context(overrides):
    c = _config(**overrides)
    model, tokens = llama.create_model(c), _tokens()
    params = _init(model, tokens)
    # Norm scales away from 1, so a scale applied wrongly shows.
    rng = np.random.default_rng(7)
    bump = lambda a: a * (1.0 + 0.5 * rng.uniform(size=a.shape).astype(np.float32))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: bump(a) if "norm" in jax.tree_util.keystr(path) else a, params
    )
    got = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    want = _ref_forward(params, tokens, c)
    assert got.dtype == np.float32 and got.shape == (2, 48, 64)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_rope_frequencies_follow_llama3s_rule_in_all_three_bands():
    got = rope.rope_frequencies(16, 10_000.0, SCALING)
    want = _ref_inv_freq(16, 10_000.0, SCALING)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    wavelength = 2 * np.pi / (10_000.0 ** (-np.arange(0, 16, 2) / 16))
    assert (wavelength < 8).any() and (wavelength > 32).any()  # kept and stretched bands
    assert ((wavelength > 8) & (wavelength < 32)).any()  # and the interpolated one
    unscaled = rope.rope_frequencies(16, 10_000.0)
    np.testing.assert_allclose(unscaled, 10_000.0 ** (-np.arange(0, 16, 2) / 16), rtol=1e-6)


def _unstacked(params, num_layers):
    rest = {k: v for k, v in params.items() if k != sharding.STACKED}
    for i in range(num_layers):
        rest[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], params[sharding.STACKED])
    return rest


# make test keeps scan and full remat against unrolled layers without remat on the dense-first
# expert folder's two stacks (experts_test), one program for both sides
@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "minimal", "minimal_with_context"])
def test_scan_and_remat_compute_what_unrolled_layers_without_remat_do(remat):
    tokens = _tokens()
    targets = jnp.roll(tokens, -1, axis=1)
    scanned = llama.create_model(_config(remat=remat))
    params = _init(scanned, tokens)
    unrolled = llama.create_model(_config(scan_layers=False))
    flat = _unstacked(params, 2)
    assert jax.tree.structure(flat) == jax.tree.structure(_init(unrolled, tokens))

    def loss(model, params):
        return _loss(model, params, tokens, targets)

    got, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(scanned, p)))(params)
    want, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(unrolled, p)))(flat)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        _unstacked(got_grads, 2),
        want_grads,
    )


def _saved(model, params, tokens):
    """What the backward pass keeps of the forward: the sizes of the residuals jax's vjp holds,
    traced only (`jax.eval_shape`), nothing run."""
    f = lambda p: _loss(model, p, tokens, tokens)
    residuals = jax.eval_shape(lambda p: jax.vjp(f, p)[1], params)
    return sum(x.size for x in jax.tree.leaves(residuals))


def test_remat_policies_keep_less_the_more_they_recompute():
    tokens = _tokens(length=32)
    sizes = {}
    for remat in ("none", "minimal_with_context", "minimal", "full"):
        model = llama.create_model(_config(remat=remat, num_layers=4))
        shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]  # not compiled
        sizes[remat] = _saved(model, shapes, tokens)
    assert sizes["none"] > sizes["minimal_with_context"] > sizes["minimal"] > sizes["full"]


def test_bf16_compute_runs_every_matmul_in_bf16_with_fp32_islands():
    model = llama.create_model(_config(), jnp.bfloat16)
    tokens = _tokens()
    params = _init(model, tokens)
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    text = jax.jit(lambda p: model.apply({"params": p}, tokens)).lower(cast).as_text()
    operands = {dtype for ops, _ in matmul_dtypes(text) for dtype in ops}
    assert operands == {"bf16"}, matmul_dtypes(text)
    for island in ("rsqrt", "cosine", "sine"):  # RMSNorm's and RoPE's, in fp32
        assert re.search(rf"stablehlo.{island}.*tensor<[^>]*f32>", text), island
    logits = jax.jit(model.apply)({"params": cast}, tokens)
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_heads": 3}, "model.num_kv_heads=3: must divide model.num_heads=4"),
        ({"head_dim": 15}, "model.head_dim=15: RoPE rotates pairs"),
        ({"head_dim": None, "d_model": 66}, "model.num_heads=4: does not divide model.d_model=66"),
        ({"rope_scaling": (8.0, 1.0)}, r"model.rope_scaling=\(8.0, 1.0\): None, Llama 3.s"),
        ({"rope_scaling": (8.0, 4.0, 1.0, 8192)}, r"model.rope_scaling\[2\] \(high_freq_factor\)"),
        ({"remat": "most"}, "model.remat='most'"),
        ({"scan_layers": "yes"}, "model.scan_layers='yes': must be True or False"),
        ({"rope_theta": 0.0}, "model.rope_theta=0.0"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        llama.create_model(_config(**overrides))


def _grads(model, policy, mesh, params, batch, declared=None):
    def loss(p, probes, batch, rng):
        return _loss(model, p, batch["inputs"], batch["targets"]), {}

    fn = jax.jit(sharding.grad_fn(loss, policy, mesh, axes=declared))
    if mesh is not None:
        params = jax.device_put(params, sharding.state_shardings(mesh, params, declared))
        batch = jax.device_put(batch, layout.batch_sharding(mesh))
    args = (params, None, batch, jax.random.key(0))
    return fn(*args)[0], fn.lower(*args).compile().as_text()


@pytest.mark.slow  # make test-plan reads the same per-layer gathers in the 8B's H100 program
@needs_devices(4)
def test_fsdp_gathers_the_stack_one_layer_at_a_time_inside_the_loop():
    model = llama.create_model(_config(num_kv_heads=2), jnp.bfloat16)
    tokens = _tokens(batch=4)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    params = _init(model, tokens)
    declared, _ = axes.declared_of(model.init, jax.random.key(0), tokens)
    config = ml_collections.ConfigDict({"mesh": {"data": 1, "fsdp": 4}, "batch_size": 4})
    mesh = layout.create_mesh(config.mesh, config.batch_size, jax.devices()[:4])
    specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(mesh, params, declared))
    assert specs[sharding.STACKED]["attn"]["q"]["kernel"] == PartitionSpec(None, "fsdp", None)
    # The same gradients as on one device (fp32, so the sums agree to rounding) ...
    fp32 = llama.create_model(_config(num_kv_heads=2))
    want, _ = _grads(fp32, precision.get_policy("fp32"), None, params, batch)
    got, _ = _grads(fp32, precision.get_policy("fp32"), mesh, params, batch, declared)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), got, want)
    # ... and under bf16-mixed the layers' bf16 gathers and fp32 reduce-scatters are in the
    # bodies of the loops, one layer's worth each, not in the program's entry.
    _, text = _grads(model, precision.get_policy("bf16-mixed"), mesh, params, batch, declared)
    bodies, entry = text.split("\nENTRY")  # the loops' computations come before the entry
    gathers = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", bodies)
    scatters = re.findall(r"= (\w+)\[([\d,]*)\]\S* reduce-scatter\(", bodies)
    # bf16 kernels as their bits (XLA:CPU has no bf16 collectives), the kept norm scales fp32
    assert sorted(dtype for dtype, _ in gathers) == ["f32"] * 2 + ["u16"] * 7, gathers
    assert [dtype for dtype, _ in scatters] == ["f32"] * 9, scatters
    layer = {",".join(map(str, a.shape[1:])) for a in jax.tree.leaves(params[sharding.STACKED])}
    assert {shape for _, shape in gathers} <= layer  # one layer's slice, not the stack
    # only the embedding, the final norm and the head are gathered outside the loop
    assert len(re.findall(r" all-gather\(", entry)) <= 3


def test_a_packed_row_gives_each_example_its_own_logits_and_gradients():
    """Three examples packed into one row (issue 44): with `positions` from 0 in each and
    their `segment_ids`, each example's logits are the ones it gets alone, at positions past
    the first example too, with grouped queries (4 over 1) and Llama 3's RoPE scaling
    (SCALING), in fp32; and so are the gradients of a loss summed over them. One compiled
    program for both (make test counts its compiles)."""
    model, n = llama.create_model(_config()), 16
    tokens = _tokens(batch=1, length=3 * n)
    params = _init(model, _tokens())  # the other tests' params: their init's program
    positions = jnp.asarray([np.tile(np.arange(n), 3)])
    weights = normal(5, (1, 3 * n, 64))
    (got, got_grads), (want, want_grads) = packed_and_alone(model, params, tokens, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # RoPE's scores depend on positions' differences only, so the logits above hold with the
    # row's own positions too: `positions` are checked where they are read, each row its own
    x = normal(6, (2, 3 * n, 2, 16))
    rows = jnp.concatenate([positions, positions[:, ::-1]])
    inv_freq = rope.rope_frequencies(16, 10_000.0, SCALING)
    rotated = rope.apply_rope(x, rows, inv_freq)
    for b in range(2):
        np.testing.assert_array_equal(
            rotated[b], rope.apply_rope(x[b : b + 1], rows[b], inv_freq)[0]
        )
    assert not np.allclose(rotated, rope.apply_rope(x, jnp.arange(3 * n), inv_freq))
