"""The second sweep of bad input (issue 27): what a demanding user tries, and what each gets.

One test per rule family, parametrized over its cases: choices read in any case, numbers with an
upper bound that follows from what they mean, modules that fail to import, workdirs of the
wrong shape, settings without effect, and a run's record that resumes like its state.
"""

import pytest
from conftest import tiny_config

from mptrain import config as config_lib
from mptrain import models, trainer


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.attention", "AUTO"),
        ("model.attention", " Materialized "),
        ("model.name", "Transformer_LM"),
        ("data.name", "TEXT"),
        ("precision", "BF16-Mixed"),
        ("loss_scale.kind", "Dynamic"),
        ("optimizer.name", "AdamW"),
        ("optimizer.schedule", "Cosine"),
        ("param_rounding", "Nearest"),
    ],
)
def test_every_choice_is_read_in_any_case(key, value, tmp_path):
    config = tiny_config(**{key: value})
    config_lib.validate(config)
    built = trainer.Trainer(config, tmp_path)
    built.build_datasets()
    assert models.loss_unit(config) == "nats/byte"
