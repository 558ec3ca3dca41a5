"""Every param declares its logical axes where it is created, and the state is split by the one
table of rules (`layout.RULES`): each zoo model and each HuggingFace family fixture, shapes
only (nothing compiles)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_config
from jax.sharding import Mesh

import mptrain
from mptrain import hf, models
from mptrain.parallel import axes, layout, sharding

FAMILIES = Path(__file__).resolve().parents[1] / "hf" / "families"
# a tiny config of each zoo model (its record's name), with a mesh it takes
ZOO = {
    "transformer_lm": ("default", {}),
    "llama": ("llama3", {"model.num_heads": 4, "model.num_kv_heads": 2}),
    "cnn": ("default", {"model.name": "cnn", "data.name": "synthetic_images"}),
    "mlp": ("default", {"model.name": "mlp", "data.name": "synthetic_images"}),
    "resnet": ("cifar10_resnet", {}),
}
MESH = (1, 2, 1, 1, 2)  # fsdp 2 x tensor 2: a dimension of each kind is split


def _mesh(shape=MESH) -> Mesh:
    return Mesh(np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape), layout.AXES)


def _rules_allow(names, spec) -> bool:
    """Each dimension's axes are among the ones `RULES` gives its name (none for no name)."""
    allowed = {}
    for name, split in layout.RULES:
        allowed.setdefault(name, set()).update(split)
    for name, entry in zip(names, tuple(spec) + (None,) * (len(names) - len(spec)), strict=True):
        got = set() if entry is None else set(entry if isinstance(entry, tuple) else (entry,))
        if not got <= allowed.get(name, set()):
            return False
    return True


def test_the_zoo_is_every_model_checked():
    assert set(ZOO) == {r.name for r in models.records()}


@pytest.mark.parametrize("name", list(ZOO))
def test_every_param_of_a_zoo_model_declares_its_axes_and_the_state_follows_the_rules(name):
    file, overrides = ZOO[name]
    # the decoder's heads and units over a tensor group too; the others take data and fsdp
    mesh_keys = {"mesh.fsdp": 2, "mesh.tensor": 2} if name == "llama" else {"mesh.fsdp": 4}
    config = load_config(file, **{"mesh.data": 1, **overrides, **mesh_keys})
    devices = jax.devices()[:4]
    trainer = mptrain.Trainer(config, "/nonexistent", devices=devices)
    batch = trainer.build_datasets()[0].get_batch(0)
    state = jax.eval_shape(lambda: trainer.init_state(batch))
    assert len(state.axes) == len(jax.tree.leaves(state.params)), name
    assert state.axes.undeclared == [], name
    shardings = sharding.state_shardings(trainer.mesh, state)
    keys = lambda path: tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    params = {keys(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(shardings.params)}
    splits = 0
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        names, where = state.axes.of(path), params[keys(path)]
        assert len(names) == x.ndim, (name, path, names)
        assert where == layout.param_spec(names, x.shape, trainer.mesh), (path, where)
        assert _rules_allow(names, where), (path, names, where)
        splits += any(entry is not None for entry in where)
    assert splits, f"{name}: no param split over the mesh"
    if name == "llama":  # the rules' table, read on its decoder: width over fsdp, the rest tensor
        layer = lambda *k: tuple(params[("stacked_layers", *k)])
        assert layer("attn", "q", "kernel") == (None, "fsdp", "tensor")
        assert layer("attn", "k", "kernel") == (None, "fsdp", "tensor")
        assert layer("attn", "o", "kernel") == (None, "tensor", "fsdp")
        assert layer("mlp", "gate", "kernel") == (None, "fsdp", "tensor")
        assert layer("mlp", "down", "kernel") == (None, "tensor", "fsdp")
        assert layer("attn_norm", "scale") == (None, "fsdp")
        assert tuple(params[("embed", "embedding")]) == ("tensor", "fsdp")
        assert tuple(params[("head", "kernel")]) == ("fsdp", "tensor")
    moments = 0  # an optimizer's moments split as their params do
    for path, s in jax.tree_util.tree_leaves_with_path(shardings.opt_state):
        of = [p for p in params if keys(path)[-len(p) :] == p]
        if of:
            moments += 1
            assert s.spec == params[max(of, key=len)], (path, s.spec)
    assert moments >= len(params), moments  # one a param at least (SGD's momentum)


@pytest.mark.parametrize("folder", sorted(p.name for p in FAMILIES.iterdir() if p.is_dir()))
def test_every_param_of_a_family_fixture_declares_its_axes(folder):
    config = hf.read_config(FAMILIES / folder)
    scanned = not (config.get("dense_layers") and config.get("num_experts"))
    declared, shapes = hf.declared(config, scan_layers=scanned)
    assert declared.undeclared == [] and len(declared) == len(jax.tree.leaves(shapes))
    mesh = _mesh((1, 4, 1, 1, 1))
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        names = declared.of(path)
        spec = layout.param_spec(names, x.shape, mesh)
        assert _rules_allow(names, spec), (folder, path, names, spec)
        if axes.EMBED in names and x.shape[names.index(axes.EMBED)] % 4 == 0:
            assert spec[names.index(axes.EMBED)] == "fsdp", (folder, path, spec)


def test_a_param_declares_names_for_each_of_its_dimensions():
    init = axes.declare(jax.nn.initializers.zeros, (axes.EMBED,))
    with pytest.raises(ValueError, match=r"1 names \('embed',\) for a \(2, 3\) param"):
        init(jax.random.key(0), (2, 3), jnp.float32)
    with pytest.raises(ValueError, match="unknown logical axes"):
        axes.declare(jax.nn.initializers.zeros, ("width",))
    table = axes.declared({"w": init(jax.random.key(0), (4,), jnp.float32), "b": jnp.zeros(2)})
    assert table.of(("opt", "mu", "w")) == (axes.EMBED,) and table.undeclared == ["b"]
    spec = layout.param_spec((axes.EMBED,), (6,), _mesh((1, 4, 1, 1, 1)))
    assert tuple(spec) == (None,)  # 4 does not divide 6: held whole
