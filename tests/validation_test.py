"""Every key is validated once, before the workdir is touched, with one line that names it.

Each bad setting below is one `python -m mptrain.main` on the tiny default: exit 2, one line
naming `config.<key>=<value>` and what would be valid, no traceback, no workdir. Then the
settings that cannot take effect (applied, rejected or warned about), and the default mesh.
"""

import logging
import re
import runpy
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXTURE, ROOT, TINY, load_config, run_cli, run_cli_process, tiny_config

import mptrain
from mptrain import config as config_lib
from mptrain import main as main_lib
from mptrain import unused
from mptrain.models import layers
from mptrain.parallel import layout
from mptrain.train import launch


def _one_line_exit_2(workdir, err, code, *named):
    """The contract of a bad config: exit 2, one line naming it, no traceback, no workdir."""
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in named:
        assert text in err, err
    assert not workdir.exists()


@pytest.mark.parametrize(
    "overrides, named",
    [
        # model and data keys, each built by its own module
        (
            ["--config.data.seq_len=64"],
            ["config.model.max_len=32: shorter than the input", "data.seq_len"],
        ),
        (["--config.model.num_heads=3"], ["config.model.num_heads=3: must divide", "d_model=32"]),
        (["--config.model.d_model=0"], ["config.model.d_model=0: must be an integer >= 1"]),
        (["--config.seed=-1"], ["config.seed=-1: must be an integer >= 0"]),
        (["--config.data.max_bytes=100"], ["config.data.max_bytes=100:", "at least 3251"]),
        (["--config.data.max_bytes=-5"], ["config.data.max_bytes=-5: must be an integer >= 1"]),
        (["--config.data.eval_fraction=1.5"], ["config.data.eval_fraction=1.5: must be > 0"]),
        (["--config.data.seq_len=0"], ["config.data.seq_len=0: must be an integer >= 1"]),
        (
            ["--config.model.name=trnsformer_lm"],
            ["config.model.name='trnsformer_lm'", "valid: cnn, llama, mlp, resnet, transformer_lm"],
        ),
        (
            ["--config.data.name=txt"],
            ["config.data.name='txt'", "valid: dpo, grpo, sft, synthetic_images, text, tfds"],
        ),
        # rejected rather than silently useless
        (
            [
                "--config.precision=fp16-mixed",
                "--config.loss_scale.init_scale=1e9",
                "--config.loss_scale.max_scale=1024.0",
            ],
            ["config.loss_scale.init_scale=1000000000.0: outside [min_scale, max_scale]"],
        ),
        # messages that now say what is wrong
        (
            ["--config.optimizer.accumulation_steps=20"],
            ["config.optimizer.accumulation_steps=20:", "num_train_steps=8"],
        ),
        (
            ["--config.optimizer.learnin_rate=5.0"],
            ["--config.optimizer.learnin_rate:", "did you mean 'optimizer.learning_rate'?"],
        ),
        (["--config.model.num_head=4"], ["did you mean 'model.num_heads'?"]),
        (["--config.optimizer.mu_dtype=q9"], ["config.optimizer.mu_dtype='q9'", "'q8'"]),
    ],
)
def test_a_bad_setting_exits_2_with_one_line_naming_it(overrides, named, tmp_path, capsys):
    code, err = run_cli(tmp_path / "run", *overrides, capsys=capsys)
    _one_line_exit_2(tmp_path / "run", err, code, *named)


def test_the_accumulation_error_blames_accumulation_not_warmup(tmp_path, capsys):
    code, err = run_cli(tmp_path / "run", "--config.optimizer.accumulation_steps=20", capsys=capsys)
    assert code == 2 and "warmup_steps" not in err


@pytest.mark.parametrize(
    "key, value", [("optimizer.learning_rate", -1.0), ("optimizer.grad_clip_norm", -1.0)]
)
def test_a_lower_bound_alone_has_no_dangling_and(key, value, tmp_path, capsys):
    code, err = run_cli(tmp_path / "run", f"--config.{key}={value}", capsys=capsys)
    assert code == 2 and err.strip().endswith(
        f"config.{key}={value}: must be " + ("> 0" if key.endswith("rate") else ">= 0")
    ), err


def test_a_misspelt_override_has_no_stray_quote(tmp_path, capsys):
    code, err = run_cli(tmp_path / "run", "--config.optimizer.learnin_rate=5.0", capsys=capsys)
    assert code == 2 and "learnin_rate'" not in err and 'instead of "' not in err


def test_an_fsdp_that_does_not_divide_the_devices_says_so(tmp_path, capsys):
    config = tiny_config(**{"mesh.data": -1, "mesh.fsdp": 3, "batch_size": 12})
    with pytest.raises(ValueError, match="mesh.fsdp=3: does not divide the 4 devices") as info:
        layout.mesh_shape(config.mesh, config.batch_size, num_devices=4)
    assert "more devices" not in str(info.value) and "1, 2, 4" in str(info.value)
    code, err = run_cli(
        tmp_path / "run", "--config.mesh.data=-1", "--config.mesh.fsdp=3", capsys=capsys
    )
    named = f"config.mesh.fsdp=3: does not divide the {jax.device_count()} devices"
    _one_line_exit_2(tmp_path / "run", err, code, named)


# ------------------------------------------------------------------------------- config files


BAD_FILES = {
    "returns_none": ("def get_config(arg=None):\n    return None\n", "returned None"),
    "returns_a_list": ("def get_config(arg=None):\n    return [1]\n", "returned a list"),
    "returns_a_dict": (
        "def get_config(arg=None):\n    return {'seed': 1}\n",
        "returned a dict, not an ml_collections.ConfigDict",
    ),
    "no_get_config": ("SEED = 1\n", "defines no get_config"),
    "a_slip_inside": (  # an AttributeError of the file's own, not an unknown config key
        "import ml_collections\n\ndef get_config(arg=None):\n"
        "    return ml_collections.ConfigDcit()\n",
        "module 'ml_collections' has no attribute 'ConfigDcit'",
    ),
    "misspelt_key": (
        "from mptrain import config\n\ndef get_config(arg=None):\n"
        "    c = config.base_config()\n    c.optimizer.learnin_rate = 5.0\n    return c\n",
        "config.optimizer.learnin_rate=5.0: not a config key; did you mean "
        "'optimizer.learning_rate'?",
    ),
    "misspelt_model_key": (
        "from mptrain import config\n\ndef get_config(arg=None):\n"
        "    c = config.base_config()\n    c.model.num_head = 4\n    return c\n",
        "config.model.num_head=4: not a key of model.name='transformer_lm'; did you mean "
        "'model.num_heads'?",
    ),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
@pytest.mark.parametrize("overrides", [[], ["--config.num_train_steps=2"]])
def test_a_bad_config_file_exits_2_with_one_line(name, overrides, tmp_path, capsys):
    source, named = BAD_FILES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    code, err = run_cli(tmp_path / "run", *overrides, capsys=capsys, config=f"--config={path}")
    _one_line_exit_2(tmp_path / "run", err, code, named)


def test_a_custom_trainers_own_sections_are_its_own():
    path = ROOT / "examples" / "custom_trainer" / "config.py"
    config = runpy.run_path(str(path))["get_config"]("tiny")
    config_lib.validate(config)  # model.name='gru_forecaster', data.length: the subclass's
    config.trainer = "mptrain.train.trainer:Trainer"  # the zoo's builders would find no such model
    with pytest.raises(config_lib.ConfigError, match="model.name='gru_forecaster'"):
        config_lib.validate(config)


def test_help_prints_the_flags_and_where_the_keys_are(capsys):
    assert main_lib.main(["mptrain", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--config" in out and "--workdir" in out and "--config.KEY=VALUE" in out
    assert "mptrain/config.py" in out and "CONFIG_KEYS" in out


def test_validating_the_tiny_config_takes_under_a_second():
    config = load_config("default")
    config_lib.validate(config)  # imports and jax's first trace are paid once per process
    took = []
    for _ in range(3):  # the best of three: the validation's cost, not a neighbour's burst
        started = time.perf_counter()
        config_lib.validate(config)
        took.append(time.perf_counter() - started)
    assert min(took) < 1.0, took


# ------------------------------------------------------------ settings that cannot take effect


def test_the_output_dtype_is_what_the_loss_sees(tmp_path):
    losses = {}
    for output in ("f32", "f16"):
        config = tiny_config(precision=f"p=f32,c=bf16,o={output}")
        trainer = mptrain.Trainer(config, tmp_path)
        batch = trainer.build_datasets()[0].get_batch(0)
        state = trainer.init_state(batch)
        params = state.policy.cast_params(state.params)
        batch = state.policy.cast_to_compute(batch)
        loss, _ = trainer.loss_fn(params, {}, batch, jax.random.key(0))
        losses[output] = float(loss)
        logits = trainer.model.apply({"params": params}, batch["inputs"])
    assert logits.dtype == jnp.float32  # the model's own output: fp32 logits
    assert losses["f16"] == float(
        layers.cross_entropy(logits.astype(jnp.float16), batch["targets"])
    )
    assert losses["f16"] != losses["f32"]


@pytest.mark.parametrize(
    "overrides, warned",
    [
        ({"loss_scale.init_scale": 1024.0}, "loss_scale.init_scale=1024.0: no effect"),
        (
            {"precision": "fp16-mixed", "loss_scale.kind": "static", "loss_scale.hysteresis": 2},
            "loss_scale.hysteresis=2: no effect",
        ),
        ({"numerics.every_step": True}, "numerics.every_step=True: no effect"),
        ({"data.name": "tfds", "data.dataset": "mnist"}, "data.seq_len=32: no effect"),
    ],
)
def test_a_setting_without_effect_is_warned_about(overrides, warned):
    config = config_lib.override(tiny_config(), overrides)
    config_lib.validate(config)  # valid: a leftover of a config written for another setup
    found = unused.settings(config)
    assert [line for line in found if line.startswith(warned)], found
    assert unused.settings(tiny_config()) == []


def test_a_key_of_another_model_after_a_name_change_is_warned_about():
    config = load_config("mnist_cnn", **{"model.name": "mlp"})  # as mnist_cnn.py's doc says
    config_lib.validate(config)
    (found,) = unused.settings(config)
    assert found.startswith("model.features=(4, 8): no effect, model.name='mlp' reads no such key")


def test_keys_the_config_file_set_are_not_warned_of_when_the_command_line_moots_them(
    tmp_path, monkeypatch
):
    """Warnings name what the user set (issue 42, group 7): switching `data.name` on the command
    line leaves the text keys that configs/llama3.py set for its own source unread, and that is
    not the user's doing; a key the command line itself sets is still told."""
    told = []
    monkeypatch.setattr(launch, "run", lambda config, _: told.append(unused.settings(config)))
    np.save(tmp_path / "ids.npy", np.arange(4096, dtype=np.uint16) % 256)
    config = f"--config={ROOT / 'configs' / 'llama3.py'}:hf={FIXTURE}"
    switched = ["--config.data.name=tokens", f"--config.data.files={tmp_path / 'ids.npy'}"]
    assert run_cli(tmp_path / "a", *switched, config=config)[0] == 0
    assert run_cli(tmp_path / "b", *switched, "--config.data.eos_token=x", config=config)[0] == 0
    assert told[0] == []
    assert told[1] == ["data.eos_token='x': no effect, data.name='tokens' reads no such key"]
    from_python = load_config("llama3", f"hf={FIXTURE}", **{"data.name": "tokens"})
    assert len(unused.settings(from_python)) == 4  # no command line: every key is the user's


@pytest.mark.slow  # a CLI run: audit_test keeps the state's bytes per param
def test_kahan_compensation_is_counted_in_the_state_bytes(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    overrides = ["--config.precision=bf16-pure", "--config.param_rounding=kahan"]
    code, err = run_cli(tmp_path, *overrides, "--config.num_train_steps=2")
    assert code == 0, err
    # bf16 params 2 + their bf16 compensation 2 + fp32 Adam moments 4 + 4
    assert "12.0 state bytes/param" in caplog.text
    report = (tmp_path / "precision_report.txt").read_text()
    assert "compensation" in report


@pytest.mark.slow  # eight devices: trainer_test keeps data-parallel and FSDP meshes
@pytest.mark.default_mesh
def test_the_default_mesh_trains_on_every_device(tmp_path):
    assert config_lib.base_config().mesh.data == -1 and config_lib.base_config().mesh.fsdp == 1
    config = tiny_config()
    assert layout.mesh_shape(config.mesh, config.batch_size, num_devices=4) == (4, 1, 1, 1, 1)
    result = run_cli_process(TINY, f"--workdir={tmp_path}", devices=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh 4 devices: data 4 x fsdp 1 x expert 1 x context 1" in result.stderr
    # the gradients' fp32 all-reduce over the data axis, named by the axis it spans
    assert re.search(r"collectives a step by mesh axis: data [\d.]+ MiB", result.stderr)


@pytest.mark.parametrize(
    "config",
    [
        f"{ROOT / 'configs' / 'llama3.py'}:moe_tiny",
        f"{ROOT / 'configs' / 'hf.py'}:{ROOT / 'tests' / 'hf' / 'families' / 'qwen3_moe'}",
    ],
    ids=["moe_tiny", "hf_qwen3_moe"],
)
def test_every_key_the_moe_page_lists_is_a_key_of_the_moe_configs(config):
    """Sweep 2026-12-06, E07, E08, E11: `model.expert_matmul` and `model.router_fp32` (keys of
    docs/mixture-of-experts.md's table the config files leave at their defaults) override; the
    model's other keys as the file set them."""
    from mptrain import main

    argv = ["main", f"--config={config}", "--config.model.expert_matmul=xla"]
    argv += ["--config.model.router_fp32=False"]
    model = main.parse_flags(argv, str, lambda _: None).config.model
    assert model.expert_matmul == "xla" and model.router_fp32 is False
    assert model.num_experts == 8


def test_configs_hf_takes_tiny_as_every_config_file_does():
    """Sweep 2026-12-06: `configs/hf.py:tiny` read `tiny` as a folder ("tiny: no such file");
    the contract (docs/design.md) has every config file take it. It is the repository's own
    test folder, which validates as a run."""
    config = load_config("hf", "tiny")
    assert config.init_from.endswith("tests/hf/fixture") and config.num_train_steps == 8
    assert config.model.vocab_size == 300 and config.model.num_layers == 2
    mptrain.config.validate(config)


@pytest.mark.parametrize("arg", ["sft=", "dpo= ", "hf="])
def test_a_folder_variant_with_no_folder_is_refused_naming_it(arg):
    """Sweep 2026-12-06, H89: `configs/hf.py:sft=` read the config.json of the folder the
    command ran in."""
    for name in ("hf", "llama3") if arg != "hf=" else ("llama3",):  # hf.py:DIR has no hf=
        with pytest.raises(ValueError, match=r"name the model's folder after '='"):
            load_config(name, arg)
