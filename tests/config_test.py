"""The config keys are part of the contract: they change only on purpose."""

import os
import re
import subprocess
import sys

import pytest
from helpers import load_config, needs_devices

from mptrain import config as config_lib
from mptrain import optim, runtime
from mptrain.parallel import layout
from mptrain.recipe import train_state

KEYS = {
    "seed", "precision", "keep_fp32", "matmul_precision", "trainer", "num_train_steps",
    "batch_size", "log_every_steps", "eval_every_steps", "eval_steps", "checkpoint_every_steps",
    "max_checkpoints_to_keep", "checkpoint_async",
    "max_consecutive_skips", "param_rounding", "deterministic", "steps_per_call", "data.prefetch",
    "loss_scale.kind", "loss_scale.init_scale", "loss_scale.growth_interval",
    "loss_scale.growth_factor", "loss_scale.backoff_factor", "loss_scale.min_scale",
    "loss_scale.max_scale", "loss_scale.hysteresis",
    "optimizer.name", "optimizer.learning_rate", "optimizer.schedule", "optimizer.warmup_steps",
    "optimizer.weight_decay", "optimizer.b1", "optimizer.b2", "optimizer.eps",
    "optimizer.momentum", "optimizer.nesterov", "optimizer.grad_clip_norm", "optimizer.mu_dtype",
    "optimizer.nu_dtype", "optimizer.q8_block_size", "optimizer.q8_min_size",
    "optimizer.moment_rounding", "optimizer.accumulation_steps",
    "model.name", "data.name", "mesh.data", "mesh.fsdp", "mesh.expert", "mesh.context",
    "mesh.tensor",
    "distributed.coordinator_address", "distributed.num_processes", "distributed.process_id",
    "numerics.per_layer", "numerics.every_step", "fp8.scaling", "fp8.history", "fp8.margin",
    "fp8.bf16_layers", "fp8.min_size",
    "loss.chunk_tokens", "loss.z_loss", "init_from",
    "profile.start_step", "profile.num_steps", "log_to", "memory_fraction",
    "sample.prompts", "sample.chat", "sample.max_new_tokens",
    "lora.rank", "lora.alpha", "lora.dropout", "lora.targets", "lora.base_dtype",
    "dpo.beta", "dpo.loss", "dpo.label_smoothing", "dpo.sft_weight", "dpo.reference",
    "grpo.reward_funcs", "grpo.reward_weights", "grpo.num_generations", "grpo.loss_type",
    "grpo.beta", "grpo.epsilon", "grpo.epsilon_high", "grpo.num_iterations",
    "grpo.scale_rewards", "grpo.importance_sampling_level", "grpo.max_completion_length",
    "grpo.temperature", "grpo.top_p", "grpo.top_k", "grpo.soft_punish_cache",
    "grpo.sampling_correction", "grpo.sampling_clip_min", "grpo.sampling_clip_max",
    "grpo.old_logps",
}  # fmt: skip


# The keys beside `model.name` and `data.name` that each module of the zoo reads (its
# CONFIG_KEYS): a config file may set these and no others for the module it names.
MODULE_KEYS = {
    "model.transformer_lm": {
        "vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len", "dropout_rate",
        "attention", "remat",
    },
    "model.llama": {
        "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff",
        "max_len", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "attention",
        "scan_layers", "remat", "family", "attn_bias", "qk_norm", "sliding_window",
        "layer_types", "rope_local_theta", "norm_plus_one", "post_norms", "query_pre_attn_scalar",
        "attn_softcap", "final_softcap", "mlp_act", "embed_scale", "pre_norms", "qk_norm_width",
        "nope_layers", "token_ids", "partial_rotary_factor", "num_experts", "experts_per_token",
        "expert_d_ff", "norm_topk_prob", "dense_layers", "router_aux_loss_coef", "router_fp32",
        "expert_matmul", "shared_expert_d_ff", "shared_expert_gate", "kv_lora_rank",
        "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "rope_interleave", "attn_sinks",
        "router_scoring", "router_bias", "router_groups", "router_groups_per_token",
        "routed_scale", "router_logit_bias", "expert_bias", "swiglu_limit", "swiglu_alpha",
    },
    "model.mlp": {"hidden", "num_layers", "num_classes"},
    "model.cnn": {"features", "hidden", "num_classes"},
    "model.resnet": {"stage_sizes", "width", "num_classes", "bn_momentum"},
    "data.text": {
        "seq_len", "max_bytes", "eval_fraction", "files", "tokenizer", "eos_token", "cache_dir",
    },
    "data.tokens": {"files", "dtype", "seq_len", "eval_fraction"},
    "data.sft": {
        "files", "eval_files", "tokenizer", "chat_template", "seq_len", "eval_fraction",
        "train_on_prompt", "too_long", "packing", "max_segments", "messages_field",
        "prompt_field", "completion_field", "eos_token", "cache_dir", "template_max_chars",
        "template_max_seconds",
    },
    "data.dpo": {
        "files", "eval_files", "tokenizer", "chat_template", "seq_len", "eval_fraction", "too_long",
        "prompt_field", "chosen_field", "rejected_field", "eos_token", "cache_dir",
        "template_max_chars", "template_max_seconds",
    },
    "data.grpo": {
        "files", "eval_files", "tokenizer", "chat_template", "seq_len", "eval_fraction",
        "prompt_field", "eos_token", "cache_dir", "template_max_chars", "template_max_seconds",
    },
    "data.tfds": {"dataset", "train_split", "eval_split", "data_dir", "augment"},
    "data.synthetic_images": {"image_shape", "num_classes", "signal"},
}  # fmt: skip


def _flat(d, prefix=""):
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_base_config_keys_are_pinned():
    assert set(_flat(config_lib.to_dict(config_lib.base_config()))) == KEYS


def test_the_model_and_data_modules_keys_are_pinned():
    from mptrain import data, models

    found = {f"model.{name}": set(m.CONFIG_KEYS) for name, m in models.modules().items()}
    found |= {f"data.{name}": set(m.CONFIG_KEYS) for name, m in data.modules().items()}
    assert found == MODULE_KEYS


@pytest.mark.parametrize("arg", ["sft_tiny", "8b_sft", "dpo_tiny"])
def test_a_zoo_config_of_a_data_module_takes_every_key_the_module_reads(arg):
    from mptrain import data

    config = load_config("llama3", arg)
    assert set(data.modules()[config.data.name].CONFIG_KEYS) <= set(config.data)


def test_bf16_layers_past_what_the_model_can_keep_in_bf16_are_refused():
    config = load_config("llama3", "tiny", precision="fp8-mixed", **{"fp8.bf16_layers": 1})
    config_lib.validate(config)  # tiny's 2 blocks: one at each end keeps both in bf16
    config.fp8.bf16_layers = 2
    with pytest.raises(config_lib.ConfigError, match=r"^config\.fp8\.bf16_layers=2: the model "):
        config_lib.validate(config)


def test_base_config_is_valid():
    config_lib.validate(config_lib.base_config())


@pytest.mark.default_mesh  # reads base_config's own source
def test_every_key_is_commented_in_the_source():
    import inspect

    lines = [line.strip() for line in inspect.getsource(config_lib.base_config).splitlines()]
    for key in KEYS:
        (i,) = [i for i, line in enumerate(lines) if line.startswith(f"c.{key} =")]
        assert "#" in lines[i] or lines[i - 1].startswith("#"), f"config.{key} has no comment"


@pytest.mark.parametrize(
    "key, value",
    [
        ("loss_scale.hysteresis", 0),
        ("max_consecutive_skips", 0),
        ("mesh.data", 0),
        ("param_rounding", "up"),
        ("matmul_precision", "tf32"),
    ],
)
def test_bad_values_name_the_key(key, value):
    config = config_lib.base_config()
    section, _, leaf = key.rpartition(".")
    (config[section] if section else config)[leaf] = value
    with pytest.raises(config_lib.ConfigError, match=key.replace(".", r"\.")):
        config_lib.validate(config)


def _one_rule(build):
    """The error that the object `build` makes raises for `config`, prefixed as validate does."""
    with pytest.raises(ValueError) as direct:
        build()
    return f"config.{direct.value}"


@pytest.mark.parametrize(
    "overrides, named, build",
    [
        ({"optimizer.eps": 0.0}, "optimizer.eps=0.0", "optimizer"),
        ({"optimizer.learning_rate": 0.0}, "optimizer.learning_rate=0.0", "optimizer"),
        pytest.param(
            {"mesh.data": 4, "batch_size": 6}, "batch_size=6", "mesh", marks=needs_devices(4)
        ),
    ],
)
def test_validate_reports_the_rule_of_the_object_it_builds(overrides, named, build):
    config = config_lib.base_config()
    for key, value in overrides.items():
        section, _, leaf = key.rpartition(".")
        (config[section] if section else config)[leaf] = value
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.validate(config)
    message = str(info.value)
    built = {  # the objects, each from its own settings
        "optimizer": lambda: optim.make_optimizer(config.optimizer, config.num_train_steps),
        "mesh": lambda: layout.mesh_shape(config.mesh, config.batch_size),
    }[build]
    assert message == _one_rule(built)  # one rule, in one place
    assert "\n" not in message and message.startswith(f"config.{named}: ")


def test_param_rounding_auto_is_stochastic_for_bf16_params_only():
    resolve = train_state.resolve_param_rounding
    assert config_lib.base_config().param_rounding == "auto"
    assert resolve("auto", "bf16-pure") == "stochastic"
    assert resolve("auto", "bf16-mixed") == "nearest"
    assert resolve("auto", "params=float16,compute=float16,output=float32") == "nearest"


@pytest.mark.parametrize("unset", [False, True], ids=["base", "none"])
def test_the_fp8_keys_default_to_fp8s_recipe(unset):
    from mptrain.recipe import fp8

    config = config_lib.base_config()
    config.precision = "fp8-mixed"
    if unset:  # a None key falls back to the recipe's default, as base_config's values are
        config.fp8.history = config.fp8.margin = config.fp8.scaling = None
    assert config_lib.policy_of(config).fp8 == fp8.Recipe()


@pytest.mark.parametrize(
    "values, named",
    [
        ({"num_processes": 2}, "distributed.coordinator_address=None"),
        ({"coordinator_address": "h0", "num_processes": 2, "process_id": 0}, "'host:port'"),
        ({"coordinator_address": "h0:1", "num_processes": 2, "process_id": 2}, "process_id=2"),
    ],
)
def test_bad_distributed_settings_name_the_key(values, named):
    config = config_lib.base_config()
    config.distributed.update(values)
    with pytest.raises(config_lib.ConfigError, match=re.escape(named)):
        config_lib.validate(config)


def test_deterministic_sets_xlas_flag_before_the_backend_starts():
    code = (
        "import os, jax; from mptrain import config, runtime; c = config.base_config(); "
        "c.deterministic = True; runtime.start_backend(c); print(jax.numpy.ones(2).sum()); "
        "print(os.environ['XLA_FLAGS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr  # XLA knows the flag on every backend
    assert out.stdout.split() == ["2.0", runtime.DETERMINISTIC_FLAG]


def test_deterministic_after_a_cpu_backend_started_changes_nothing():
    import jax

    jax.numpy.ones(1).block_until_ready()  # the backend is up: XLA_FLAGS is read already
    before = os.environ.get("XLA_FLAGS")
    config = config_lib.base_config()
    config.deterministic = True
    runtime.set_determinism(config)  # CPU programs are deterministic as they are
    assert os.environ.get("XLA_FLAGS") == before


def test_deterministic_warns_when_a_gpu_backend_started_first(monkeypatch, caplog):
    import jax

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(runtime, "_backends_started", lambda: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    runtime.set_determinism(config_lib.base_config())  # the default asks for determinism
    assert "may not repeat bit for bit" in caplog.text and "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    with pytest.raises(ValueError, match="deterministic=True contradicts XLA_FLAGS"):
        runtime.set_determinism(config_lib.base_config())
    config = config_lib.base_config()
    config.deterministic = False
    runtime.set_determinism(config)  # asked for speed: XLA_FLAGS is the user's own


_GIVE_FRACTION = """
import logging, os, sys
from absl import logging as absl_logging
import ml_collections
from mptrain import runtime
absl_logging.set_verbosity(absl_logging.INFO)
runtime.set_memory_fraction(ml_collections.ConfigDict({"memory_fraction": 0.85}))
import jax
jax.devices()
print(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
"""


@pytest.mark.parametrize("own", [None, "0.6"])
def test_memory_fraction_is_given_to_jax_before_it_starts_unless_the_user_set_one(own):
    """`config.memory_fraction` (issue 43): what the run takes of each GPU, handed to JAX as
    XLA_PYTHON_CLIENT_MEM_FRACTION before its backend starts; a variable of the user's wins."""
    env = {k: v for k, v in os.environ.items() if k != runtime.MEM_FRACTION}
    env |= {runtime.MEM_FRACTION: own} if own else {}
    done = subprocess.run(
        [sys.executable, "-c", _GIVE_FRACTION], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (own or "0.85")
    said = (
        "from the environment; config.memory_fraction=0.85 is not applied"
        if own
        else ("the run takes 0.85 of each GPU's memory (memory_fraction)")
    )
    assert said in done.stderr


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.2])
def test_a_memory_fraction_outside_0_to_1_is_refused_naming_the_key(bad):
    from helpers import tiny_config

    with pytest.raises(config_lib.ConfigError, match=rf"^config\.memory_fraction={bad!r}: "):
        config_lib.validate(tiny_config(memory_fraction=bad))
