"""A mixture's experts split over an `expert` mesh axis (issue 59): the layer's gradients and
whole runs against fsdp alone on fake CPU devices, a checkpoint resumed through kill -9, and a
layout that cannot work refused by name."""

import json
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers import (
    ROOT,
    assert_trees_bytes_equal,
    integers,
    kill_9_and_resume,
    load_config,
    needs_devices,
    plain_orbax_state,
)
from jax.sharding import Mesh, PartitionSpec
from parallel.context_test import _assert_same_run, _run

import mptrain
from mptrain.inspect import hlo
from mptrain.inspect import program as prog_lib
from mptrain.models import decoder as llama
from mptrain.parallel import axes, layout, sharding
from mptrain.recipe import precision

TINY = {
    "vocab_size": 64, "d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
    "d_ff": 48, "max_len": 64, "attention": "materialized", "num_experts": 8,
    "experts_per_token": 2, "expert_d_ff": 16, "router_aux_loss_coef": 0.01,
}  # fmt: skip
# The year's new layers in one program (make test-slow): DeepSeek-V3's latent attention,
# sigmoid routing with the fixed bias in 4 groups (a token's 2 from its best 2), the routed
# scale, a shared expert, the first layer dense; gpt-oss's sinks, biased router and experts and
# clamped SwiGLU
NEW_LAYERS = {
    **TINY, "num_layers": 3, "num_kv_heads": 4, "head_dim": 12, "kv_lora_rank": 8,
    "q_lora_rank": 16, "qk_rope_head_dim": 4, "v_head_dim": 8, "rope_interleave": True,
    "router_scoring": "sigmoid", "router_bias": True, "router_groups": 4,
    "router_groups_per_token": 2, "routed_scale": 2.5, "shared_expert_d_ff": 32,
    "dense_layers": (0,), "router_aux_loss_coef": 0.0, "attn_sinks": True,
    "router_logit_bias": True, "expert_bias": True, "swiglu_limit": 1.0,
}  # fmt: skip


@pytest.mark.parametrize(
    "settings", [TINY, pytest.param(NEW_LAYERS, marks=pytest.mark.slow, id="deepseek_gpt_oss")]
)
@needs_devices(8)
def test_the_experts_split_over_expert_4_give_one_devices_gradients(settings):
    """fp32, fsdp 2 x expert 4: each device holds 2 of the 8 experts of each layer (never
    gathered: the expert axis moves tokens), runs them on the tokens of its expert group, and
    the loss (with the load-balancing loss over the whole batch) and every gradient equal one
    device's. One compiled program. DeepSeek-V3's and gpt-oss's parts too (make test-slow):
    the shared expert held whole by each device of the expert group, as the attention is, the
    experts' biases split as the experts, the routing bias given no gradient at all."""
    model = llama.create_model(ml_collections.ConfigDict(settings), jnp.float32)
    tokens = integers(0, (8, 32), 64)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    declared, shapes = axes.declared_of(model.init, jax.random.key(0), tokens)
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 2, 4, 1, 1), layout.AXES)
    specs = sharding.specs(mesh, shapes, declared)
    layers = specs["stacked_layers"]
    experts = layers["moe"] if "moe" in layers else layers["1-3"]["moe"]
    assert experts["gate"] == PartitionSpec(None, "expert", "fsdp", None)
    assert experts["router"] == PartitionSpec(None, ("fsdp", "expert"), None)
    policy = precision.get_policy("fp32")

    def loss(p, probes, batch, rng):
        out = model.apply({"params": p}, batch["inputs"], targets=batch["targets"])
        return out["loss"], {"aux": out["moe/aux_loss"]}

    split = sharding.grad_fn(loss, policy, mesh, axes=declared)
    whole = sharding.grad_fn(loss, policy, None)

    @jax.jit
    def both(key, batch):  # the init too: one program
        params = axes.unboxed(model.init(key, batch["inputs"])["params"])
        where = sharding.state_shardings(mesh, shapes, declared)
        params = jax.lax.with_sharding_constraint(params, where)
        return split(params, None, batch, key), whole(params, None, batch, key)

    args = (jax.random.key(0), jax.device_put(batch, layout.batch_sharding(mesh)))
    (got, _, got_aux), (want, _, want_aux) = both(*args)
    np.testing.assert_allclose(got_aux["aux"], want_aux["aux"], rtol=1e-6)
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(want),
        strict=True,
    ):  # fmt: skip
        scale = float(np.max(np.abs(w)))
        if "router_bias" in str(path):  # chooses, never weighs: no gradient
            assert scale == 0 and not np.any(g), path
            continue
        assert scale > 0, path
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path[0]))
    program = prog_lib.Program(both.lower(*args).compile().as_text())
    assert hlo.by_axis(program, dict(mesh.shape)).get("expert", 0) > 0  # the tokens' exchange


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh.expert": 3}, "mesh.expert=3: does not divide model.num_experts=8"),
        ({"model.num_experts": None}, "mesh.expert=2: model.num_experts=None: no experts"),
    ],
)
@needs_devices(8)
def test_an_expert_layout_that_cannot_work_is_refused_by_name(overrides, message):
    config = load_config(
        "llama3", "moe_tiny", **{"mesh.data": 1, "mesh.expert": 2, "batch_size": 12, **overrides}
    )
    with pytest.raises(mptrain.config.ConfigError, match=message):
        mptrain.config.validate(config)


@pytest.mark.slow
@needs_devices(8)
def test_a_run_split_over_experts_trains_as_fsdp(tmp_path):
    """fp32, `moe_tiny` (8 experts a layer, top 2, the load-balancing loss at 0.01): fsdp 2 x
    expert 4 trains as fsdp 8, step by step: losses (the evaluation's too) and every param to
    1e-5 (measured 2026-11-29: 9e-8 and 2e-7)."""
    want = _run("moe_tiny", {"data": 1, "fsdp": 8}, tmp_path / "fsdp")
    got = _run("moe_tiny", {"data": 1, "fsdp": 2, "expert": 4}, tmp_path / "ep")
    _assert_same_run(got, want, 1e-5)
    rows = [json.loads(x) for x in (tmp_path / "ep" / "history.jsonl").read_text().splitlines()]
    shares = [r["moe/expert_share"] for r in rows if "moe/expert_share" in r]
    assert shares and all(len(s) == 8 and abs(sum(s) - 1) < 1e-4 for s in shares)
    assert all(r["moe/aux_loss"] >= 1.0 for r in rows if "moe/aux_loss" in r)  # E sum f P >= 1


def _command(workdir):
    return [
        sys.executable, "-m", "mptrain.main",
        f"--config={ROOT / 'configs' / 'llama3.py'}:moe_tiny", f"--workdir={workdir}",
        "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.expert=2",
        "--config.num_train_steps=8", "--config.checkpoint_every_steps=2",
        "--config.log_every_steps=2", "--config.eval_every_steps=8", "--config.eval_steps=2",
    ]  # fmt: skip


@pytest.mark.slow  # three runs: 8 steps, 4 and 4
def test_kill_9_then_resume_equals_the_uninterrupted_expert_run(tmp_path):
    """`moe_tiny` on fsdp 2 x expert 2 (4 fake devices), bf16-mixed as shipped: killed once its
    checkpoint 4 is down, run again, it ends with the uninterrupted run's bytes."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    kill_9_and_resume(_command, straight, crashed, 4, devices=4)
    want, got = plain_orbax_state(straight, 8), plain_orbax_state(crashed, 8)
    assert want["params"]["stacked_layers"]["moe"]["gate"].shape == (2, 8, 128, 128)
    assert_trees_bytes_equal(want, got)
