"""Attention: cuDNN's fused kernel where it can run, the materialised fp32 island elsewhere;
which one a model picks, and that both compute the same thing."""

import logging
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import (
    A100,
    BACKEND_NAMES,
    CPU,
    H100,
    H100_WITHOUT_CUDNN,
    TPU,
    V100,
    cudnn_as_xla,
    matmul_dtypes,
    pretend_gpu,
    run_cli,
)
from transformer_lm_test import NUM_LAYERS, NUM_MATMULS, _apply, _model, _to_bf16, _tokens

from mptrain.models import attention, transformer_lm


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


def _qkv(shape, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys]


# The test model's heads ([B, L, H, D] = 2 x 16 x 4 x 8) and GPT-2 small's (12 heads of 64).
@pytest.mark.parametrize("shape", [(2, 16, 4, 8), (2, 64, 12, 64)])
def test_the_cudnn_call_computes_what_the_materialized_path_does(monkeypatch, shape):
    asked = cudnn_as_xla(monkeypatch)
    q, k, v = _qkv(shape)
    weights = jax.random.normal(jax.random.key(9), shape)

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
        assert got.dtype == jnp.bfloat16
        got, expected = got.astype(jnp.float32), expected.astype(jnp.float32)
        np.testing.assert_allclose(got, expected, atol=0.02 * float(jnp.abs(expected).max()))


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


@pytest.mark.parametrize(
    ("dtype", "forward", "gradient"), [(jnp.bfloat16, 2e-2, 6e-2), (jnp.float32, 2e-5, 1e-4)]
)
def test_the_tpu_flash_kernel_matches_the_materialized_path_in_interpret_mode(
    dtype, forward, gradient
):
    """The Pallas TPU kernel, run on this CPU by Pallas's TPU interpret mode, against the
    materialised island: outputs and q, k, v gradients, causal, in bf16 and fp32 (the gaps are
    a few units in the last place of bf16; fp32's are summation order)."""
    from jax.experimental.pallas import tpu as pltpu

    shape = (2, 256, 2, 64)  # [B, L, H, D]: two tiles of 128 along the sequence
    q, k, v = (
        jax.random.normal(key, shape, dtype) for key in jax.random.split(jax.random.key(3), 3)
    )
    weights = jax.random.normal(jax.random.key(7), shape, jnp.float32)

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
        scale = jnp.abs(want.astype(jnp.float32)).max()
        gap = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()
        assert gap < gradient * scale, (gap, scale)
    # causal: the first query sees the first key only, so later keys change nothing there
    later = k.at[:, 1:].set(0)
    with pltpu.force_tpu_interpret_mode():
        changed = attention.causal_attention(q, later, v, "flash")
    assert (changed[:, 0] == flash[:, 0]).all()
