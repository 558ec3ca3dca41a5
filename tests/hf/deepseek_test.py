"""DeepSeek-V3 (issue 73) from a folder transformers made itself (`tests/hf/make_fixture.py
--families --only=deepseek_v3`): three layers of multi-head latent attention (q through a rank
of 24, k and v from one latent of 16, heads of 12 + 8 rotated dimensions in interleaved pairs,
v of 10), YaRN (factor 4 over an original 16 positions) with mscale and mscale_all_dim apart;
the first layer dense, then 8 experts of 16 in 4 groups, a token's 2 from its 2 best groups,
sigmoid scores with a random correction bias, renormalised and times 2.5, two shared experts.
Read by `mptrain.hf` into the one decoder: fp32 logits and greedy decoding against
transformers', each switch shown to matter, bf16-mixed in the band before a near-tie, the
folder written back; the correction bias chooses but does not weigh, and is never trained."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from hf.hf_test import BF16_BOUND, _decodes_as_generate, _error, _fine_tune, _reference
from hf.hf_test import _logits as logits_of

from mptrain import hf
from mptrain.models import decoder as llama
from mptrain.models.decoder import moe
from mptrain.parallel import axes
from mptrain.recipe import train_state

FOLDER = Path(__file__).parent / "families" / "deepseek_v3"
SLOW = pytest.mark.slow
# what the folder is read as
READ = {
    "family": "deepseek_v3",
    "head_dim": 20,
    "num_kv_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "rope_interleave": True,
    "num_experts": 8,
    "experts_per_token": 2,
    "expert_d_ff": 16,
    "shared_expert_d_ff": 32,
    "shared_expert_gate": False,
    "dense_layers": (0,),
    "router_scoring": "sigmoid",
    "router_bias": True,
    "router_groups": 4,
    "router_groups_per_token": 2,
    "routed_scale": 2.5,
    "router_aux_loss_coef": 0.0,
}


def _mscale(m: float) -> float:
    return 0.1 * m * np.log(4.0) + 1


@SLOW  # make test reads and writes the folder (test_the_folder_written_back_reads_as_read)
def test_deepseek_v3s_fp32_logits_are_transformers_and_each_switch_shows():
    """fp32 within 1e-5 of transformers; each switch left out (the interleaved RoPE, the
    scores' mscale, YaRN, the routing bias, the groups, the routed scale, the shared experts)
    moves the logits by more than 5% of the largest."""
    ids, want = _reference(FOLDER)
    config, params = hf.load(FOLDER)
    assert {k: config[k] for k in READ} == READ
    assert config["rope_scaling"][:2] == ("yarn", 4.0)
    np.testing.assert_allclose(config["rope_scaling"][5], _mscale(1.0) / _mscale(0.707))
    np.testing.assert_allclose(config["query_pre_attn_scalar"], 20 / _mscale(0.707) ** 4)
    assert _error(logits_of(config, params, ids), want) < 1e-5
    layers = params["stacked_layers"]
    expert = next(k for k in layers if "moe" in layers[k])
    unbiased = jax.tree.map(lambda x: x, params)
    unbiased["stacked_layers"][expert]["moe"]["router_bias"] *= 0
    unshared = jax.tree.map(lambda x: x, params)
    for k in ("shared_gate", "shared_up", "shared_down"):
        del unshared["stacked_layers"][expert]["moe"][k]
    switches = [
        ({"rope_interleave": False}, params),
        ({"query_pre_attn_scalar": None}, params),
        ({"rope_scaling": None, "query_pre_attn_scalar": None}, params),
        ({}, unbiased),
        ({"router_groups": 1, "router_groups_per_token": 1}, params),
        ({"routed_scale": 1.0}, params),
        ({"shared_expert_d_ff": None}, unshared),
    ]
    for overrides, p in switches:
        assert _error(logits_of(config, p, ids, **overrides), want) > 0.05, overrides


@SLOW
def test_deepseek_v3s_greedy_decoding_is_transformers_generate(tmp_path):
    """`mptrain.generate`'s decoder (its KV cache holds each head's k and v, v padded to the
    q/k head size), fp32, three prompts batched, 32 new tokens each."""
    _decodes_as_generate(FOLDER, tmp_path)


@SLOW
def test_deepseek_v3s_bf16_mixed_logits_stay_in_the_band_on_the_fp32_routes(monkeypatch):
    """bf16-mixed with each token sent to the experts its fp32 run chose (their weights still
    its own bf16 run's): within the Llama's band of transformers' fp32 logits. Routed freely,
    sigmoid scores plus this folder's random bias tie within 0.01 at a row's third position
    already, and bf16's rounding of the hidden state sends such a token elsewhere:
    transformers' own bf16 logits part from its fp32 ones by 0.60 of the largest here. The
    routes are the fixture's; what is held to the band is everything else in 16 bits."""
    config, params = hf.load(FOLDER, scan_layers=False)
    ids, want = _reference(FOLDER)
    picks, route = [], moe.route

    def recording(*args):
        out = route(*args)
        picks.append(np.asarray(out[2]))
        return out

    def replaying(tokens, kernel, top_k, normalise, fp32, routing, bias, logit_bias=None):
        logits, _, _ = route(tokens, kernel, top_k, normalise, fp32, routing, bias)
        experts = jnp.asarray(picks[len(replayed)])
        replayed.append(experts)
        weights = jnp.take_along_axis(jax.nn.sigmoid(logits), experts, axis=-1)
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * routing.scale
        return logits, weights, experts

    section = {**config, "attention": "materialized", "scan_layers": False}
    model = llama.create_model(ml_collections.ConfigDict(section), jnp.float32)
    replayed = []
    with monkeypatch.context() as patch:
        patch.setattr(moe, "route", recording)
        model.apply({"params": params}, ids)  # not jitted: each layer's picks read
        patch.setattr(moe, "route", replaying)
        got = logits_of({**config, "scan_layers": False}, params, ids, jnp.bfloat16)
    assert len(replayed) == len(picks) == 2
    error = _error(got, want)
    print(f"deepseek_v3: bf16-mixed on the fp32 routes {error:.4f}")
    assert error < BF16_BOUND


def test_the_routing_bias_chooses_the_experts_but_does_not_weigh_them():
    """DeepSeek-V3's aux-loss-free balancing: the correction bias changes which experts a
    token goes to, and the chosen experts' weights are their unbiased sigmoid scores
    (renormalised, times the routed scale) whatever the bias; no gradient reaches it."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(16, 8)) / 4, jnp.float32)
    routing = moe.Routing("sigmoid", True, groups=4, group_top=2, scale=2.5)
    route = lambda bias: moe.route(tokens, kernel, 2, True, True, routing, bias)
    zero, biased = jnp.zeros(8), jnp.asarray(rng.normal(size=8) * 0.3, jnp.float32)
    (logits, w0, e0), (_, w1, e1) = route(zero), route(biased)
    assert np.mean(np.any(np.sort(e0) != np.sort(e1), axis=-1)) > 0.3  # other experts chosen
    scores = jax.nn.sigmoid(logits)
    for weights, experts in ((w0, e0), (w1, e1)):
        picked = jnp.take_along_axis(scores, experts, axis=-1)
        np.testing.assert_allclose(weights, 2.5 * picked / picked.sum(-1, keepdims=True), 1e-6)
    grad = jax.grad(lambda b: jnp.sum(route(b)[1] ** 2))(biased)
    assert not np.any(grad)
    # the groups: a token's experts come from its 2 best groups (of 2 experts each)
    group = np.asarray(e1) // 2
    assert np.all(np.abs(group[:, 0] - group[:, 1]) >= 0)  # same or another of the two
    choice = np.asarray(scores + biased).reshape(64, 4, 2)
    best = np.argsort(-np.sort(choice, -1)[..., -2:].sum(-1), axis=-1)[:, :2]
    assert all(set(g) <= set(b) for g, b in zip(group.tolist(), best.tolist(), strict=True))


def test_a_fixed_param_is_not_moved_by_the_optimizer():
    """A param declared `fixed` (the routing bias's role): its update is zero under AdamW with
    weight decay, where a gradient and the decay move every other param."""
    fixed = axes.Param(jnp.ones(3), (None,), fp32=True, fixed=True)
    params = {"w": axes.Param(jnp.ones(3), (None,)), "router_bias": fixed}
    state = train_state.TrainState.create(
        apply_fn=None, params=params, tx=optax.adamw(0.1, weight_decay=0.5), policy="fp32"
    )
    assert state.axes.fixed == (("router_bias",),)
    grads = {"w": jnp.ones(3), "router_bias": jnp.ones(3)}
    new = state.apply_gradients(grads=grads)
    np.testing.assert_array_equal(new.params["router_bias"], 1.0)
    assert np.all(np.asarray(new.params["w"]) < 0.95)


def test_the_folder_written_back_reads_as_it_was_read(tmp_path):
    """config.json's latent attention, routing and YaRN keys (the scores' mscale as
    mscale_all_dim), and every tensor by transformers' names, the routing bias among them."""
    import json

    config, params = hf.load(FOLDER)
    hf.save(tmp_path / "out", config, params, "float32")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((FOLDER / "config.json").read_text())
    for key in ("architectures", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "n_group",
                "topk_group", "routed_scaling_factor", "n_shared_experts", "head_dim",
                "first_k_dense_replace", "rope_interleave"):  # fmt: skip
        assert written[key] == source[key], key
    np.testing.assert_allclose(written["rope_scaling"]["mscale_all_dim"], 0.707, rtol=1e-6)
    again, read = hf.load(tmp_path / "out")
    assert again.keys() == config.keys()
    for key, value in config.items():
        if isinstance(value, float):
            np.testing.assert_allclose(again[key], value, rtol=1e-6, err_msg=key)
        else:
            assert again[key] == value or key == "rope_scaling", key
    assert jax.tree.all(jax.tree.map(np.array_equal, read, params))


def test_layers_past_the_last_are_left_unread_where_the_family_says_so(tmp_path, caplog):
    """DeepSeek-V3's multi-token prediction layers (`model.layers.N.*` past num_hidden_layers)
    load as transformers loads them, unread, with a log line naming them (its Family's
    `unread_layers`); the same tensor in a Llama folder has no place and is refused."""
    import logging
    import shutil

    from safetensors.numpy import load_file, save_file

    for name, source in (("deepseek", FOLDER), ("llama", FOLDER.parent.parent / "fixture")):
        folder = tmp_path / name
        shutil.copytree(source, folder)
        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        tensors = load_file(folder / "model.safetensors")
        tensors[f"model.layers.{layers}.eh_proj.weight"] = np.ones((4, 4), np.float32)
        save_file(tensors, str(folder / "model.safetensors"))
        if name == "llama":
            with pytest.raises(hf.errors.ConfigError, match=f"model.layers.{layers}.eh_proj"):
                hf.load(folder)
            continue
        with caplog.at_level(logging.WARNING):
            config, _ = hf.load(folder)
        assert config["num_layers"] == layers
        assert "1 tensors of layers past num_hidden_layers (DeepSeek's multi-token" in caplog.text


@SLOW
def test_configs_hf_fine_tunes_deepseek_v3_its_bias_fixed_and_exports_both_ways(tmp_path, capsys):
    """`configs/hf.py:DIR` on the folder, bf16-mixed, a few steps from its weights: every
    param moves but the routing bias, and the export is a DeepSeek-V3 folder again; then
    rank-4 adapters on the attention's projections (the latents' too): a PEFT adapter whose
    target modules are transformers' (transformers' and PEFT's reading of both:
    scripts/hf_export_check.py, scripts/lora_export_check.py)."""
    from mptrain import export
    from mptrain.hf import peft

    _fine_tune(FOLDER, tmp_path / "run", capsys)
    export.export(tmp_path / "run", tmp_path / "out", "float32", format="hf")
    model_config, params = hf.load(tmp_path / "out")
    assert model_config["family"] == "deepseek_v3"
    _, base = hf.load(FOLDER)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), params, base)
    expert = next(k for k in moved["stacked_layers"] if "moe" in moved["stacked_layers"][k])
    fixed = moved["stacked_layers"][expert]["moe"].pop("router_bias")
    assert not fixed and all(jax.tree.leaves(moved))
    lora = ["--config.lora.rank=4", "--config.lora.targets=attn/", "--config.precision=fp32"]
    _fine_tune(FOLDER, tmp_path / "lora", capsys, *lora)
    export.export(tmp_path / "lora", tmp_path / "adapter", "float32", format="peft")
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == [
        "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"
    ]  # fmt: skip
    assert (tmp_path / "adapter" / peft.WEIGHTS_FILE).exists()


def test_an_adapter_on_a_dense_mlp_of_a_mixture_is_not_exported_for_peft(tmp_path):
    """PEFT under transformers 5 renames a mixture's gate_proj, up_proj and down_proj targets
    to the experts' fused params, so an adapter on DeepSeek's dense first layer's MLP would
    load onto every layer's experts: the PEFT export says so in one line (the merged one
    is unaffected)."""
    from mptrain import errors
    from mptrain.hf import peft

    c = hf.read_settings(hf.read_config(FOLDER))
    adapters = {"stacked_layers": {"0-1": {"mlp": {"gate": {
        "lora_a": np.zeros((1, 48, 4), np.float32), "lora_b": np.zeros((1, 4, 64), np.float32)
    }}}}}  # fmt: skip
    with pytest.raises(errors.ConfigError, match=r"layers\.0\.mlp\.gate_proj: an adapter on a "):
        peft.save(tmp_path, adapters, {"rank": 4}, None, c)


def test_a_lora_runs_frozen_base_keeps_the_routing_bias_in_fp32():
    """The frozen base of an adapter run is stored in the compute dtype, but a param whose role
    is `fixed` stays in fp32: in bf16 the routing bias of ±0.3 keeps 8 bits, and its rounding
    alone would send tokens at a near-tie to other experts than the checkpoint's."""
    from types import SimpleNamespace

    from mptrain.models import lora as lora_lib
    from mptrain.recipe import precision
    from mptrain.train import adapters

    bias = ("stacked_layers", "moe", "router_bias")
    moe_params = {"router_bias": np.full((2, 8), 0.3, np.float32)}
    moe_params["router"] = np.full((2, 4, 8), 0.3, np.float32)
    params = {"stacked_layers": {"moe": moe_params}}
    table = axes.Axes(fixed=(bias,))
    model = SimpleNamespace(lora=lora_lib.Spec(4, 4.0))
    config = ml_collections.ConfigDict({"lora": {"rank": 4}})
    policy = precision.get_policy("bf16-mixed")
    frozen = adapters.split(model, policy, config, params, table)["frozen"]["stacked_layers"]["moe"]
    assert frozen["router_bias"].dtype == np.float32 and frozen["router"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(frozen["router_bias"], np.float32(0.3))
