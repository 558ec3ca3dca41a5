"""Each model's `Record`: what it says its model can do, that the rest of mptrain asks it (and
never a model's name), and that what a record lacks is refused in one line naming the models
that have it."""

import ast
from pathlib import Path

import pytest
from helpers import load_config

from mptrain import config as config_lib
from mptrain import errors, models
from mptrain.models import record as record_lib
from mptrain.recipe import precision

PACKAGE = Path(models.__file__).resolve().parents[1]

# name -> (language model, adapters, fp8 defaults, mesh axes, decodes, HF folders)
EXPECTED = {
    "llama": (True, True, {"scaling": "current", "bf16_layers": 1, "min_size": 1024},
              {"expert", "context", "tensor"}, True, True),
    "transformer_lm": (True, True, {}, set(), False, False),
    "cnn": (False, False, None, set(), False, False),
    "mlp": (False, False, None, set(), False, False),
    "resnet": (False, False, None, set(), False, False),
}  # fmt: skip


def test_each_record_says_what_its_model_can_do():
    found = {r.name: r for r in models.records()}
    assert set(found) == set(EXPECTED)
    for name, (lm, adapters, fp8, mesh, decodes, hf) in EXPECTED.items():
        r = found[name]
        fp8_defaults = None if r.fp8 is None else dict(r.fp8)
        got = (r.language_model, r.adapters, fp8_defaults, set(r.mesh), r.decodes, r.hf)
        assert got == (lm, adapters, fp8, mesh, decodes, hf), name
        assert (r.check_mesh is not None) == bool(mesh), name
        assert models.import_model(name).RECORD is r
        assert models.record_of(load_config("default", **{"model.name": name})) is r


def test_what_a_record_says_decides_the_run():
    """The loss unit, the fp8 defaults and the create call's arguments come from the record."""
    text = load_config("default")
    assert models.loss_unit(text) == "nats/byte"
    assert models.loss_unit(load_config("default", **{"model.name": "mlp"})) == "nats"
    llama = config_lib.policy_of(load_config("llama3", "tiny", precision="fp8-mixed")).fp8
    lm = config_lib.policy_of(load_config("default", precision="fp8-mixed")).fp8
    assert (llama.current, llama.bf16_layers, llama.min_size) == (True, 1, 1024)
    assert (lm.current, lm.bf16_layers, lm.min_size) == (False, 0, 0)
    assert models.records()[0].options() == frozenset()  # cnn: the config and the dtype
    assert models.record_of(text).options() == {"backend", "host_memory", "loss", "lora", "fp8"}


@pytest.mark.parametrize(
    ("model", "overrides", "says"),
    [
        ("cnn", {"lora.rank": 4}, "LoRA adapts llama and transformer_lm"),
        ("mlp", {"precision": "fp8-mixed"}, "fp8 runs the projections of llama and transformer_lm"),
        ("transformer_lm", {"mesh.context": 2}, "does not take a split sequence; llama does"),
        ("transformer_lm", {"mesh.tensor": 2}, "over a tensor axis; llama does"),
        ("cnn", {"mesh.expert": 2}, "has no experts to split over devices; llama does"),
        ("transformer_lm", {"sample.prompts": ("x",)}, "a model that decodes (llama)"),
    ],
)
def test_a_capability_the_record_lacks_is_refused_naming_the_models_that_have_it(
    model, overrides, says
):
    config = load_config("default", **{"model.name": model, "mesh.data": 1, **overrides})
    if model != "transformer_lm":  # its own keys, at their defaults
        with config.unlocked():
            config.model = {"name": model}
    policy = config_lib.policy_of(config)
    with pytest.raises((ValueError, errors.ConfigError), match=None) as e:
        if "sample.prompts" in overrides:
            config_lib.validate(config)
        else:
            module = models.import_model(model)
            built = models.create(config.model, policy, None, None, config.lora)
            models.check_mesh(config, module.RECORD, built)
    assert says in str(e.value)


def test_a_record_names_only_the_axes_a_model_can_split_over():
    with pytest.raises(ValueError, match="unknown mesh axes"):
        record_lib.Record("x", mesh=frozenset({"pipeline"}))
    assert isinstance(precision.get_policy("fp32"), precision.Policy)


ZOO = set(EXPECTED)


def _compares_a_model_name(node: ast.AST) -> bool:
    """A comparison (`==`, `!=`, `in`, `not in`) with a zoo model's name as a literal."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    literals = []
    for side in sides:
        if isinstance(side, ast.Constant):
            literals.append(side.value)
        elif isinstance(side, ast.Tuple | ast.List | ast.Set):
            literals += [e.value for e in side.elts if isinstance(e, ast.Constant)]
    return any(isinstance(v, str) and v in ZOO for v in literals)


def test_no_module_compares_a_model_name_with_a_literal():
    """What a model can do is asked of its record: no `model.name == "llama"` (or `in (...)`)
    anywhere in the package; the registry finds a model by the name its record gives."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if _compares_a_model_name(node):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, found
    probe = ast.parse('x = config.model.name != "llama" or name in ("transformer_lm", "cnn")')
    assert sum(_compares_a_model_name(n) for n in ast.walk(probe)) == 2
