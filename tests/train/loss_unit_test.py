"""The run summary names the eval loss's unit as the Trainer says (`Trainer.loss_unit`): the
zoo's for the built-in cross-entropy (nats/byte, and bits/byte, for the byte-level LM; nats for
the image classifiers), none for a subclass's own loss unless it names one."""

import io
import math
import runpy
import time
import types

import pytest
from helpers import ROOT, load_config, tiny_config

from mptrain import models
from mptrain.models import layers
from mptrain.record import curves, metrics
from mptrain.train import launch, loop
from mptrain.train import trainer as trainer_lib

STATE = types.SimpleNamespace(step=8, skipped_steps=0)
LAST_EVAL = {"eval_loss": 1.5, "eval_accuracy": 0.6}


def summary_of(trainer) -> str:
    return curves.summary(
        trainer.workdir, STATE, LAST_EVAL, 1.0, trainer.config, loss_unit=trainer.loss_unit
    )


def loss_line(text: str) -> str:
    (line,) = [x for x in text.splitlines() if "final eval loss" in x]
    return line


class OwnLossTrainer(trainer_lib.Trainer):
    """The default LM with a loss of its own (half the cross-entropy), and no `loss_unit`."""

    def loss_fn(self, params, model_state, batch, rng):
        logits = self.model.apply({"params": params}, batch["inputs"], train=True)
        return layers.cross_entropy(logits, batch["targets"]) / 2, (model_state, {})


def test_the_default_lm_says_nats_and_bits_per_byte(tmp_path):
    trainer = trainer_lib.Trainer(tiny_config(), tmp_path)
    assert trainer.loss_unit == "nats/byte"
    line = loss_line(summary_of(trainer))
    assert line == f"  final eval loss 1.5000 nats/byte = {1.5 / math.log(2):.3f} bits/byte"


def test_a_subclass_with_its_own_loss_fn_prints_no_unit(tmp_path):
    trainer = OwnLossTrainer(tiny_config(), tmp_path)  # model.name and data.name: the LM's
    assert trainer.loss_unit is None
    assert loss_line(summary_of(trainer)) == "  final eval loss 1.5000"


def test_a_subclass_that_names_its_unit_gets_it(tmp_path):
    class Named(OwnLossTrainer):
        loss_unit = "half nats/byte"

    line = loss_line(summary_of(Named(tiny_config(), tmp_path)))
    assert line == "  final eval loss 1.5000 half nats/byte"


def test_the_custom_trainer_example_prints_its_own_unit(tmp_path):
    path = ROOT / "examples" / "custom_trainer" / "config.py"
    config = runpy.run_path(str(path))["get_config"]("tiny")
    ForecastTrainer = launch.import_trainer(config.trainer)
    trainer = ForecastTrainer(config, tmp_path)
    line = loss_line(summary_of(trainer))
    assert trainer.loss_unit and trainer.loss_unit in line
    assert "nats" not in line and "bits" not in line
    # even on the LM's model.name and data.name (a config that keeps the defaults)
    config.model.name, config.data.name = "transformer_lm", "text"
    assert "nats" not in loss_line(summary_of(ForecastTrainer(config, tmp_path)))


@pytest.mark.parametrize(("name", "model"), [("mnist_cnn", "cnn"), ("mnist_cnn", "mlp")])
def test_an_image_classifier_says_nats(tmp_path, name, model):
    trainer = trainer_lib.Trainer(load_config(name, **{"model.name": model}), tmp_path)
    assert trainer.loss_unit == "nats"
    assert loss_line(summary_of(trainer)) == "  final eval loss 1.5000 nats"


@pytest.mark.parametrize(
    ("data", "tokenizer"), [("text", "/t/tokenizer.json"), ("tokens", "bytes"), ("tokens", None)]
)
def test_a_language_model_on_tokens_says_nats_per_token(data, tokenizer):
    config = tiny_config(**{"data.name": data})
    config.data.tokenizer = tokenizer
    assert models.loss_unit(config) == "nats/token"
    config.data.name, config.data.tokenizer = "text", "bytes"
    assert models.loss_unit(config) == "nats/byte"


def test_the_resnet_config_says_nats(tmp_path):
    assert trainer_lib.Trainer(load_config("cifar10_resnet"), tmp_path).loss_unit == "nats"


def test_the_summary_keeps_its_old_call_and_then_names_no_unit(tmp_path):
    text = curves.summary(tmp_path, STATE, LAST_EVAL, 1.0, tiny_config())
    assert loss_line(text) == "  final eval loss 1.5000"


def test_a_run_prints_the_unit_it_is_given(tmp_path, capsys):
    """`Run.finish` (what `train_and_evaluate` ends with) passes the Trainer's unit on."""
    run = types.SimpleNamespace(
        workdir=tmp_path, title="t", started=time.monotonic(), state=STATE, config=tiny_config()
    )
    loop.Run.finish(run, LAST_EVAL, "mean squared error")
    assert loss_line(capsys.readouterr().out) == "  final eval loss 1.5000 mean squared error"


def test_a_small_loss_keeps_its_digits(tmp_path):
    """A regression's mean squared error of 6.5e-6 is not printed as 0.0000, neither at the
    end nor on the live progress line."""
    text = curves.summary(tmp_path, STATE, {"eval_loss": 6.468e-6}, 1.0, tiny_config())
    assert loss_line(text) == "  final eval loss 6.468e-06"
    line = metrics.ProgressLine(10, io.StringIO()).update(5, {"loss": 6.468e-6, "eval_loss": 1.5})
    assert line.startswith("step 5/10 | loss 6.468e-06 | eval_loss 1.5000"), line
