"""A plan and a fit take `--devices` by one rule (issue 42, sweep cases D04, D06): a count below
1, or another count than the target names, is refused before anything compiles, so these need
no accelerator compiler (no `plan` marker)."""

import pytest
from helpers import tiny_config

import mptrain.plan
from mptrain import errors


@pytest.mark.parametrize("search", [mptrain.plan.plan, mptrain.plan.fit], ids=["plan", "fit"])
@pytest.mark.parametrize(
    "target, devices, says",
    [
        ("h100", 0, "--devices=0: a plan is for 1 device or more"),
        ("v5e-8", 4, "--target=v5e-8 names 8 devices and --devices=4: give one count"),
    ],
)
def test_a_device_count_a_plan_refuses_a_fit_refuses_too(search, target, devices, says):
    with pytest.raises(errors.ConfigError, match=f"^{says}$"):
        search(tiny_config(), target, devices)
