"""Unsafe moment storage: the builders warn (`UnsafeMomentsWarning`) naming the argument, safe
choices warn nothing, and a run shows each problem once, in its start-up log."""

import logging
import warnings

import jax.numpy as jnp
import pytest
from helpers import tiny_config

import mptrain
from mptrain import optim
from mptrain.inspect import audit

UNSAFE = [  # (kwargs, what the message names, why)
    ({"mu_dtype": jnp.float16}, "mu_dtype=float16", "overflow"),
    ({"nu_dtype": "float16"}, "nu_dtype=float16", "overflows"),
    ({"nu_dtype": jnp.bfloat16, "moment_rounding": "nearest"}, "nu_dtype=bfloat16", "g**2"),
    ({"mu_dtype": "bfloat16", "moment_rounding": "nearest"}, "mu_dtype=bfloat16", "rounded away"),
    ({"nu_dtype": "q8", "moment_rounding": "nearest"}, "nu_dtype='q8'", "stands still"),
]
SAFE = [
    {},
    {"mu_dtype": "float32", "nu_dtype": jnp.float32, "moment_rounding": "nearest"},
    {"mu_dtype": "bfloat16", "nu_dtype": "bfloat16"},  # rounded stochastically
    {"mu_dtype": "q8", "nu_dtype": "q8"},
]


@pytest.mark.parametrize("build", [optim.adamw, optim.scale_by_adam], ids=["adamw", "adam"])
@pytest.mark.parametrize(("kwargs", "names", "why"), UNSAFE)
def test_each_unsafe_choice_warns_naming_the_argument(build, kwargs, names, why):
    args = (1e-3,) if build is optim.adamw else ()
    with pytest.warns(optim.UnsafeMomentsWarning) as caught:
        build(*args, **kwargs)
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(names) and why in message
    if "moment_rounding" in kwargs:
        assert "with moment_rounding='nearest'" in message
    assert warning.filename == __file__  # at the caller's line, not inside mptrain


def test_several_unsafe_choices_warn_once_each():
    with pytest.warns(optim.UnsafeMomentsWarning) as caught:
        optim.adamw(1e-3, mu_dtype=jnp.float16, nu_dtype=jnp.bfloat16, moment_rounding="nearest")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert messages[0].startswith("mu_dtype=float16: ")
    assert messages[1].startswith("nu_dtype=bfloat16 with moment_rounding='nearest': ")


@pytest.mark.parametrize("kwargs", SAFE)
def test_safe_choices_warn_nothing(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optim.adamw(1e-3, **kwargs)
        optim.scale_by_adam(**kwargs)
        optim.sgd(1e-3, momentum=0.9, mu_dtype="bfloat16")  # its momentum copes with bf16
    assert optim.moment_warnings(kwargs.get("mu_dtype"), kwargs.get("nu_dtype")) == []


def test_the_start_up_warnings_are_the_builders_messages():
    config = tiny_config(
        **{"optimizer.nu_dtype": "bfloat16", "optimizer.moment_rounding": "nearest"}
    )
    with pytest.warns(optim.UnsafeMomentsWarning) as caught:
        optim.adamw(1e-3, nu_dtype="bfloat16", moment_rounding="nearest")
    (logged,) = audit.setup_warnings(config)
    assert logged == "optimizer." + str(caught[0].message).replace(
        "with moment_rounding", "with optimizer.moment_rounding"
    )


def test_a_run_shows_each_unsafe_choice_once(tmp_path, caplog):
    unsafe = {"optimizer.mu_dtype": "float16", "optimizer.nu_dtype": "bfloat16"}
    config = tiny_config(num_train_steps=1, **unsafe, **{"optimizer.moment_rounding": "nearest"})
    expected = audit.setup_warnings(config)
    assert len(expected) == 2
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mptrain.run(config, tmp_path)
    shown = [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]
    for message in expected:
        assert sum(message in line for line in shown) == 1, message
        why = message.split(": ", 1)[1]  # the same words, in a log line or a Python warning
        assert sum(why in line for line in shown) == 1, message


@pytest.mark.parametrize("rounding", ["Nearest", " NEAREST "])
def test_the_rounding_is_read_as_the_builders_read_it(rounding):
    # the builders accept any case and spacing; the warnings read the rounding the same way
    with pytest.warns(optim.UnsafeMomentsWarning, match="nu_dtype=bfloat16 with moment_rounding"):
        optim.adamw(1e-3, nu_dtype=jnp.bfloat16, moment_rounding=rounding)
    config = tiny_config(
        **{"optimizer.nu_dtype": "bfloat16", "optimizer.moment_rounding": rounding}
    )
    (logged,) = audit.setup_warnings(config)
    assert logged.startswith("optimizer.nu_dtype=bfloat16 with optimizer.moment_rounding=")
    (message,) = optim.moment_warnings(None, "bfloat16", rounding)
    assert message.startswith("nu_dtype=bfloat16 with moment_rounding='nearest': ")
