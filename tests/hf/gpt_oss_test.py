"""gpt-oss (issue 73) from a folder transformers made itself (`tests/hf/make_fixture.py
--families --only=gpt_oss`): two layers, sliding (16) and full, attention sinks, q, k, v and o
biased, YaRN as gpt-oss has it (not truncated); 8 experts of 16, top 2, the router's logits
biased, each expert's gate, up and down biased (stored fused, gate and up interleaved), the
SwiGLU clamped at 1. Read by `mptrain.hf` into the one decoder: fp32 logits, the load-balancing
loss and greedy decoding against transformers', each switch shown to matter, bf16-mixed in the
band, the folder written back; a folder of MXFP4 experts (as gpt-oss ships) dequantised on
load to transformers' logits."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hf.hf_test import BF16_BOUND, _decodes_as_generate, _error, _fine_tune, _reference
from hf.hf_test import _logits as logits_of

from mptrain import errors, hf
from mptrain.models import decoder as llama

FOLDER = Path(__file__).parent / "families" / "gpt_oss"
MXFP4 = FOLDER.parent / "gpt_oss-mxfp4"  # its experts as gpt-oss's checkpoints ship them
SLOW = pytest.mark.slow
READ = {
    "family": "gpt_oss",
    "attn_bias": "all",
    "attn_sinks": True,
    "sliding_window": 16,
    "layer_types": (llama.SLIDING, llama.FULL),
    "num_experts": 8,
    "experts_per_token": 2,
    "expert_d_ff": 16,
    "norm_topk_prob": True,
    "router_logit_bias": True,
    "expert_bias": True,
    "swiglu_limit": 1.0,
    "swiglu_alpha": 1.702,
    "router_aux_loss_coef": 0.01,
}


def _with(params, module, **leaves):
    """`params` with the stack's `module` ("attn", "moe") given `leaves` (None: dropped)."""
    stack = params["stacked_layers"]
    changed = {k: v for k, v in {**stack[module], **leaves}.items() if v is not None}
    return {**params, "stacked_layers": {**stack, module: changed}}


@SLOW  # make test reads and writes the folder
def test_gpt_oss_fp32_logits_and_aux_loss_are_transformers_and_each_switch_shows():
    ids, want = _reference(FOLDER)
    config, params = hf.load(FOLDER)
    assert {k: config[k] for k in READ} == READ
    assert config["rope_scaling"][:3] == ("yarn", 4.0, 16) and config["rope_scaling"][6] is False
    section = {**config, "attention": "materialized"}
    model = llama.create_model(ml_collections.ConfigDict(section), jnp.float32)

    @jax.jit
    def run(params, ids):
        variables = {"params": params}
        return model.apply(variables, ids), model.apply(variables, ids, targets=ids)

    logits, out = run(params, ids)
    assert _error(np.asarray(logits), want) < 1e-5
    aux = float(np.load(FOLDER / "reference.npz")["aux_loss"])
    np.testing.assert_allclose(float(out["moe/aux_loss"]), aux, rtol=1e-6)
    attn, moe = params["stacked_layers"]["attn"], params["stacked_layers"]["moe"]
    unbiased = {k: {"kernel": v["kernel"]} for k, v in attn.items() if k != "sinks"}
    zero = lambda *keys: {k: moe[k] * 0 for k in keys}
    switches = [
        ({"attn_sinks": False}, _with(params, "attn", sinks=None)),
        ({"attn_bias": "none"}, _with(params, "attn", **unbiased)),
        ({"sliding_window": None, "layer_types": None}, params),
        ({"rope_scaling": None}, params),
        ({"swiglu_limit": 1e6}, params),
        ({}, _with(params, "moe", **zero("router_logit_bias"))),
        ({}, _with(params, "moe", **zero("gate_bias", "up_bias", "down_bias"))),
    ]
    for overrides, p in switches:
        assert _error(logits_of(config, p, ids, **overrides), want) > 0.05, overrides
    bf16 = logits_of(config, params, ids, jnp.bfloat16)
    assert _error(bf16, want) < BF16_BOUND


@SLOW
def test_gpt_oss_greedy_decoding_is_transformers_generate(tmp_path):
    """`mptrain.generate`'s decoder (the sinks on the cache's path too; past the window of
    16 on the sliding layer), fp32, three prompts batched, 32 new tokens each."""
    _decodes_as_generate(FOLDER, tmp_path)


def test_the_gpt_oss_folder_written_back_reads_as_it_was_read(tmp_path):
    """The experts fused again as transformers stores them (gate and up interleaved in
    gate_up_proj and its bias), the sinks, the router's bias; config.json's keys."""
    config, params = hf.load(FOLDER)
    hf.save(tmp_path / "out", config, params, "float32")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((FOLDER / "config.json").read_text())
    for key in ("architectures", "num_local_experts", "intermediate_size", "swiglu_limit",
                "sliding_window", "layer_types", "attention_bias"):  # fmt: skip
        assert written[key] == source[key], key
    again, read = hf.load(tmp_path / "out")
    assert again == config
    assert jax.tree.all(jax.tree.map(np.array_equal, read, params))
    from safetensors.numpy import load_file

    theirs, ours = (load_file(f / "model.safetensors") for f in (FOLDER, tmp_path / "out"))
    assert theirs.keys() == ours.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_a_quantization_other_than_mxfp4_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.ConfigError, match=r"quant_method='gptq': mptrain reads gpt-oss"):
        hf.read_config(folder)


def test_mxfp4_experts_are_dequantised_slice_by_slice_exactly():
    """The MXFP4 folder's experts (blocks of 32 inputs a scale): a slice read alone is that
    slice of the whole, even where it starts and ends inside a block; every value is an e2m1
    code times a power of two, so a bf16 export holds them exactly."""
    from mptrain.hf import tensors

    with tensors.Reader(MXFP4) as reader:
        name = "model.layers.1.mlp.experts.gate_up_proj"
        assert name in reader.mxfp4 and reader.shape(name) == (4, 64, 64)
        whole = reader.read(name, (slice(0, 4), slice(0, 64), slice(0, 64)))
        part = reader.read(name, (slice(1, 3), slice(20, 45), slice(7, 30)))
        np.testing.assert_array_equal(part, whole[1:3, 20:45, 7:30])
    mantissa, _ = np.frexp(whole[whole != 0])
    assert set(np.abs(mantissa).tolist()) <= {0.5, 0.75}  # e2m1: 1.0 or 1.5 times 2^k
    np.testing.assert_array_equal(whole.astype(jnp.bfloat16).astype(np.float32), whole)


@SLOW
def test_an_mxfp4_folders_logits_are_transformers_dequantised_models():
    """transformers dequantises the MXFP4 experts on a CPU (to bf16: exactly); mptrain's fp32
    logits of the same folder are its fp32 ones, and the folder exports as bf16 losslessly."""
    ids, want = _reference(MXFP4)
    config, params = hf.load(MXFP4)
    assert _error(logits_of(config, params, ids), want) < 1e-5


@SLOW
def test_configs_hf_fine_tunes_gpt_oss_and_exports_it(tmp_path, capsys):
    """`configs/hf.py:DIR` on the folder, bf16-mixed, a few steps from its weights: the sinks,
    the biases and the experts move, and the export is a gpt-oss folder again (transformers'
    reading of it: scripts/hf_export_check.py; its attention's adapters are q, k, v and o as
    every family's, read by PEFT in scripts/lora_export_check.py)."""
    from mptrain import export

    _fine_tune(FOLDER, tmp_path / "run", capsys)
    export.export(tmp_path / "run", tmp_path / "out", "float32", format="hf")
    model_config, params = hf.load(tmp_path / "out")
    assert model_config["family"] == "gpt_oss"
    _, base = hf.load(FOLDER)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), params, base)
    assert all(jax.tree.leaves(moved))
