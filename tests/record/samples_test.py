"""What the model says, in the record (`config.sample`, issue 45): greedy answers at each
evaluation in TensorBoard and samples.jsonl, and a training that is the same with them as
without them."""

import json

import pytest
from helpers import event_series, history_without_timings, load_config

from mptrain import config as config_lib
from mptrain import errors
from mptrain.train import trainer as trainer_lib

RUN = {
    "num_train_steps": 4,
    "log_every_steps": 2,
    "eval_every_steps": 2,
    "eval_steps": 1,
    "checkpoint_every_steps": 4,
}


@pytest.mark.slow  # the decoder's program, besides the tiny Llama's step
def test_samples_are_written_at_each_evaluation_and_change_nothing_of_the_training(tmp_path):
    prompts = ("def main(", "import ")
    on = load_config(
        "llama3", "tiny", **RUN, **{"sample.prompts": prompts, "sample.max_new_tokens": 8}
    )
    trainer_lib.Trainer(on, tmp_path / "on").train_and_evaluate()
    trainer_lib.Trainer(load_config("llama3", "tiny", **RUN), tmp_path / "off").train_and_evaluate()
    assert history_without_timings(tmp_path / "on") == history_without_timings(tmp_path / "off")
    lines = [json.loads(x) for x in (tmp_path / "on" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in lines] == [(s, p) for s in (2, 4) for p in prompts]
    assert all(isinstance(r["completion"], str) for r in lines)
    assert not (tmp_path / "off" / "samples.jsonl").exists()
    texts = event_series(tmp_path / "on", "sample/0")
    assert sorted(texts) == [2, 4], texts


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"sample.prompts": ("a", 3)}, "must be a list of strings"),
        ({"sample.max_new_tokens": 0}, "sample.max_new_tokens=0"),
    ],
)
def test_bad_sample_settings_name_the_key(overrides, says):
    config = load_config("llama3", "tiny", **overrides)
    with pytest.raises(errors.ConfigError, match=None) as e:
        config_lib.validate(config)
    assert says in str(e.value)


def test_samples_need_a_llama():
    config = load_config("default", **{"sample.prompts": ("x",)})
    with pytest.raises(errors.ConfigError, match="samples need a model that decodes"):
        config_lib.validate(config)


def test_prompts_that_cannot_be_answered_stop_the_run_before_it_trains(tmp_path):
    """A conversation without a chat template (byte-level text), or a prompt past the model's
    context: a `ConfigError` naming `config.sample.prompts` when the run is set up (the
    sampler is made with the hooks), not at its first evaluation."""
    from mptrain.record import samples

    cases = [
        ({"sample.prompts": ("x",), "sample.chat": True}, "no chat template"),
        ({"sample.prompts": ("x" * 250,), "sample.max_new_tokens": 32}, "past the model's context"),
    ]
    for overrides, says in cases:
        config = load_config("llama3", "tiny", **overrides)
        trainer = trainer_lib.Trainer(config, tmp_path / "run")
        with pytest.raises(errors.ConfigError, match="config.sample.prompts: ") as e:
            samples.create(trainer, run=None)
        assert says in str(e.value)
