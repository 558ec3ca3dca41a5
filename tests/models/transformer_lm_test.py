"""The byte-level transformer LM: shapes, causality, and its fp32 islands under bf16 compute."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers import integers, matmul_dtypes, normal

from mptrain.models import layers, transformer_lm
from mptrain.parallel import axes

NUM_LAYERS = 2
# Per block: qkv, scores, probs @ v, attention out, mlp in, mlp out; plus the one-hot
# embedding and the logits.
NUM_MATMULS = 6 * NUM_LAYERS + 2


def _model(dtype=jnp.float32, **kwargs):
    kwargs = {
        "d_model": 32,
        "num_layers": NUM_LAYERS,
        "num_heads": 4,
        "d_ff": 64,
        "max_len": 16,
        "dtype": dtype,
        # the tests that read the materialised program pin it: "auto" is cuDNN on a GPU
        "attention": "materialized",
        **kwargs,
    }
    return transformer_lm.TransformerLM(**kwargs)


def _tokens(batch=2, length=16, seed=0):
    return integers(seed, (batch, length), 256)


@pytest.fixture(scope="module")
def params():
    return axes.unboxed(jax.jit(_model().init)(jax.random.key(0), _tokens()))


def _apply(model, *args, **kwargs):
    return jax.jit(model.apply, static_argnames="train")(*args, **kwargs)


def _to_bf16(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


@pytest.fixture(scope="module")
def bf16_program(params):
    model = _model(jnp.bfloat16)
    return jax.jit(model.apply).lower(_to_bf16(params), _tokens()).as_text()


def _ops(program, op):
    """Result types of every ``stablehlo.<op>`` line, e.g. ``['tensor<2x4xf32>', ...]``."""
    return [line.rsplit("->", 1)[-1].rsplit(":", 1)[-1].strip()
            for line in program.splitlines() if f"stablehlo.{op} " in line]  # fmt: skip


def test_init_makes_fp32_params_and_fp32_logits(params):
    leaves = jax.tree.leaves(params)
    assert leaves and all(x.dtype == jnp.float32 for x in leaves)
    logits = _apply(_model(), params, _tokens())
    assert logits.shape == (2, 16, 256)
    assert logits.dtype == jnp.float32
    # Same params and inputs, bf16 compute: still fp32 logits, close to the fp32 ones.
    logits_bf16 = _apply(_model(jnp.bfloat16), _to_bf16(params), _tokens())
    assert logits_bf16.dtype == jnp.float32
    np.testing.assert_allclose(logits_bf16, logits, atol=0.1)


def test_every_matmul_has_bf16_operands_under_bf16_compute(bf16_program):
    dots = matmul_dtypes(bf16_program)
    assert len(dots) == NUM_MATMULS, dots
    for operands, _ in dots:
        assert operands == ("bf16", "bf16"), dots
    # The scores (into the softmax) and the logits accumulate and come out in fp32.
    results = [result for _, result in dots]
    assert results.count("f32") == NUM_LAYERS + 1, results
    assert results[-1] == "f32"


def test_fp32_islands_under_bf16_compute(bf16_program):
    # Softmax: every exp runs on fp32 scores.
    exps = _ops(bf16_program, "exponential")
    assert len(exps) == NUM_LAYERS
    assert all(t.endswith("xf32>") for t in exps), exps
    # LayerNorm statistics: mean and variance over features are fp32 reductions of [B, L, d]
    # tensors (two per LayerNorm: 2 per block plus the final one), and rsqrt is fp32.
    stats = [line for line in bf16_program.splitlines()
             if "stablehlo.reduce" in line and "stablehlo.add" in line
             and "(tensor<2x16x32x" in line]  # fmt: skip
    assert len(stats) == 2 * (2 * NUM_LAYERS + 1), stats
    assert all("(tensor<2x16x32xf32>" in line for line in stats), stats
    rsqrts = _ops(bf16_program, "rsqrt")
    assert len(rsqrts) == 2 * NUM_LAYERS + 1
    assert all(t.endswith("xf32>") for t in rsqrts), rsqrts
    # The program returns fp32 logits.
    main = next(line for line in bf16_program.splitlines() if "func.func public @main" in line)
    assert re.search(r"->\s*\(?tensor<2x16x256xf32>", main), main


def test_fp32_compute_stays_fp32(params):
    program = jax.jit(_model().apply).lower(params, _tokens()).as_text()
    dots = matmul_dtypes(program)
    assert len(dots) == NUM_MATMULS
    assert all(ops == ("f32", "f32") and out == "f32" for ops, out in dots), dots


def test_model_is_causal(params):
    model = _model()
    tokens = _tokens()
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    before, after = _apply(model, params, tokens), _apply(model, params, changed)
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.allclose(before[:, 10:], after[:, 10:])


def test_grads_through_bf16_compute_are_fp32_and_finite(params):
    model = _model(jnp.bfloat16)
    tokens = _tokens(length=17)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(p):
        return transformer_lm.lm_loss(model.apply(_to_bf16(p), inputs), targets)

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    assert loss.dtype == jnp.float32
    assert abs(float(loss) - np.log(256)) < 1.0  # near chance at init (random logits add a bit)
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.float32
        assert np.all(np.isfinite(g))
    assert any(np.any(g != 0) for g in jax.tree.leaves(grads))


def test_lm_loss_is_fp32_mean_cross_entropy():
    targets = jnp.array([[1, 2, 3]], jnp.int32)
    uniform = jnp.zeros((1, 3, 256), jnp.bfloat16)
    loss = transformer_lm.lm_loss(uniform, targets)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, np.log(256), rtol=1e-6)
    sure = jax.nn.one_hot(targets, 256) * 100.0
    assert float(transformer_lm.lm_loss(sure, targets)) < 1e-6
    np.testing.assert_allclose(transformer_lm.bits_per_byte(np.log(256)), 8.0)


def test_dropout_only_in_training(params):
    model = _model(dropout_rate=0.5)
    tokens = _tokens()
    eval_logits = _apply(model, params, tokens)
    np.testing.assert_allclose(eval_logits, _apply(_model(), params, tokens), rtol=1e-6)
    rngs = {"dropout": jax.random.key(1)}
    train_logits = _apply(model, params, tokens, train=True, rngs=rngs)
    assert not np.allclose(train_logits, eval_logits)


def test_create_model_from_config():
    config = ml_collections.ConfigDict(
        {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 48, "max_len": 8}
    )
    model = transformer_lm.create_model(config, jnp.bfloat16)
    assert (model.vocab_size, model.dropout_rate, model.dtype) == (256, 0.0, jnp.bfloat16)
    assert (model.d_model, model.num_layers, model.num_heads, model.d_ff) == (32, 1, 2, 48)
    _, params = axes.declared_of(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert params["block_0"]["mlp"]["fc_in"]["kernel"].shape == (32, 48)


def test_bad_shapes_are_rejected(params):
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        jax.eval_shape(_model().apply, params, _tokens(length=17))
    with pytest.raises(ValueError, match="integer"):
        jax.eval_shape(_model().apply, params, jnp.zeros((2, 16), jnp.float32))
    with pytest.raises(ValueError, match="num_heads=5"):
        jax.eval_shape(_model(num_heads=5).init, jax.random.key(0), _tokens())


class _Island(nn.Module):
    """LayerNorm island followed by a bias-free Dense, as inside every block."""

    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        h = layers.layer_norm_f32(x, self.dtype, "ln")
        return h, layers.run_in(self.dtype, transformer_lm._dense(8, "fc_in"), x)


def test_each_cast_guard_holds_on_its_own():
    # The two guards against an fp32 island promoting the next matmul are redundant inside the
    # model; each is checked alone here. fp32 input, bf16 compute:
    x = jnp.ones((2, 4), jnp.float32)
    module = _Island()
    variables = axes.unboxed(jax.jit(module.init)(jax.random.key(0), x))
    normed, _ = module.apply(variables, x)
    assert normed.dtype == jnp.bfloat16  # the LayerNorm island ends with a cast back
    cast = jax.tree.map(lambda p: p.astype(jnp.bfloat16), variables)  # as the policy casts
    ((operands, result),) = matmul_dtypes(jax.jit(module.apply).lower(cast, x).as_text())
    assert operands == ("bf16", "bf16") and result == "bf16"  # run_in casts the layer's input
    # A kernel the casting rule keeps in fp32 (keep_fp32) makes its own matmul fp32, not more:
    ((operands, result),) = matmul_dtypes(jax.jit(module.apply).lower(variables, x).as_text())
    assert operands == ("f32", "f32") and module.apply(variables, x)[1].dtype == jnp.bfloat16


def test_gradient_matmuls_are_bf16_too(params):
    model = _model(jnp.bfloat16)
    tokens = _tokens(length=17)

    def loss_fn(p):  # what the train step differentiates: fp32 params cast inside
        return transformer_lm.lm_loss(model.apply(_to_bf16(p), tokens[:, :-1]), tokens[:, 1:])

    program = jax.jit(jax.grad(loss_fn)).lower(params).as_text()
    dots = matmul_dtypes(program)
    # Every matmul has two gradient matmuls, except the one-hot embedding's: the one-hot
    # matrix is no param, so only the table's gradient (one_hot.T @ grad) is computed.
    assert len(dots) == 3 * NUM_MATMULS - 1, dots
    assert all(operands == ("bf16", "bf16") for operands, _ in dots), dots
    # Nothing is scattered (a GPU would add with atomics: slow in bf16, never deterministic);
    # read on the lowered program, since XLA:CPU's optimizer rewrites 16-bit scatters.
    assert "scatter" not in program


def test_the_position_tables_gradient_is_summed_over_the_batch_in_fp32(params):
    """The casting rule keeps `pos_embedding` fp32; its gradient, a sum over the batch of the
    16-bit activations' gradient, is then taken in fp32 (as the all-reduce after it is)."""
    model = _model(jnp.bfloat16)
    tokens = _tokens(length=17)

    def loss_fn(p):  # every param 16-bit but the position table, as the default rule has it
        cast = {k: v if k == "pos_embedding" else _to_bf16(v) for k, v in p.items()}
        return transformer_lm.lm_loss(model.apply({"params": cast}, tokens[:, :-1]), tokens[:, 1:])

    jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params["params"])
    shape = (16, 32)  # [length, d_model]: the batch summed away
    sums = [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "reduce_sum" and e.outvars[0].aval.shape == shape
    ]
    assert sums and all(e.invars[0].aval.dtype == jnp.float32 for e in sums), sums


@pytest.mark.parametrize("one_hot", [True, False])
def test_embed_is_an_exact_lookup(one_hot):
    table = normal(0, (300, 8))
    ids = integers(1, (2, 5), 300)
    rows = layers.embed(table, ids, jnp.bfloat16, one_hot=one_hot)
    assert rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(rows, table.astype(jnp.bfloat16)[ids])
    grad = jax.grad(lambda t: jnp.sum(layers.embed(t, ids, jnp.float32, one_hot) ** 2))(table)
    np.testing.assert_allclose(grad, jax.grad(lambda t: jnp.sum(t[ids] ** 2))(table), rtol=1e-6)


def test_embed_never_scatters_and_sums_a_large_tables_gradient_in_fp32(monkeypatch):
    def program(vocab, table_dtype):
        ids = jnp.zeros((2, 5), jnp.int32)
        loss = lambda t: jnp.sum(layers.embed(t, ids, jnp.bfloat16).astype(jnp.float32))
        table = jnp.zeros((vocab, 8), table_dtype)
        return jax.jit(jax.grad(loss)).lower(table).as_text()

    assert "scatter" not in program(layers.ONE_HOT_MAX_VOCAB, jnp.bfloat16)
    assert "scatter" not in program(layers.ONE_HOT_MAX_VOCAB + 1, jnp.float32)
    # Chunks of 3 tokens over 11 (the last one padded), ids repeated: the gradient is the
    # scatter-add's, summed in fp32, in the table's dtype.
    vocab = layers.ONE_HOT_MAX_VOCAB + 3
    monkeypatch.setattr(layers, "EMBED_GRAD_CHUNK_ELEMENTS", 3 * vocab)
    ids = jnp.array([0, 5, 5, vocab - 1, 5, 2, 7, 0, 5, 9, 9])
    table = normal(0, (vocab, 4))
    weights = normal(1, (ids.shape[0], 4))
    loss = lambda t, f: jnp.sum(f(t).astype(jnp.float32) * weights)
    got = jax.grad(loss)(table, lambda t: layers.embed(t, ids, jnp.bfloat16))
    want = jax.grad(loss)(table, lambda t: jnp.take(t, ids, axis=0).astype(jnp.bfloat16))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)
    forward = layers.embed(table, ids, jnp.bfloat16)
    np.testing.assert_array_equal(forward, table[ids].astype(jnp.bfloat16))


@pytest.mark.parametrize(
    "spec",
    [  # make test keeps the plain matmul; the other contractions are variants
        "ij,jk->ik",
        pytest.param("bqhd,bkhd->bhqk", marks=pytest.mark.slow),
        pytest.param("aby,yz->abz", marks=pytest.mark.slow),
    ],
)
def test_einsum_f32_out_gradients_match_autodiff(spec):
    sa, sb = spec.split("->")[0].split(",")
    sizes = dict(zip("ijkbqhdayz", (3, 4, 5, 2, 6, 2, 4, 3, 5, 7), strict=True))
    a = normal(1, [sizes[c] for c in sa])
    b = normal(2, [sizes[c] for c in sb])
    w = normal(3, np.einsum(spec, a, b).shape)

    def loss(fn, a, b):
        return jnp.sum(fn(spec, a, b) * w)

    ours = jax.jit(jax.grad(functools.partial(loss, layers.einsum_f32_out), (0, 1)))
    reference = jax.jit(jax.grad(functools.partial(loss, jnp.einsum), (0, 1)))
    for got, want in zip(ours(a, b), reference(a, b), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # bf16 operands: fp32 forward result, bf16 gradients close to the fp32 ones.
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    forward = functools.partial(layers.einsum_f32_out, spec)
    assert jax.eval_shape(forward, a16, b16).dtype == jnp.float32
    for got, want in zip(ours(a16, b16), reference(a, b), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=0.05, atol=0.1)


def test_einsum_f32_out_rejects_specs_it_cannot_differentiate():
    x, y = jnp.ones((3, 4)), jnp.ones((4, 5))
    with pytest.raises(ValueError, match="cannot differentiate 'ij,jk->i'"):
        jax.grad(lambda x: layers.einsum_f32_out("ij,jk->i", x, y).sum())(x)


@pytest.mark.slow  # a variant: experts_test keeps scan and full remat against unrolled layers
def test_remat_changes_what_is_kept_not_what_is_computed(params):
    tokens, targets = _tokens(), _tokens(seed=1)

    def run(model):
        def loss(p):
            logits = model.apply(p, tokens, train=True, rngs={"dropout": jax.random.key(0)})
            return layers.cross_entropy(logits, targets)

        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        residuals = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)  # traced, not run
        return value, grads, sum(x.size for x in jax.tree.leaves(residuals))

    want, want_grads, kept = run(_model(dropout_rate=0.1))
    for remat in ("full", "minimal"):  # every policy on the Llama: tests/models/llama_test.py
        got, grads, fewer = run(_model(dropout_rate=0.1, remat=remat))
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=remat)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, want_grads
        )
        assert fewer < kept, remat


def test_with_targets_the_model_chunks_its_loss_and_adds_the_z_loss(params):
    tokens, targets = _tokens(), _tokens(seed=1).at[0, :3].set(-1)  # 3 masked targets
    logits = _apply(_model(), params, tokens)
    want = layers.cross_entropy(logits, targets)
    # one chunk and no z-loss: the logits come back, the Trainer takes their cross-entropy
    assert _apply(_model(), params, tokens, targets=targets).shape == logits.shape
    out = _apply(_model(loss_chunk=4, z_loss=1e-3), params, tokens, targets=targets)
    lse = jax.nn.logsumexp(logits, axis=-1)
    z = jnp.sum(jnp.where(targets >= 0, lse**2, 0.0)) / jnp.sum(targets >= 0)
    np.testing.assert_allclose(out["cross_entropy"], want, rtol=1e-6)
    np.testing.assert_allclose(out["loss"], want + 1e-3 * z, rtol=1e-6)


@pytest.mark.slow  # the Llama's test of it runs in make test; this is the second model
def test_a_packed_row_gives_each_example_the_logits_it_gets_alone(params):
    """Three examples packed into one row (issue 44): the learned positions are looked up by
    each example's own `positions` (from 0), and attention keeps to its `segment_ids`."""
    model, n = _model(), 5
    tokens = _tokens(batch=1, length=3 * n)
    segment_ids = jnp.asarray([np.repeat(np.arange(1, 4), n)])
    positions = jnp.asarray([np.tile(np.arange(n), 3)])

    def both(p):
        packed = model.apply(p, tokens, positions=positions, segment_ids=segment_ids)
        return packed, model.apply(p, tokens.reshape(3, n)).reshape(packed.shape)

    packed, alone = jax.jit(both)(params)
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)
