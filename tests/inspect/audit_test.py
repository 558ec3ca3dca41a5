"""State bytes per parameter, measured from the arrays, the unsafe-setup warnings, and the
precision report: matmuls by dtype and line, and the GPU hazards (scatters, 16-bit sums)."""

import contextlib
import logging
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import needs_devices, normal, tiny_config

import mptrain
from mptrain import config as config_lib
from mptrain import optim
from mptrain.inspect import audit, hlo
from mptrain.models import attention, layers
from mptrain.recipe import precision


@pytest.mark.parametrize(
    "policy, moments, expected",
    [
        ("fp32", None, 12),
        ("bf16-mixed", None, 12),
        ("bf16-pure", None, 10),
        ("bf16-pure", "bfloat16", 6),
    ],
)
def test_state_bytes_per_param(policy, moments, expected):
    params = {"w": normal(0, (64, 64)), "b": jax.numpy.zeros((64,))}
    tx = optim.adamw(1e-3, mu_dtype=moments, nu_dtype=moments)
    state = mptrain.TrainState.create(apply_fn=None, params=params, tx=tx, policy=policy)
    assert audit.state_bytes_per_param(state.params, state.opt_state) == expected


def _config(precision="bf16-mixed", **overrides):
    config = config_lib.base_config()
    config.precision = precision
    for key, value in overrides.items():
        section, _, leaf = key.rpartition(".")
        (config[section] if section else config)[leaf] = value
    return config


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"])
def test_no_warnings_for_the_presets_as_they_come(precision):
    assert audit.setup_warnings(_config(precision)) == []


def test_warns_for_fp16_compute_without_loss_scaling():
    (warning,) = audit.setup_warnings(_config("fp16-mixed", **{"loss_scale.kind": "none"}))
    assert "float16 compute without loss scaling" in warning and "'none'" in warning
    assert audit.setup_warnings(_config("fp16-mixed", **{"loss_scale.kind": "static"})) == []
    assert audit.setup_warnings(_config("bf16-mixed", **{"loss_scale.kind": "none"})) == []


def test_warns_for_bf16_second_moment_rounded_to_nearest():
    config = _config(**{"optimizer.nu_dtype": "bfloat16", "optimizer.moment_rounding": "nearest"})
    (warning,) = audit.setup_warnings(config)
    assert "optimizer.nu_dtype=bfloat16" in warning
    assert audit.setup_warnings(_config(**{"optimizer.nu_dtype": "bfloat16"})) == []


def test_warns_for_fp16_second_moment():
    (warning,) = audit.setup_warnings(_config("fp32", **{"optimizer.nu_dtype": "float16"}))
    assert "overflows" in warning


def test_warns_for_bf16_params_rounded_to_nearest_at_a_small_learning_rate():
    small = {"optimizer.learning_rate": 1e-4}
    (warning,) = audit.setup_warnings(_config("bf16-pure", param_rounding="nearest", **small))
    assert "rounded away" in warning
    assert audit.setup_warnings(_config("bf16-pure", **small)) == []  # auto: stochastic
    assert audit.setup_warnings(_config("bf16-pure", param_rounding="kahan", **small)) == []
    big = {"optimizer.learning_rate": 0.01}
    assert audit.setup_warnings(_config("bf16-pure", param_rounding="nearest", **big)) == []


# -------------------------------------------------------------------------- precision report


def _step_and_args(trainer, batch):
    """The step a run of `trainer` compiles, and its arguments: the same program as the run's
    (a test of the default step shares it with the runs that train that config)."""
    state = trainer.init_state(batch)
    jitted, make_totals, _ = trainer.make_run_step(state, batch)
    return jitted, state, trainer.device_batch(_Fixed(batch), 0), make_totals()


class _Fixed:
    def __init__(self, batch):
        self.batch = batch

    def get_batch(self, index):
        return self.batch


def _lm_batch(config):
    tokens = np.random.default_rng(0).integers(0, 256, (config.batch_size, 33)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_the_default_step_runs_its_matmuls_in_bf16(tmp_path):
    trainer = mptrain.Trainer(tiny_config(), tmp_path)
    report = audit.precision_report(*_step_and_args(trainer, _lm_batch(trainer.config)))
    assert report.compute_dtype == "bfloat16"
    assert report.compute_fraction >= 0.99 and set(report.matmul_flops) == {"bfloat16"}
    assert report.state_bytes["params"] == 4.0 and report.state_bytes["opt_state.mu"] == 4.0
    softmax = f"attention.py:{_line('probs = jax.nn.softmax(scores', attention.__file__)}"
    assert any(where.endswith(softmax) for where in report.islands), report.islands
    assert "matmul FLOPs" in str(report)


class Fp32ReadoutTrainer(mptrain.Trainer):
    """Multiplies the (fp32) logits by an fp32 matrix: a matmul the compute dtype never sees."""

    def loss_fn(self, params, model_state, batch, rng):
        logits = self.model.apply({"params": params}, batch["inputs"], train=True)
        mixed = logits @ jnp.asarray(np.eye(256), jnp.float32)  # the fp32 matmul
        return layers.cross_entropy(mixed, batch["targets"]), (model_state, {})


def _line(marker, path=__file__):
    """The number of the line of `path` (this file) that ends with `marker`, or, in another
    file, that holds it."""
    lines = Path(path).read_text().splitlines()
    found = [i for i, line in enumerate(lines, 1) if line.endswith(marker) or (
        path != __file__ and marker in line)]  # fmt: skip
    (number,) = found
    return number


FP32_LINE = _line("# the fp32 matmul")


def test_an_fp32_matmul_is_counted_and_the_trainer_names_its_line(tmp_path, caplog):
    config = tiny_config(num_train_steps=1, trainer=f"{__name__}:Fp32ReadoutTrainer")
    caplog.set_level(logging.WARNING)
    Fp32ReadoutTrainer(config, tmp_path / "run").train_and_evaluate()
    assert (
        f"audit_test.py:{FP32_LINE}" in caplog.text
        and "of the matmul FLOPs run in bfloat16" in caplog.text
    )
    # the run's own report, of the step it compiled: the fp32 matmul counted and named first
    written = (tmp_path / "run" / "precision_report.txt").read_text()
    (first, *_) = [line for line in written.splitlines() if "not bfloat16: " in line]
    where, dtype, flops = first.split("not bfloat16: ")[1].split()[:3]
    assert where.endswith(f"audit_test.py:{FP32_LINE}") and dtype == "float32"
    fp32 = [line for line in written.splitlines() if line.strip().startswith("float32 ")]
    assert fp32 and int(fp32[0].split()[1].replace(",", "")) >= int(flops.replace(",", "")) > 0


def test_the_matmul_table_sums_to_a_hand_count_for_a_one_layer_mlp(tmp_path):
    config = config_lib.base_config()
    config.model.name, config.model.num_layers, config.batch_size = "mlp", 1, 4
    config.model.hidden = 32
    batch, features, hidden, classes = 4, 16, 32, 10
    trainer = mptrain.Trainer(config, tmp_path)
    data = {"inputs": np.ones((batch, features), np.float32), "targets": np.zeros(batch, np.int32)}
    report = audit.precision_report(*_step_and_args(trainer, data))
    # forward: x @ W1, h @ W2; backward: h^T @ g (W2's gradient), g @ W2^T (h's gradient),
    # x^T @ dh (W1's gradient); no gradient for the data itself. 2 FLOPs per multiply-add.
    macs = batch * (features * hidden + hidden * classes)  # forward
    macs += batch * (hidden * classes + classes * hidden + features * hidden)  # backward
    assert sum(report.matmul_flops.values()) == 2 * macs
    assert report.matmul_flops == {"bfloat16": 2 * macs}
    assert f"{2 * macs:,}" in str(report) or str(2 * macs) in str(report)


# ------------------------------------------------------------------------------- GPU hazards


class TableLM(nn.Module):
    """Looks tokens up in an embedding table, then a readout. `cast_rows`: gather from the
    table in fp32 and cast the rows to bf16 (the table's gradient then accumulates in fp32);
    otherwise from the bf16 table that the bf16-mixed step hands it."""

    cast_rows: bool = False

    @nn.compact
    def __call__(self, ids, train=False):
        embed = nn.Embed(256, 32)
        if self.cast_rows:
            table = embed.embedding.astype(jnp.float32)
            rows = jnp.take(table, ids, axis=0).astype(jnp.bfloat16)  # the fp32 gather
        else:
            rows = embed(ids)  # the bf16 gather
        return nn.Dense(256)(rows)


class TableTrainer(mptrain.Trainer):
    cast_rows = False

    def build_model(self):
        return TableLM(cast_rows=self.cast_rows)


class CastRowsTrainer(TableTrainer):
    cast_rows = True


def _hazards(report, line=None):
    """`{(op, dtype, kind)}` of the report's hazards (at this file's `line` if given)."""
    at = f"audit_test.py:{line}"
    return {(h.op, h.dtype, h.kind) for h in report.hazards if line is None or h.where.endswith(at)}


def test_a_gather_from_a_bf16_table_is_named_as_a_bf16_scatter_add(tmp_path, caplog):
    line = _line("# the bf16 gather")
    # Every param cast (keep_fp32=""): the default rule would hand the model its table in fp32.
    config = tiny_config(num_train_steps=1, trainer=f"{__name__}:TableTrainer", keep_fp32="")
    report = audit.precision_report(
        *_step_and_args(TableTrainer(config, tmp_path), _lm_batch(config))
    )
    assert _hazards(report, line) == {("scatter-add", "bfloat16", "16-bit")}, report.hazards
    (warning,) = [w for w in report.warnings if "scatter-add" in w]
    assert f"audit_test.py:{line}: scatter-add on bfloat16" in warning and "float32" in warning
    assert "GPU hazards" in str(report) and f"audit_test.py:{line}" in str(report)
    caplog.set_level(logging.WARNING)
    TableTrainer(config, tmp_path / "run").train_and_evaluate()  # warned at start-up
    assert f"audit_test.py:{line}: scatter-add on bfloat16" in caplog.text
    written = (tmp_path / "run" / "precision_report.txt").read_text()
    assert "GPU hazards" in written and f"audit_test.py:{line}" in written


@pytest.mark.slow  # a program no other test compiles: make test keeps the bf16 table's gather
def test_a_gather_from_an_fp32_table_is_listed_as_nondeterministic_and_not_warned(tmp_path):
    line = _line("# the fp32 gather")
    config = tiny_config()
    report = audit.precision_report(
        *_step_and_args(CastRowsTrainer(config, tmp_path), _lm_batch(config))
    )
    assert _hazards(report, line) == {("scatter-add", "float32", "nondeterministic")}
    assert not [h for h in report.hazards if h.kind == "16-bit"], report.hazards
    assert not [w for w in report.warnings if "scatter" in w], report.warnings


class PoolNet(nn.Module):
    """A bf16 conv, then max-pools: 3x3 windows with stride 2 overlap (as in ResNet's stem),
    2x2 windows with stride 2 do not."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")  # the overlapping pool
        x = nn.max_pool(x, (2, 2), (2, 2))  # the tiling pool
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class PoolTrainer(mptrain.Trainer):
    def build_model(self):
        return PoolNet()


@pytest.mark.slow  # its own programs: make test keeps the bf16 table's gather
def test_a_max_pool_shows_its_select_and_scatter(tmp_path):
    data = {"inputs": np.ones((4, 16, 16, 3), np.float32), "targets": np.zeros(4, np.int32)}
    report = audit.precision_report(*_step_and_args(PoolTrainer(tiny_config(), tmp_path), data))
    overlapping, tiling = _line("# the overlapping pool"), _line("# the tiling pool")
    assert _hazards(report, overlapping) == {("select_and_scatter_add", "bfloat16", "16-bit")}
    assert _hazards(report, tiling) == {("select_and_scatter_add", "bfloat16", "deterministic")}
    (warning,) = [w for w in report.warnings if "select_and_scatter" in w]
    assert f"audit_test.py:{overlapping}" in warning and "pool in float32" in warning


class SummingTrainer(mptrain.Trainer):
    """Adds up the loss over the data-parallel devices in bf16, for the log."""

    def loss_fn(self, params, model_state, batch, rng):
        loss, (model_state, aux) = super().loss_fn(params, model_state, batch, rng)
        total = jax.lax.psum(loss.astype(jnp.bfloat16), "data")  # the bf16 psum
        return loss, (model_state, {**aux, "total": total.astype(jnp.float32)})


@needs_devices(2)
@pytest.mark.parametrize(
    "trainer_class",
    # a variant: make test keeps the framework's own fp32 sum
    [mptrain.Trainer, pytest.param(SummingTrainer, marks=pytest.mark.slow)],
)
def test_a_sum_across_devices_in_bf16_is_named_and_the_framework_sums_in_fp32(
    trainer_class, tmp_path
):
    config = tiny_config(**{"mesh.data": 2})
    report = audit.precision_report(
        *_step_and_args(trainer_class(config, tmp_path), _lm_batch(config))
    )
    assert report.collectives["all-reduce"]  # the mesh step does sum across devices
    sums = {h for h in report.hazards if h.op not in hlo.SCATTERS}
    if trainer_class is mptrain.Trainer:
        assert sums == set(), sums  # the framework's reductions are fp32
        return
    line = _line("# the bf16 psum")
    (h,) = sums
    assert (h.op, h.dtype, h.kind) == ("psum", "bfloat16", "16-bit")
    assert h.where.endswith(f"audit_test.py:{line}")
    (warning,) = [w for w in report.warnings if "across devices" in w]
    assert f"audit_test.py:{line}: psum sums bfloat16 across devices" in warning


def test_a_16_bit_all_reduce_in_the_compiled_program_is_named():
    """XLA:CPU upcasts 16-bit all-reduces, so this reads a GPU-like program's text."""
    text = (
        "ENTRY %main (p: bf16[1024], q: f32[64]) -> f32[64] {\n"
        "  %all-reduce.1 = bf16[1024]{0} all-reduce(bf16[1024]{0} %p), channel_id=1, "
        'replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(step)/dot_general"}\n'
        "  ROOT %all-reduce.2 = f32[64]{0} all-reduce(f32[64]{0} %q), replica_groups={{0,1}}, "
        "to_apply=%add\n}\n"
    )

    class Compiled:
        def as_text(self):
            return text

    jaxpr = jax.make_jaxpr(lambda x: x * 2)(jnp.ones(3))
    report = audit.make_report(jaxpr, Compiled(), (), policy="bf16-mixed")
    assert report.collectives == {"all-reduce": {"bf16": 2048, "f32": 256}}
    assert report.hazards == [
        audit.Hazard("all-reduce", "bfloat16", "jit(step)/dot_general", 1, "16-bit")
    ]
    (warning,) = report.warnings
    assert "all-reduce sums bfloat16 across devices" in warning


def _dot_precisions(trainer):
    step, *args = _step_and_args(trainer, _lm_batch(trainer.config))
    text = step.lower(*args).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    return text, [re.search(r"precision = \[([^\]]*)\]", line).group(1) for line in dots]


def test_fp32_runs_every_matmul_at_highest_and_the_report_says_so(tmp_path):
    """Read on the lowered program, which every backend compiles: jax's default precision would
    run these float32 dots as one bfloat16 pass on a TPU and in TensorFloat-32 on an NVIDIA GPU."""
    trainer = mptrain.Trainer(tiny_config(precision="fp32"), tmp_path)
    _, precisions = _dot_precisions(trainer)
    assert precisions and set(precisions) == {"HIGHEST, HIGHEST"}
    report = audit.precision_report(*_step_and_args(trainer, _lm_batch(trainer.config)))
    assert set(report.precisions) == {"float32"} and set(report.precisions["float32"]) == {
        "highest"
    }
    assert "precision highest" in str(report) and not report.warnings


def test_a_float32_matmul_at_reduced_precision_is_warned(tmp_path):
    config = tiny_config(precision="fp32", matmul_precision="default")
    report = audit.precision_report(
        *_step_and_args(mptrain.Trainer(config, tmp_path), _lm_batch(config))
    )
    assert set(report.precisions["float32"]) == {"default"}
    (warning,) = report.warnings
    assert "run at reduced precision" in warning and "matmul_precision='highest'" in warning


def test_the_f32_f32_f32_algorithm_is_full_precision_for_the_report_as_for_the_plan():
    f = lambda a, b: jnp.dot(a, b, precision=jax.lax.DotAlgorithmPreset.F32_F32_F32)
    report = audit.precision_report(f, jnp.ones((8, 8)), jnp.ones((8, 8)), policy="fp32")
    assert report.precisions == {"float32": {"f32_f32_f32": 1024}}
    assert not [w for w in report.warnings if "reduced precision" in w]


def test_bf16_mixed_lowers_its_matmuls_as_without_a_precision_context(tmp_path, monkeypatch):
    """Under 16-bit compute "auto" asks for JAX's default: the matmuls lower as they did
    before the policy had a precision."""
    trainer = mptrain.Trainer(tiny_config(), tmp_path)

    def matmuls():
        text, precisions = _dot_precisions(trainer)
        lines = [line for line in text.splitlines() if re.search(r"dot_general|convolution", line)]
        return precisions, [re.sub(r"%[\w#]+", "%", line.strip()) for line in lines]

    precisions, lines = matmuls()
    assert set(precisions) == {"DEFAULT, DEFAULT"}
    monkeypatch.setattr(precision.Policy, "matmuls", lambda self: contextlib.nullcontext())
    assert matmuls() == (precisions, lines)
