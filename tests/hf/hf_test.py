"""`mptrain.hf` against HuggingFace transformers itself, without torch: the committed folders
under `tests/hf/fixture` (written by `tests/hf/make_fixture.py`, which says how) hold a tiny
random LlamaForCausalLM (grouped-query attention, head_dim apart from width / heads, Llama 3
rope scaling with an original context of 16 that the 48 reference positions pass; and a tied
variant with plain RoPE) and the fp32 logits transformers computed for fixed ids.

The bf16-mixed bound. bf16 keeps 8 significant bits: each rounding to it moves a value by at
most 2^-9 of itself (half its 2^-8 spacing), uniformly, so by 2^-9/sqrt(3) ~ 1.1e-3 rms. A
matmul with both operands rounded and an fp32 sum of random-signed terms has a relative rms
error of about sqrt(2) * 1.1e-3 = 1.6e-3. On its way to a logit a value of this model is
rounded about 20 times (per layer: the normed input, q, k, v, the attention weights, the
context, the MLP's input and its gated product, with the kernels; then the final norm and the
head), independently, so sqrt(20) * 1.6e-3 ~ 0.7% rms, which the network's gain roughly
doubles: rounding only the weights (fp32 compute) already moves the logits by 1.45% of their
largest value. Measured: 1.78% (untied) and 1.58% (tied) of the largest |logit| at worst,
1.2% rms. The bound asserted is 4% of the largest |logit|, twice the worst case measured, and
a 20th of what a wrong q/k order (75%, 98%) or ignored rope scaling (89%) does, so it still
tells a right load from a wrong one.
"""

import json
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from helpers import ROOT, needs_devices, run_cli
from jax.sharding import Mesh

from mptrain import errors, hf
from mptrain.hf import tensors as hf_io
from mptrain.models import decoder as llama
from mptrain.parallel import axes, sharding
from mptrain.recipe import precision

FIXTURE = Path(__file__).parent / "fixture"
FOLDERS = {"untied": FIXTURE, "tied": FIXTURE / "tied"}
BF16_BOUND = 0.04  # of the largest |logit|: the module doc says why


def _reference(folder):
    ref = np.load(folder / "reference.npz")
    return ref["ids"], ref["logits"]


def _logits(model_config, params, ids, compute_dtype=jnp.float32, **overrides):
    section = ml_collections.ConfigDict({**model_config, "attention": "materialized", **overrides})
    model = llama.create_model(section, compute_dtype)
    return np.asarray(jax.jit(model.apply)({"params": params}, ids))


def _error(got, want):
    """The largest difference, as a fraction of the largest |reference logit|."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def _decodes_as_generate(folder, tmp_path):
    """What `python -m mptrain.generate --hf=DIR` decodes from `folder` (a tokenizer put beside
    it), fp32, three prompts batched (5, 12 and 9 tokens), 32 new tokens each: transformers'
    `generate.npz` token for token."""
    from generate_test import _with_tokenizer

    from mptrain import generate
    from mptrain.models.decoder import decode

    folder = _with_tokenizer(folder, tmp_path / folder.name)
    want = np.load(folder / "generate.npz")
    speaker = generate.load(hf_folder=str(folder), precision="fp32")
    run = decode.make_decoder(speaker.model, want["tokens"].shape[1])
    greedy, none = decode.Sampling().values(), decode.stops([])
    out = run(speaker.params, want["prompts"], want["lengths"], greedy, 0, none)
    np.testing.assert_array_equal(np.asarray(out), want["tokens"])


FINE_TUNE = [  # a few steps of `configs/hf.py:DIR`, one checkpoint at the end
    "--config.num_train_steps=4", "--config.data.seq_len=48", "--config.batch_size=2",
    "--config.checkpoint_every_steps=4", "--config.eval_every_steps=4", "--config.eval_steps=1",
]  # fmt: skip


def _fine_tune(folder, workdir, capsys, *flags):
    """`configs/hf.py:DIR` from `folder` for `FINE_TUNE`'s steps (and `flags`), in-process."""
    config = f"--config={ROOT / 'configs' / 'hf.py'}:{folder}"
    code, err = run_cli(workdir, *FINE_TUNE, *flags, config=config, capsys=capsys)
    assert code == 0, err[-2000:]


def _copy(folder, tmp_path):
    out = tmp_path / folder.name
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("tied"))
    return out


def _edit_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _bits(tree):
    return jax.tree.map(lambda a: np.asarray(a).view(np.uint32), tree)


def _same(a, b):
    """Bit for bit, leaf by leaf."""
    return jax.tree.all(jax.tree.map(np.array_equal, _bits(a), _bits(b)))


def _interleaved(params, model_config):
    """q and k as a converter that permutes HF's rotate-half order to interleaved pairs (as
    torchtitan and MaxText must, for their RoPE) would hand them to this model."""
    dh = model_config["head_dim"]
    order = np.stack([np.arange(dh // 2), np.arange(dh // 2, dh)], 1).reshape(-1)

    def permute(kernel):
        return kernel.reshape(*kernel.shape[:-1], -1, dh)[..., order].reshape(kernel.shape)

    stack = params[sharding.STACKED]
    attn = {**stack["attn"], "q": {"kernel": permute(stack["attn"]["q"]["kernel"])}}
    attn["k"] = {"kernel": permute(stack["attn"]["k"]["kernel"])}
    return {**params, sharding.STACKED: {**stack, "attn": attn}}


# ---- transformers' logits -----------------------------------------------------------------


@pytest.mark.slow  # a variant: make test keeps the bf16 logits' bound against transformers
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_loaded_weights_give_transformers_fp32_logits(variant, scan_layers):
    folder = FOLDERS[variant]
    ids, want = _reference(folder)
    model_config, params = hf.load(folder, scan_layers=scan_layers)
    assert model_config["tie_embeddings"] == (variant == "tied")
    model = llama.create_model(
        ml_collections.ConfigDict({**model_config, "scan_layers": scan_layers})
    )
    init = axes.unboxed(jax.eval_shape(model.init, jax.random.key(0), ids)["params"])
    assert jax.tree.structure(init) == jax.tree.structure(params)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(
        lambda a: (a.shape, a.dtype), init
    )
    got = _logits(model_config, params, ids, scan_layers=scan_layers)
    assert _error(got, want) < 1e-5


def test_the_loaded_config_as_it_comes_builds_the_folders_model():
    """`hf.load` gives the model's config as a plain dict; `create_model` reads it as it reads
    a ConfigDict (issue 42: it read attributes only, and built a default-sized model)."""
    ids, want = _reference(FIXTURE)
    model_config, params = hf.load(FIXTURE)
    assert isinstance(model_config, dict)
    model = llama.create_model(model_config)
    _, init = axes.declared_of(model.init, jax.random.key(0), ids)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    assert shapes(init) == shapes(params)
    assert _error(np.asarray(jax.jit(model.apply)({"params": params}, ids)), want) < 1e-5
    defaults = {"d_model": 1, "vocab_size": 2, "absent": 3}
    as_dict = errors.settings(model_config, defaults)
    assert as_dict == errors.settings(ml_collections.ConfigDict(model_config), defaults)
    assert as_dict["d_model"] == model_config["d_model"] and as_dict["absent"] == 3


@pytest.mark.parametrize(
    "variant",
    ["untied", pytest.param("tied", marks=pytest.mark.slow)],  # a variant
)
def test_bf16_mixed_logits_stay_within_the_stated_bound(variant):
    folder = FOLDERS[variant]
    ids, want = _reference(folder)
    model_config, params = hf.load(folder)
    cast = precision.get_policy("bf16-mixed").cast_params(params)  # kernels bf16, norms fp32
    assert cast[sharding.STACKED]["attn"]["q"]["kernel"].dtype == jnp.bfloat16
    got = _logits(model_config, cast, ids, jnp.bfloat16)
    error = _error(got, want)
    assert 1e-3 < error < BF16_BOUND, error  # bf16 did run, and stayed within the bound


@pytest.mark.slow  # a variant: make test keeps the bf16 logits against transformers
def test_the_fixture_tells_a_wrong_qk_order_and_ignored_rope_scaling_apart():
    """What the fixture is for: loaders that get either detail wrong still run, and give
    logits far outside even the bf16 bound."""
    for folder in FOLDERS.values():
        ids, want = _reference(folder)
        model_config, params = hf.load(folder)
        wrong = _logits(model_config, _interleaved(params, model_config), ids)
        assert _error(wrong, want) > 10 * BF16_BOUND, folder
    ids, want = _reference(FIXTURE)
    model_config, params = hf.load(FIXTURE)
    assert model_config["rope_scaling"] == (8.0, 1.0, 4.0, 16)
    unscaled = _logits({**model_config, "rope_scaling": None}, params, ids)
    assert _error(unscaled, want) > 10 * BF16_BOUND


# ---- config.json's two forms ---------------------------------------------------------------


def _to_v5(config):
    rope = config.pop("rope_scaling") or {"rope_type": "default"}
    config["rope_parameters"] = {**rope, "rope_theta": config.pop("rope_theta")}


def _to_v4(config, type_key="rope_type"):
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {type_key: kind, **rope}


def _legacy_type_key(config):  # early Llama 3.1 configs: "type" where later ones say "rope_type"
    config["rope_scaling"]["type"] = config["rope_scaling"].pop("rope_type")


@pytest.mark.parametrize(
    ("variant", "rewrite", "form"),
    [
        ("untied", _to_v5, "rope_parameters"),
        ("tied", _to_v4, "rope_theta"),
        ("untied", _legacy_type_key, "rope_scaling"),
    ],
    ids=["4.x_as_5.x", "5.x_as_4.x", "4.x_legacy_type_key"],
)
def test_both_config_forms_read_the_same(variant, rewrite, form, tmp_path):
    folder = _copy(FOLDERS[variant], tmp_path)
    _edit_config(folder, rewrite)
    assert form in json.loads((folder / "config.json").read_text())
    want_config, want = hf.load(FOLDERS[variant])
    got_config, got = hf.load(folder)
    assert got_config == want_config
    assert _same(got, want)


# ---- sharded and 16-bit files, save ------------------------------------------------------


def test_save_then_load_is_bit_identical_in_fp32_from_any_layout(tmp_path):
    model_config, params = hf.load(FIXTURE)
    _, unscanned = hf.load(FIXTURE, scan_layers=False)
    as_jax = jax.tree.map(jnp.asarray, unscanned)
    for name, tree in (("scanned", params), ("unscanned_jax", as_jax)):
        hf.save(tmp_path / name, model_config, tree, "float32")
        got_config, got = hf.load(tmp_path / name)
        assert got_config == model_config
        assert _same(got, params), name
    config = json.loads((tmp_path / "scanned" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in config


def test_sharded_folders_are_read_and_written_with_an_index(tmp_path):
    model_config, params = hf.load(FIXTURE)
    hf.save(tmp_path, model_config, params, "float32", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == files
    sizes = {f: (tmp_path / f).stat().st_size for f in files}
    assert all(size < 60_000 + 20_000 for size in sizes.values()), sizes  # + header, one tensor
    total = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(params))
    assert index["metadata"]["total_size"] == total
    _, got = hf.load(tmp_path)
    assert _same(got, params)
    hf.save(tmp_path, model_config, params, "float32")  # saved again in one file: no stale shards
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_saved_files_get_the_modes_the_umask_gives(tmp_path):
    model_config, params = hf.load(FIXTURE)
    previous = os.umask(0o022)
    try:
        hf.save(tmp_path / "out", model_config, params, max_shard_bytes=60_000)
    finally:
        os.umask(previous)
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()} == {0o644}


def _bf16_bits(x):
    """Round-to-nearest-even to bf16, on the integer bits (an independent reference)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_a_bf16_export_is_round_to_nearest_even_of_the_fp32_masters(tmp_path):
    model_config, params = hf.load(FIXTURE)
    # Exact halfway cases, which must go to the even neighbour, and one just above.
    ties = np.array([0x3F808000, 0x3F818000, 0xBF818000, 0x3F80C000], np.uint32).view(np.float32)
    params["embed"]["embedding"][0, :4] = ties
    hf.save(tmp_path, model_config, params)  # bfloat16 by default
    stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    embedding = stored["model.embed_tokens.weight"]
    assert embedding.dtype == jnp.bfloat16
    assert list(embedding[0, :4].view(np.uint16)) == [0x3F80, 0x3F82, 0xBF82, 0x3F81]
    q = stored["model.layers.1.self_attn.q_proj.weight"]
    master = params[sharding.STACKED]["attn"]["q"]["kernel"][1].T
    assert np.array_equal(q.view(np.uint16), _bf16_bits(master))
    # Read back, each bf16 value becomes its fp32 value exactly.
    _, got = hf.load(tmp_path)
    want = jax.tree.map(lambda a: _bf16_bits(a).astype(np.uint32) << 16, params)
    assert jax.tree.all(jax.tree.map(np.array_equal, _bits(got), want))
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_float16_files_load_exactly_and_an_out_of_range_export_is_refused(tmp_path):
    model_config, params = hf.load(FIXTURE)
    hf.save(tmp_path / "f16", model_config, params, "float16")
    _, got = hf.load(tmp_path / "f16")
    want = jax.tree.map(lambda a: a.astype(np.float16).astype(np.float32), params)
    assert _same(got, want)
    params["final_norm"]["scale"][3] = 1e5
    with pytest.raises(errors.ConfigError, match=r"params/final_norm/scale: \|value\| 100000"):
        hf.save(tmp_path / "big", model_config, params, "float16")


def test_save_refuses_params_that_disagree_with_the_model_config(tmp_path):
    model_config, params = hf.load(FIXTURE)
    untied = {k: v for k, v in params.items() if k != "head"}
    with pytest.raises(errors.ConfigError, match="params/head/kernel: missing"):
        hf.save(tmp_path, model_config, untied)
    with pytest.raises(
        errors.ConfigError,
        match=r"params/embed/embedding: shape \[300, 48\], but the model config needs \[256, 48\]",
    ):
        hf.save(tmp_path, {**model_config, "vocab_size": 256}, params)
    with pytest.raises(errors.ConfigError, match="only llama maps onto a HuggingFace folder"):
        hf.save(tmp_path, {**model_config, "name": "transformer_lm"}, params)
    assert not list(tmp_path.iterdir())  # nothing written


# ---- what cannot be read: one line naming the file and the key or tensor ------------------


def _tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def _cut(folder, keep):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:keep])


Q1 = "model.layers.1.self_attn.q_proj.weight"
BAD = {
    "gpt2": (
        lambda f: _edit_config(f, lambda c: c.update(architectures=["GPT2LMHeadModel"])),
        r"config.json: architectures=\['GPT2LMHeadModel'\]: mptrain.hf reads LlamaForCausalLM, "
        r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ),
    "yarn": (  # (the sweep's case: YaRN is read now; dynamic scaling is what stays refused)
        lambda f: _edit_config(f, lambda c: c["rope_scaling"].update(rope_type="dynamic")),
        r"config.json: rope_scaling.rope_type='dynamic': not implemented; its frequencies",
    ),
    "missing_key": (
        lambda f: _edit_config(f, lambda c: c.pop("hidden_size")),
        r"config.json: no 'hidden_size'",
    ),
    "missing_rope_key": (
        lambda f: _edit_config(f, lambda c: c["rope_scaling"].pop("low_freq_factor")),
        r"config.json: no rope_scaling.low_freq_factor",
    ),
    "missing_tensor": (
        lambda f: _tensors(f, lambda t: t.pop(Q1)),
        rf"model.safetensors: no tensor {Q1}",
    ),
    "wrong_shape": (
        lambda f: _tensors(f, lambda t: t.update({Q1: np.zeros((32, 48), np.float32)})),
        rf"model.safetensors: tensor {Q1} has shape \[32, 48\], but "
        r"params/stacked_layers/attn/q/kernel \[2, 48, 64\] needs \[64, 48\]",
    ),
    "a_bias": (
        lambda f: _tensors(f, lambda t: t.update({Q1[:-6] + "bias": np.zeros(64, np.float32)})),
        r"tensor model.layers.1.self_attn.q_proj.bias has no place in the model",
    ),
    "truncated": (lambda f: _cut(f, 200_000), r"model.safetensors: not a readable safetensors"),
    "garbage": (
        lambda f: (f / "model.safetensors").write_bytes(b"<html>not found</html>"),
        r"model.safetensors: not a readable safetensors file",
    ),
    "no_weights": (
        lambda f: (f / "model.safetensors").unlink(),
        r"no \*.safetensors files",
    ),
    # there but not readable (issue 42, A54: a file of mode 000 was "No such file"): the reason
    # open() gives; a folder stands in for the unreadable file, which root could still read
    "unreadable": (
        lambda f: ((f / "model.safetensors").unlink(), (f / "model.safetensors").mkdir()),
        r"model.safetensors: cannot be read: Is a directory",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_folders_are_one_line_naming_the_file_and_what_is_wrong(case, tmp_path):
    folder = _copy(FIXTURE, tmp_path)
    breaks, message = BAD[case]
    breaks(folder)
    with pytest.raises(errors.ConfigError, match=message) as caught:
        hf.load(folder)
    assert "\n" not in str(caught.value) and str(folder) in str(caught.value)
    assert caught.value.exit_code == 2


# The config-time cases through the documented command line: `configs/llama3.py:hf=DIR` reads
# DIR/config.json while config_flags loads the file, and the cause must survive its wrapping
# (issue 42, sweep cases A02 no_config, A03 bad_json, A05 gpt2, A07 missing_key, A11 yarn, A13
# hidden_negative, A14 vocab_zero, A17 hidden_string, A48 a_file, A49 a_loop, A50 empty, A51
# no_folder, A53 unreadable; A09, A10 kv_heads).
CONFIG_TIME = {
    **{case: BAD[case] for case in ("gpt2", "yarn", "missing_key")},
    "no_folder": (lambda f: shutil.rmtree(f), r"fixture: no such file"),
    "no_config": (lambda f: (f / "config.json").unlink(), r"config.json: no such file"),
    "bad_json": (
        lambda f: (f / "config.json").write_text('{"hidden_size": 64,'),
        r"config.json: not readable JSON",
    ),
    "empty": (lambda f: (shutil.rmtree(f), f.mkdir()), r"fixture/config.json: no such file"),
    "a_file": (lambda f: (shutil.rmtree(f), f.write_text("x")), r"fixture: not readable JSON"),
    "a_loop": (
        lambda f: (shutil.rmtree(f), f.symlink_to(f)),
        r"fixture: not readable JSON: .*Too many levels of symbolic links",
    ),
    # a config.json that is there but cannot be read (A53 ran as another user; root reads any
    # file, so a folder stands in for it): the reason open() gives
    "unreadable": (
        lambda f: ((f / "config.json").unlink(), (f / "config.json").mkdir()),
        r"config.json: not readable JSON: .*Is a directory",
    ),
    "hidden_negative": (
        lambda f: _edit_config(f, lambda c: c.update(hidden_size=-64)),
        r"hidden_size=-64: must be an integer >= 1",
    ),
    "vocab_zero": (
        lambda f: _edit_config(f, lambda c: c.update(vocab_size=0)),
        r"vocab_size=0: must be an integer >= 1",
    ),
    "hidden_string": (
        lambda f: _edit_config(f, lambda c: c.update(hidden_size="64")),
        r"hidden_size='64': must be an integer >= 1",
    ),
    # a value the model's own rules refuse names the file it came from (A09, A10)
    "kv_heads": (
        lambda f: _edit_config(f, lambda c: c.update(num_key_value_heads=3)),
        r"config.json: config.model.num_kv_heads=3: must divide model.num_heads=4",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_TIME))
def test_a_bad_folder_through_the_command_line_keeps_its_cause(case, tmp_path, capsys):
    folder = _copy(FIXTURE, tmp_path)
    breaks, message = CONFIG_TIME[case]
    breaks(folder)
    config = f"--config={ROOT / 'configs' / 'llama3.py'}:hf={folder}"
    code, err = run_cli(tmp_path / "run", capsys=capsys, config=config)
    assert code == 2 and not (tmp_path / "run").exists()
    (line,) = err.strip().splitlines()
    assert line.startswith("mptrain: error: --config=") and "Error whilst parsing" not in line
    assert re.search(message, line), line


def test_an_index_naming_a_missing_shard_is_one_line(tmp_path):
    model_config, params = hf.load(FIXTURE)
    hf.save(tmp_path, model_config, params, "float32", max_shard_bytes=60_000)
    (tmp_path / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(errors.ConfigError, match=r"model-00002-of-00005.safetensors: no such"):
        hf.load(tmp_path)


def test_is_hf_folder(tmp_path):
    assert hf.is_hf_folder(FIXTURE) and hf.is_hf_folder(FIXTURE / "tied")
    (tmp_path / "config.json").write_text("{}")
    assert not hf.is_hf_folder(tmp_path)  # no weights
    assert not hf.is_hf_folder(FIXTURE / "config.json") and not hf.is_hf_folder(tmp_path / "x")


# ---- straight into shardings, reading slices ----------------------------------------------


class _Counted:
    """A safetensors handle that logs every read: (tensor, bytes, whole tensor's bytes)."""

    def __init__(self, handle, log):
        self.handle, self.log = handle, log

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        raise AssertionError(f"read {name} whole")

    def get_slice(self, name):
        view, log = self.handle.get_slice(name), self.log

        class Slice:
            get_shape, get_dtype = view.get_shape, view.get_dtype

            def __getitem__(self, index):
                out = view[index]
                whole = int(np.prod(view.get_shape())) * out.itemsize
                log.append((name, out.nbytes, whole))
                return out

        return Slice()


@needs_devices(8)
def test_load_params_reads_each_devices_slice_once_into_the_targets_shardings(monkeypatch):
    _, want = hf.load(FIXTURE)
    mesh = Mesh(
        np.asarray(jax.devices()[:8]).reshape(2, 4, 1, 1, 1), sharding.AXES
    )  # data 2, fsdp 4
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), want)
    model = llama.create_model(hf.read_config(FIXTURE))
    declared, _ = axes.declared_of(model.init, jax.random.key(0), _reference(FIXTURE)[0])
    where = sharding.state_shardings(mesh, shapes, declared)
    target = jax.tree.map(
        lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w), shapes, where
    )
    log = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _Counted(real(*a, **k), log))
    got = hf.load_params(FIXTURE, target)
    for g, w, s in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(where), strict=True
    ):
        assert g.sharding == s and g.dtype == jnp.float32
        assert np.array_equal(np.asarray(g), w)
    # Every param is split 4 ways here: each read is a quarter of a tensor (a layer's, for the
    # stack), and each byte is read once, though two devices hold each shard.
    assert all(nbytes * 4 == whole for _, nbytes, whole in log), log
    assert sum(nbytes for _, nbytes, _ in log) == sum(a.nbytes for a in jax.tree.leaves(want))
    # bf16 targets (bf16-pure): the masters rounded to nearest even, in those shardings.
    target16 = jax.tree.map(lambda t: t.update(dtype=jnp.bfloat16), target)
    got16 = hf.load_params(FIXTURE, target16)
    for g, w in zip(jax.tree.leaves(got16), jax.tree.leaves(want), strict=True):
        assert g.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(g).view(np.uint16), _bf16_bits(w))


def test_load_params_refuses_a_target_that_disagrees_naming_both_shapes():
    _, params = hf.load(FIXTURE)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    target["embed"]["embedding"] = jax.ShapeDtypeStruct((256, 48), jnp.float32)
    with pytest.raises(
        errors.ConfigError,
        match=r"model.safetensors: tensor model.embed_tokens.weight has shape \[300, 48\], but "
        r"params/embed/embedding \[256, 48\] needs \[256, 48\]",
    ):
        hf.load_params(FIXTURE, target)
    with pytest.raises(errors.ConfigError, match="scan_layers=False: the target's params are"):
        hf.load_params(FIXTURE, target, scan_layers=False)


def test_the_tiled_transpose_is_numpys_for_shapes_that_are_not_whole_tiles():
    part = np.random.default_rng(0).normal(size=(300, 1100)).astype(jnp.bfloat16)
    out = np.empty((1100, 300), np.float32)
    hf_io.transpose_into(out, part)
    assert np.array_equal(out, part.T.astype(np.float32))
