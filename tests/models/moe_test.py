"""The mixture-of-experts MLP (`decoder.moe`) against transformers' own blocks and loss
(`tests/models/moe_fixture.npz`, made by `tests/models/make_moe_fixture.py`), and why its router is
fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, normal, run_cli

from mptrain.models import attention
from mptrain.models.decoder import grouped, moe

REF = np.load(ROOT / "tests" / "models" / "moe_fixture.npz")


def _params(name: str) -> dict:
    """The fixture's torch `[out, in]` weights as the layer's `[in, out]` params."""
    t = lambda key: np.swapaxes(REF[f"{name}_{key}"], -1, -2)
    return {"router": REF[f"{name}_router"].T, "gate": t("gate"), "up": t("up"), "down": t("down")}


def _dense(params, x, top_k):
    """The block computed another way: every expert on every token, each token's output the
    sum over the experts of its routing weight (0 off its top k) times the expert's."""
    tokens = x.reshape(-1, x.shape[-1])
    _, weights, picked = moe.route(tokens, params["router"], top_k, True)
    full = (
        jnp.zeros((tokens.shape[0], params["gate"].shape[0]))
        .at[jnp.arange(tokens.shape[0])[:, None], picked]
        .set(weights)
    )
    h = jax.nn.silu(jnp.einsum("td,edf->tef", tokens, params["gate"]))
    h = h * jnp.einsum("td,edf->tef", tokens, params["up"])
    y = jnp.einsum("tef,efd,te->td", h, params["down"], full)
    return y.reshape(x.shape)


def test_the_block_is_transformers_in_fp32_and_its_aux_loss_too():
    """Qwen3-MoE's block (8 experts, top 2, renormalised) and Mixtral's (4, top 2): fp32
    outputs within 1e-5 of transformers'; the load-balancing loss of two layers' router logits
    (each layer's `router_stats` summed) equal to `load_balancing_loss_func`'s to 1e-6. The
    gradients of the grouped matmuls (the sort, `ragged_dot`'s transposes, the unsort) are
    those of every expert on every token masked by the routing weights, to 1e-5, for the
    input, the router and each expert. The custom VJP that binds the Mosaic GPU kernels, with
    XLA's ops of the same signatures standing in, gives autodiff's gradients (a group of no
    rows among them); with half the experts another device's and kernels that leave the rows
    past their groups NaN, the gradients are those of XLA's ragged_dot, every one finite."""

    @jax.jit
    def run(qwen, mixtral, x_qwen, x_mixtral, aux_logits):
        out = []
        with jax.default_matmul_precision("highest"):
            for params, x, experts in ((qwen, x_qwen, 8), (mixtral, x_mixtral, 4)):
                layer = moe.MoE(experts, 2, 8, True, jnp.float32)
                out.append(layer.apply({"params": params}, x)[0])
            probe = normal(3, REF["qwen3_moe_x"].shape)  # the gradients of <y, probe>
            routed = lambda p, x: jnp.sum(moe.MoE(8, 2, 8, True, jnp.float32).apply(
                {"params": p}, x)[0] * probe)  # fmt: skip
            dense = lambda p, x: jnp.sum(_dense(p, x, 2) * probe)
            grads = [jax.grad(f, argnums=(0, 1))(qwen, x_qwen) for f in (routed, dense)]
        # the Mosaic kernels' custom VJP, wired to XLA's ops of the same signatures
        x, w = normal(4, (40, 16)), normal(5, (3, 16, 8))
        sizes, probe = jnp.asarray([7, 0, 33], jnp.int32), normal(6, (40, 8))
        vjps = [
            jax.value_and_grad(
                lambda x, w, k=k: jnp.sum(grouped.matmul(x, w, sizes, k) * probe), (0, 1)
            )(x, w)
            for k in ("reference", "xla")
        ]
        # 4 of 8 experts here, another device's the rest, under kernels that leave the rows
        # past their groups NaN: no NaN reaches the output or any gradient
        nan_past = lambda f: (
            lambda a, b, s: jnp.where(
                (jnp.arange(a.shape[0]) < jnp.sum(s))[:, None], f(a, b, s), jnp.nan
            )
        )
        ref = grouped.REFERENCE
        nan_rows = grouped.Kernels(nan_past(ref.forward), nan_past(ref.input_grad), ref.weight_grad)
        half = {k: v[:4] for k, v in qwen.items() if k != "router"}
        tokens, probe = x_qwen[0], normal(7, (12, 16))
        _, weights, experts = moe.route(tokens, qwen["router"], 2, True)
        mlp = lambda t, p, k: moe.experts_mlp(t, experts, weights, p["gate"], p["up"], p["down"], k)
        split = [
            jax.grad(lambda t, p, k=k: jnp.sum(mlp(t, p, (k, 0)) * probe), (0, 1))(tokens, half)
            for k in (nan_rows, "xla")
        ]
        picked = [jax.lax.top_k(logits, 2)[1] for logits in aux_logits]  # softmax keeps order
        stats = sum(moe.router_stats(lg, p, None) for lg, p in zip(aux_logits, picked, strict=True))
        return (
            *out,
            moe.aux_loss(stats, aux_logits.shape[0] * aux_logits.shape[1])[0],
            grads,
            vjps,
            split,
        )

    y_qwen, y_mixtral, aux, (found, want), (custom, autodiff), (poisoned, clean) = run(
        _params("qwen3_moe"), _params("mixtral"), REF["qwen3_moe_x"], REF["mixtral_x"],
        REF["aux_logits"],
    )  # fmt: skip
    for name, y in (("qwen3_moe", y_qwen), ("mixtral", y_mixtral)):
        want_y = REF[f"{name}_y"]
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(aux, REF["aux_loss"], rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(custom), jax.tree.leaves(autodiff), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for got, expected in zip(jax.tree.leaves(poisoned), jax.tree.leaves(clean), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    for got, expected in zip(jax.tree.leaves(found), jax.tree.leaves(want), strict=True):
        scale = np.abs(expected).max()
        assert scale > 0
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)


def test_a_bf16_router_sends_near_tied_tokens_to_other_experts():
    """256 tokens, 16 experts, top 2: expert 0 first for every token (5 logits ahead), experts
    1 and 2 tied for second but for about 1e-2 of a logit, either way (a bf16 logit near 5 is
    a multiple of 1/32). The fp32 router picks every token's float64 top 2; the bf16 router
    (its matmul in bf16, as a bf16 model's `F.linear` runs it) sends some to another pair
    (20 of the 256 at 2026-11-29; the test wants 10 or more)."""
    tokens, width, experts = 256, 64, 16
    x = np.array(normal(0, (tokens, width)))
    x[:, 0] = 1.0  # a constant feature: the experts' offsets
    kernel = 0.5 * np.array(normal(1, (width, experts)), np.float64) / np.sqrt(width)
    kernel[:, 2] = kernel[:, 1] + 1e-2 * np.asarray(normal(2, (width,))) / np.sqrt(width)
    kernel[0, :3] = 10.0, 5.0, 5.0
    kernel = kernel.astype(np.float32)
    exact = x.astype(np.float64) @ kernel.astype(np.float64)
    want = np.sort(np.argsort(-exact, axis=-1, kind="stable")[:, :2], axis=-1)
    assert np.all(want[:, 0] == 0) and np.all(want[:, 1] > 0)
    pick = jax.jit(moe.route, static_argnums=(2, 3, 4))
    picked = {}
    for fp32 in (True, False):
        _, _, chosen = pick(
            jnp.asarray(x, jnp.float32 if fp32 else jnp.bfloat16), kernel, 2, True, fp32
        )
        picked[fp32] = np.sort(np.asarray(chosen), axis=-1)
    np.testing.assert_array_equal(picked[True], want)
    flipped = int(np.sum(np.any(picked[False] != want, axis=-1)))
    print(f"bf16 router: {flipped} of {tokens} tokens sent to another pair of experts")
    assert flipped >= 10, flipped


HOPPER, AMPERE = attention.Backend("gpu", (9, 0), True, 132), attention.Backend("gpu", (8, 0))
WIDE = {"model.d_model": 2048, "model.expert_d_ff": 768}  # Qwen3-30B-A3B's


def test_auto_takes_the_mosaic_kernel_only_where_it_runs():
    """Sweep 2026-12-06, P08 and P17: the Mosaic kernels' blocks need widths that are multiples
    of 128; "auto" takes XLA's grouped matmul elsewhere (a folder of width 48 on an H100 once
    stopped in the kernel with a traceback)."""
    assert grouped.kernel_for("auto", HOPPER, jnp.bfloat16, WIDE) == "mosaic_gpu"
    narrow = {"model.d_model": 48, "model.expert_d_ff": 16}
    assert grouped.kernel_for("auto", HOPPER, jnp.bfloat16, narrow) == "xla"
    assert grouped.kernel_for("auto", HOPPER, jnp.float32, WIDE) == "xla"
    assert grouped.kernel_for("auto", AMPERE, jnp.bfloat16, WIDE) == "xla"
    assert grouped.kernel_for("auto", attention.Backend("cpu"), jnp.bfloat16, WIDE) == "xla"
    assert grouped.kernel_for("xla", HOPPER, jnp.bfloat16, narrow) == "xla"
    gpt_oss = {"model.d_model": 2880, "model.expert_d_ff": 2880}  # padded to 2,944: 2.2%
    assert grouped.kernel_for("auto", HOPPER, jnp.bfloat16, gpt_oss) == "mosaic_gpu"


def test_widths_off_the_kernels_multiple_are_padded_with_zeros_and_give_the_same_numbers():
    """gpt-oss's 2,880 (here 130 and 200): the stand-in kernels on zero-padded operands give
    XLA's grouped matmul and its gradients (the padding's gradients dropped)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(40, 130)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 130, 200)), jnp.float32)
    sizes = jnp.asarray([10, 20, 6], jnp.int32)  # 4 rows past the groups
    ref = lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    padded = lambda x, w: grouped.matmul(x, w, sizes, "reference")
    np.testing.assert_allclose(padded(x, w)[:36], ref(x, w)[:36], rtol=1e-5, atol=1e-4)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w)[:36] ** 2)
    for got, want in zip(jax.grad(loss(padded), (0, 1))(x, w), jax.grad(loss(ref), (0, 1))(x, w),
                         strict=True):  # fmt: skip
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "backend, dtype, widths, says",
    [
        (attention.Backend("cpu"), jnp.bfloat16, WIDE, "this step runs on cpu"),
        (AMPERE, jnp.bfloat16, WIDE, "a GPU of compute capability 8.0"),
        (HOPPER, jnp.float32, WIDE, "the compute dtype is float32"),
        (HOPPER, jnp.bfloat16, {"model.d_model": 48, "model.expert_d_ff": 768}, "model.d_model=48"),
    ],
    ids=["cpu", "ampere", "fp32", "width"],
)
def test_the_mosaic_kernel_where_it_cannot_run_is_refused_naming_why(backend, dtype, widths, says):
    with pytest.raises(ValueError, match="model.expert_matmul='mosaic_gpu'") as info:
        grouped.kernel_for("mosaic_gpu", backend, dtype, widths)
    assert says in str(info.value) and "'xla' runs anywhere" in str(info.value)


def test_the_mosaic_kernel_on_a_cpu_is_one_line_before_anything_is_written(tmp_path, capsys):
    """Sweep 2026-12-06, E13: the run once made its workdir, then died in 1,961 lines."""
    config = f"--config={ROOT / 'configs' / 'llama3.py'}:moe_tiny"
    code, err = run_cli(
        tmp_path / "run", "--config.model.expert_matmul=mosaic_gpu", capsys=capsys, config=config
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model.expert_matmul='mosaic_gpu'" in err and "this step runs on cpu" in err
    assert not (tmp_path / "run").exists()
