"""LoRA (`config.lora`): adapters train over a frozen base stored once, in the compute dtype or
in 8 bits; step 0 is the base model; checkpoints hold what trains and name the base; bad
settings and a changed base are one line, exit 2.

The run is `configs/llama3.py:hf=DIR` on a copy of `tests/hf/fixture` (its weights the base)
with rank-4 adapters on every projection, fine-tuned on text (`STEPS` steps, one compiled step).
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from helpers import (
    FIXTURE,
    STEPS,
    hf_flag,
    llama_config,
    load_config,
    make_text,
    make_tokenizer,
    overrides,
    run_cli,
    step0,
)

from mptrain import errors, models
from mptrain.models import lora
from mptrain.optim import q8
from mptrain.parallel import axes, sharding
from mptrain.plan import memory as plan_memory
from mptrain.recipe import frozen, precision
from mptrain.train import adapters
from mptrain.train import trainer as trainer_lib

LORA = {"lora.rank": 4, "lora.alpha": 8.0}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The LoRA run (Trainer API, to keep its final state), its step-0 state and its inputs."""
    base = tmp_path_factory.mktemp("lora")
    folder = Path(shutil.copytree(FIXTURE, base / "llama"))
    text = make_text(base / "notes")
    make_tokenizer(folder, [p.read_text() for p in sorted((base / "notes").iterdir())])
    workdir, cache = base / "run", base / "cache"
    flags = dict(f.removeprefix("--config.").split("=", 1) for f in overrides(text, cache))
    keys = {k: (int(v) if v.isdigit() else v) for k, v in flags.items()} | LORA
    config = load_config("llama3", f"hf={folder}", **keys)
    start = step0(config, base / "step0")
    final = trainer_lib.Trainer(config, workdir).train_and_evaluate()
    return dict(folder=folder, config=config, workdir=workdir, start=start, final=final, text=text)


def test_only_the_adapters_train_and_the_base_is_stored_once_in_bf16(tuned):
    (start, trainer), final = tuned["start"], tuned["final"]
    names = [precision.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(final.params)]
    assert names and all(lora.is_adapter(n) for n in names)
    assert {x.dtype for x in jax.tree.leaves(final.params)} == {np.dtype(np.float32)}
    # the optimizer's state: moments of the adapters alone (and counts)
    for path, x in jax.tree_util.tree_leaves_with_path(final.opt_state):
        assert x.ndim == 0 or lora.is_adapter(precision.path_name(path)), path
    # the base: every other param, bf16, the fixture's weights rounded once, bit-identical
    # after the run's steps
    assert {x.dtype for x in jax.tree.leaves(final.frozen)} == {np.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(
        np.asarray(final.frozen["embed"]["embedding"]),
        np.asarray(start.frozen["embed"]["embedding"]),
    )
    for a, b in zip(jax.tree.leaves(final.frozen), jax.tree.leaves(start.frozen), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    tensors = safetensors.numpy.load_file(str(FIXTURE / "model.safetensors"))
    down = tensors["model.layers.1.mlp.down_proj.weight"].T.astype(jnp.bfloat16)
    got = np.asarray(start.frozen["stacked_layers"]["mlp"]["down"]["kernel"][1])
    assert got.tobytes() == down.tobytes()
    # the adapters did train: B moved off zero
    b = final.params["stacked_layers"]["attn"]["q"]["lora_b"]
    assert float(jnp.abs(b).max()) > 0
    assert trainer.model.lora.scale == 2.0  # alpha / rank


def test_step_0_is_the_base_model_exactly(tuned):
    start, trainer = tuned["start"]
    config = tuned["config"]
    base_model = models.create(config.model, trainer.policy)  # no adapters
    tokens = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) % 200)
    cast = trainer.policy.cast_params
    with_adapters = trainer.model.apply({"params": cast(start.model_params)}, tokens)
    base = base_model.apply({"params": cast(start.frozen)}, tokens)
    assert np.asarray(with_adapters).tobytes() == np.asarray(base).tobytes()


def test_a_checkpoint_holds_what_trains_and_names_the_base(tuned):
    meta_file = tuned["workdir"] / "checkpoints" / str(STEPS) / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    arrays = [k for k in meta["arrays"] if k.startswith((".params", ".frozen"))]
    assert arrays and all(k.endswith(("['lora_a']", "['lora_b']")) for k in arrays)
    assert meta[adapters.BASE] == adapters.fingerprint(tuned["final"])
    report = (tuned["workdir"] / "precision_report.txt").read_text()
    assert "trained: 5,760 params in float32 (the adapters); 65,904 frozen (the base)" in report


def test_a_resume_over_a_changed_base_is_one_line_exit_2(tuned, tmp_path, capsys):
    folder = Path(shutil.copytree(tuned["folder"], tmp_path / "llama"))
    workdir = Path(shutil.copytree(tuned["workdir"], tmp_path / "run"))
    flags = [f"--config.{k}={v}" for k, v in LORA.items()]
    flags += overrides(tuned["text"], tuned["config"].data.cache_dir, steps=STEPS + 10)
    path = folder / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    code, err = run_cli(workdir, *flags, capsys=capsys, config=hf_flag(folder))
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert f"config.init_from={str(folder)!r}" in line and "another base" in line


@pytest.mark.parametrize(
    "key, value",
    [  # make test keeps the targets: the rank's resume compiles programs no other test does
        pytest.param("lora.rank", 8, marks=pytest.mark.slow),
        ("lora.targets", "attn/(q|v)/kernel$"),
    ],
)
def test_a_resume_with_other_adapters_names_the_key(tuned, tmp_path, capsys, key, value):
    workdir = Path(shutil.copytree(tuned["workdir"], tmp_path / "run"))
    flags = [f"--config.{k}={v}" for k, v in (LORA | {key: value}).items()]
    flags += overrides(tuned["text"], tuned["config"].data.cache_dir, steps=STEPS + 10)
    code, err = run_cli(workdir, *flags, capsys=capsys, config=hf_flag(tuned["folder"]))
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert code == 2 and line.startswith(f"mptrain: error: config.{key}={value!r}: "), err
    assert f"Resume with --config.{key}=" in line and "shape" not in line, line


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("lora.rank", 0, "lora.rank=0"),
        ("lora.rank", 300, "lora.rank=300: above the width of "),
        ("lora.targets", "attn/nothing", "matches none of the model's"),
        ("lora.base_dtype", "nf4", "lora.base_dtype='nf4'"),
    ],
)
def test_bad_settings_are_one_line_exit_2_and_no_workdir(tmp_path, capsys, key, value, says):
    workdir = tmp_path / "run"
    code, err = run_cli(workdir, "--config.lora.rank=4", f"--config.{key}={value}", capsys=capsys)
    assert code == 2
    assert says in err and len([x for x in err.splitlines() if "error" in x]) == 1
    assert not workdir.exists()


def _init(precision_name, base_dtype="compute", targets=None, **model):
    config = load_config("llama3", "tiny", precision=precision_name, **LORA)
    config.lora.base_dtype, config.lora.targets = base_dtype, targets
    config.model = llama_config(**model)
    trainer = trainer_lib.Trainer(config, "/nonexistent")
    batch = {"inputs": np.zeros((2, 8), np.int32), "targets": np.zeros((2, 8), np.int32)}
    init, args = trainer.make_init(batch)
    return jax.eval_shape(init, *args), trainer


def test_under_bf16_pure_the_adapters_are_bf16_with_stochastic_rounding():
    state, _ = _init("bf16-pure")
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(jnp.bfloat16)}
    assert state.param_rounding == "stochastic"
    assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {np.dtype(jnp.bfloat16)}


def test_an_8_bit_base_keeps_the_projections_in_q8_and_step_0_is_its_dequantized_model():
    shapes, trainer = _init("bf16-mixed", "q8", scan_layers=False)
    kernels = frozen.split(shapes.frozen, lambda p: p.endswith("/kernel"))[0]
    found = {
        precision.path_name(p): (q8.is_q8(x), int(np.prod(x.shape)))
        for p, x in jax.tree_util.tree_flatten_with_path(kernels, is_leaf=q8.is_q8)[0]
    }
    assert found.pop("head/kernel")[0] is False  # the head is no projection: bf16
    # every projection as large as an 8-bit moment's minimum (k and v, 64 x 16, are smaller)
    assert {k: big >= q8.MIN_SIZE for k, (_, big) in found.items()} == {
        k: eight for k, (eight, _) in found.items()
    }
    assert sum(eight for eight, _ in found.values()) == 10  # q o gate up down, 2 layers
    # the 8-bit base's logits are those of its dequantized weights, the adapters adding zero:
    # params drawn here (B zero), split and stored as the state's init does, without compiling
    # an init of their own
    tokens = jnp.asarray(np.arange(16, dtype=np.int32).reshape(2, 8))
    rng = np.random.default_rng(0)
    draw = lambda path, s: (
        np.zeros(s.shape, np.float32)
        if precision.path_name(path).endswith("lora_b")
        else (0.05 * rng.standard_normal(s.shape)).astype(np.float32)
    )
    _, shapes = axes.declared_of(trainer.model.init, jax.random.key(0), tokens)
    drawn = jax.tree_util.tree_map_with_path(draw, shapes)
    state = adapters.split(trainer.model, trainer.policy, trainer.config, drawn)
    dequantized = jax.tree.map(
        lambda x: q8.dequantize(x).astype(jnp.bfloat16) if q8.is_q8(x) else x,
        state["frozen"],
        is_leaf=q8.is_q8,
    )
    base_model = models.create(trainer.config.model, trainer.policy)
    cast = trainer.policy.cast_params
    model_params = sharding.merge(state["params"], state["frozen"])
    got = trainer.model.apply({"params": cast(model_params)}, tokens)
    want = base_model.apply({"params": cast(dequantized)}, tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    eight = [x for x in jax.tree.leaves(state["frozen"], is_leaf=q8.is_q8) if q8.is_q8(x)]
    ratio = plan_memory.global_bytes(eight) / sum(2 * x.codes.size for x in eight)  # vs. bf16
    assert ratio == pytest.approx(q8.nbytes_per_element() / 2)  # 1 byte + 4 per 256


def test_the_head_takes_an_adapter_only_where_the_targets_name_it_and_never_in_8_bits():
    """`lora.targets` None adapts the projections, not the head (PEFT's `all-linear`); a regex
    matching `head/kernel` adds `head/lora_a` [D, r] and `head/lora_b` [r, V]; an 8-bit base
    keeps the head's kernel 16-bit; a tied head takes none (one line). Abstract: no compile."""
    plain, trainer = _init("bf16-mixed")
    assert "head" not in plain.params and lora.HEAD not in trainer.model.lora.targets
    head, trainer = _init("bf16-mixed", "q8", targets="head|attn")
    shapes = {k: v.shape for k, v in head.params["head"].items()}
    assert shapes == {"lora_a": (64, 4), "lora_b": (4, 64)}  # the model's width and vocabulary
    assert lora.HEAD in trainer.model.lora.targets
    assert lora.HEAD not in trainer.model.lora.projections
    assert not q8.is_q8(head.frozen["head"]["kernel"])
    assert sorted(head.params["stacked_layers"]) == ["attn"]  # the MLP's take none
    config = load_config("llama3", "tiny", **LORA)
    config.lora.targets = "head"
    config.model = llama_config(tie_embeddings=True)
    with pytest.raises(ValueError, match="matches only the head, which this model ties"):
        models.create(config.model, precision.get_policy("bf16-mixed"), lora=config.lora)


def test_a_head_adapter_exports_as_lm_heads_and_peft_targets_it_by_its_short_name():
    """PEFT's names for the head's factors (`lm_head.lora_A`, [r, D]; `lora_B`, [V, r]) beside
    the layers'; `target_modules` lists `lm_head` with the projections' short names."""
    from mptrain.hf import peft

    rng = np.random.default_rng(0)
    draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    adapters = {
        "head": {"lora_a": draw(48, 4), "lora_b": draw(4, 300)},
        "stacked_layers": {"attn": {"q": {"lora_a": draw(2, 48, 4), "lora_b": draw(2, 4, 64)}}},
    }
    found, fused = peft.tensors(adapters)  # a Llama's names
    head = f"{peft.PREFIX}lm_head.lora_{{}}.weight"
    np.testing.assert_array_equal(found[head.format("A")], adapters["head"]["lora_a"].T)
    np.testing.assert_array_equal(found[head.format("B")], adapters["head"]["lora_b"].T)
    assert len(found) == 2 + 2 * 2  # the head's two, q's two in each of two layers
    config = peft.adapter_config(list(found), lora.settings({"rank": 4}), None, fused)
    assert config["target_modules"] == ["lm_head", "q_proj"]


@pytest.mark.slow  # three models' programs: make test's LoRA run adapts the projections
def test_a_head_adapter_is_its_merged_kernel_in_logits_loss_and_gradients():
    """fp32, the factors drawn (B non-zero): a model with adapters on the head and attention
    gives the logits, the loss over four chunks and the adapters' gradients of the base model
    whose kernels are `W + s A B` (`lora.merged`), to fp32's rounding (1e-5). bf16-mixed with B
    at zero: the logits are the base's, bit for bit (step 0 is the base model)."""
    import ml_collections

    config = load_config("llama3", "tiny", **LORA)
    config.lora.targets, config.model = "head|attn", llama_config()
    loss = ml_collections.ConfigDict({"chunk_tokens": 4, "z_loss": 0.0})
    tokens = jnp.asarray(np.arange(32, dtype=np.int32).reshape(2, 16) * 7 % 64)
    targets = jnp.roll(tokens, -1, axis=1)
    rng = np.random.default_rng(0)

    def drawn(model, b_zero=False):
        _, shapes = axes.declared_of(model.init, jax.random.key(0), tokens)
        zero = lambda p: b_zero and precision.path_name(p).endswith("lora_b")
        draw = lambda p, s: (0 if zero(p) else 0.1) * rng.standard_normal(s.shape)
        return jax.tree_util.tree_map_with_path(lambda p, s: draw(p, s).astype(np.float32), shapes)

    fp32 = precision.get_policy("fp32")
    adapted = models.create(config.model, fp32, loss=loss, lora=config.lora)
    base = models.create(config.model, fp32, loss=loss)
    params = drawn(adapted)
    assert params["head"]["lora_b"].any()
    merged = lambda p: lora.merged(p, 8.0 / 4)
    got, want = (
        adapted.apply({"params": params}, tokens),
        base.apply({"params": merged(params)}, tokens),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    loss_of = lambda model, f: (
        lambda p: model.apply({"params": f(p)}, tokens, targets=targets)["loss"]
    )
    got, got_grads = jax.value_and_grad(loss_of(adapted, lambda p: p))(params)
    want, want_grads = jax.value_and_grad(loss_of(base, merged))(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    adapters = lambda g: frozen.split(g, lora.is_adapter)[0]
    for path, x in jax.tree_util.tree_flatten_with_path(adapters(want_grads))[0]:
        mine = adapters(got_grads)
        for key in path:
            mine = mine[key.key]
        np.testing.assert_allclose(mine, x, rtol=1e-4, atol=1e-6, err_msg=str(path))
    assert np.abs(got_grads["head"]["lora_b"]).max() > 0
    bf16 = precision.get_policy("bf16-mixed")
    adapted = models.create(config.model, bf16, lora=config.lora)
    base = models.create(config.model, bf16)
    params = bf16.cast_params(drawn(adapted, b_zero=True))
    got = adapted.apply({"params": params}, tokens)
    want = base.apply({"params": frozen.split(params, lora.is_adapter)[1]}, tokens)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_exports_merge_in_fp32_or_write_a_peft_adapter_under_peft_names(tuned, tmp_path):
    from mptrain import export, hf

    final, scale = tuned["final"], 8.0 / 4
    export.export(tuned["workdir"], tmp_path / "hf", dtype="float32", format="hf")
    export.export(tuned["workdir"], tmp_path / "peft", dtype="float32", format="peft")
    # merged: the stored (bf16) base plus scale * A B, in fp32, rounded once
    _, weights = hf.load(tmp_path / "hf")
    q = final.model_params["stacked_layers"]["attn"]["q"]
    a, b = (np.asarray(q[k], np.float32) for k in ("lora_a", "lora_b"))
    want = np.asarray(q["kernel"], np.float32) + scale * np.einsum("lir,lro->lio", a, b)
    np.testing.assert_allclose(weights["stacked_layers"]["attn"]["q"]["kernel"], want, rtol=1e-6)
    assert not np.array_equal(want, np.asarray(q["kernel"], np.float32))  # the adapters moved
    # PEFT: torch's [r, in] and [out, r] under the wrapper's names, the config PEFT reads
    tensors = safetensors.numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"
    np.testing.assert_array_equal(tensors[name.format("A")], a[1].T)
    np.testing.assert_array_equal(tensors[name.format("B")], b[1].T)
    assert len(tensors) == 2 * 7 * 2  # two factors, seven projections, two layers
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["base_model_name_or_path"] == str(tuned["folder"])
    assert sorted(config["target_modules"]) == sorted(
        f"{n}_proj" for n in ("q", "k", "v", "o", "gate", "up", "down")
    )
    # the base folder moved (sweep 2026-12-06, X17): the adapters are all in the checkpoint,
    # so the PEFT folder is the same; the merge, which needs the base, names init_from
    moved = Path(shutil.copytree(tuned["workdir"], tmp_path / "moved"))
    saved = json.loads((moved / "config.json").read_text())
    saved["init_from"] = str(tmp_path / "gone")
    (moved / "config.json").write_text(json.dumps(saved))
    export.export(moved, tmp_path / "peft-moved", dtype="float32", format="peft")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        again = (tmp_path / "peft-moved" / name).read_bytes()
        assert again == (tmp_path / "peft" / name).read_bytes().replace(
            str(tuned["folder"]).encode(), str(tmp_path / "gone").encode()
        )
    with pytest.raises(errors.ConfigError, match=r"config.init_from=.*gone.*: no such folder"):
        export.export(moved, tmp_path / "hf-moved", dtype="float32", format="hf")


@pytest.mark.slow  # a second model: make test's are the Llama's, scanned and not
def test_transformer_lm_takes_adapters_on_its_projections_and_starts_as_its_base():
    config = load_config("default", **LORA)
    trainer = trainer_lib.Trainer(config, "/nonexistent")
    batch = {"inputs": np.zeros((2, 8), np.int32), "targets": np.zeros((2, 8), np.int32)}
    state = trainer.init_state(batch)
    adapted = {
        precision.path_name(p).rsplit("/", 1)[0]
        for p, _ in jax.tree_util.tree_leaves_with_path(state.params)
    }
    assert adapted == {
        f"block_{i}/{m}" for i in range(config.model.num_layers)
        for m in ("attn/qkv", "attn/out", "mlp/fc_in", "mlp/fc_out")
    }  # fmt: skip
    base_model = models.create(config.model, trainer.policy)
    tokens = jnp.asarray(np.arange(16, dtype=np.int32).reshape(2, 8))
    cast = trainer.policy.cast_params
    got = trainer.model.apply({"params": cast(state.model_params)}, tokens)
    want = base_model.apply({"params": cast(state.frozen)}, tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_gives_the_bytes_of_an_uninterrupted_run(tuned, tmp_path):
    import random
    import signal
    import subprocess
    import sys
    import time

    from helpers import (
        ROOT,
        assert_trees_bytes_equal,
        checkpoint_steps_on_disk,
        fake_cpu_env,
        plain_orbax_state,
    )

    more = {"checkpoint_every_steps": 2, "log_every_steps": 2, **LORA}
    flags = overrides(tuned["text"], tuned["config"].data.cache_dir, steps=40, more=more)
    command = lambda workdir: [
        sys.executable, "-m", "mptrain.main", hf_flag(tuned["folder"]), f"--workdir={workdir}",
        *flags,
    ]  # fmt: skip
    env, rng, crashed, kills = fake_cpu_env(1), random.Random(1), tmp_path / "crashed", []
    saved = lambda: max(checkpoint_steps_on_disk(crashed), default=0)
    while not kills:  # one kill: each costs a process start, the resume is what is tested
        before = saved()
        proc = subprocess.Popen(command(crashed), cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while saved() == before and proc.poll() is None:  # until it has saved a step more
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))  # mid-run: between saves, or during one
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills.append(saved())
    assert kills, "no kill landed before the run finished"
    for workdir in (crashed, tmp_path / "straight"):
        done = subprocess.run(command(workdir), cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    straight = plain_orbax_state(tmp_path / "straight", 40)
    assert_trees_bytes_equal(straight, plain_orbax_state(crashed, 40))
    assert "frozen" not in straight or not jax.tree.leaves(straight["frozen"])
    print(f"killed with checkpoints of steps {kills} on disk")
