"""A LoRA run's adapters as a PEFT adapter folder, which `peft` loads onto the base HF folder.

PEFT's layout: `adapter_config.json` (`peft_type` "LORA", `task_type` "CAUSAL_LM", `r`,
`lora_alpha`, `lora_dropout`, `target_modules`, `base_model_name_or_path`, ...) and
`adapter_model.safetensors`, one pair of tensors per adapted projection, named after the
projection's weight in the base (`model.layers.3.self_attn.q_proj.weight`) under the wrapper's
prefix: `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (`[r, in]`, torch's
layout: mptrain's `lora_a` `[in, r]` transposed) and `...lora_B.weight` (`[out, r]`). PEFT
scales by `lora_alpha / r`, as mptrain does, so the numbers carry over unchanged.

A family whose base fuses projections (Phi-3's `qkv_proj`, `gate_up_proj`) has one adapter
on the fused module, where mptrain has one a part: the parts' `lora_A` stacked (`[parts x r,
in]`) and their `lora_B` placed block-diagonally (`[out, parts x r]`, zeros elsewhere) give
exactly the sum of the parts' updates, each in its own rows. The fused module's rank is then
`parts x r`, and PEFT's `rank_pattern` and `alpha_pattern` say so, its alpha scaled with it so
that `lora_alpha / r` stays the run's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from mptrain import errors, files
from mptrain.hf import names
from mptrain.models import lora as lora_lib
from mptrain.recipe import precision

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # what PEFT's wrapper puts before the base model's names
_FACTORS = {"lora_a": "lora_A", "lora_b": "lora_B"}
_DENSE_MLP = re.compile(r"\.mlp\.(gate|up|down)_proj\.lora_")  # PEFT's renamed targets


def tensors(adapters: Any, c: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """PEFT's tensors (by name) of `adapters` (a LoRA model's adapter params, numpy), for the
    decoder's checked settings `c`; and `{fused module: how many parts' adapters}`."""
    out, fused = {}, {}
    for path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        keys = tuple(precision.path_name(path).split("/"))
        x = np.asarray(x)
        kernel = names.leaf((*keys[:-1], "kernel"), x.shape, c)  # the projection's HF names
        slices = list(x) if kernel.stacked else [x]
        for name, part in zip(kernel.names, slices, strict=True):
            key = f"{PREFIX}{name.removesuffix('.weight')}.{_FACTORS[keys[-1]]}.weight"
            if kernel.rows is None:
                out[key] = np.ascontiguousarray(part.T)
            else:  # a part of a fused module: its block of A, its rows of B (the module doc)
                fused.setdefault(key, []).append((kernel.rows, part.T))
    parts_of = {}
    for key, parts in fused.items():
        parts.sort(key=lambda p: p[0][0])
        if key.endswith("lora_A.weight"):  # [r, in] each
            # C order: concatenating transposed (F-ordered) parts gives an F-ordered array,
            # whose bytes safetensors would write as they lie
            out[key] = np.ascontiguousarray(np.concatenate([p for _, p in parts]))
            continue
        r = parts[0][1].shape[1]  # [rows, r] each
        out[key] = np.zeros((parts[0][0][2], r * len(parts)), parts[0][1].dtype)
        for i, ((start, stop, _), p) in enumerate(parts):
            out[key][start:stop, i * r : (i + 1) * r] = p
        parts_of[key.removeprefix(PREFIX).rsplit(".", 2)[0]] = len(parts)
    return out, parts_of


def adapter_config(
    names: list[str], settings: dict, base: str | None, fused: dict | None = None
) -> dict[str, Any]:
    """`adapter_config.json` for the tensors `names`: `target_modules` lists the projections'
    short names (`q_proj`, ...) when every layer has the same ones, else is a regex (PEFT
    full-matches a string against each module's name) of exactly the adapted modules."""
    modules = sorted({n.removeprefix(PREFIX).rsplit(".", 2)[0] for n in names})
    inside = [m for m in modules if re.search(r"layers\.\d+\.", m)]  # outside: lm_head
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    layer_ids = {re.search(r"layers\.(\d+)\.", m)[1] for m in inside}
    every = len(inside) == len({m.rsplit(".", 1)[-1] for m in inside}) * len(layer_ids)
    targets = short if every else "|".join(re.escape(m) for m in modules)
    r, alpha = settings["rank"], settings["alpha"]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings["rank"],
        "lora_alpha": settings["alpha"],
        "lora_dropout": settings["dropout"],
        "target_modules": targets,
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        # a fused module's adapter: its parts' ranks together, alpha with them (the module doc)
        # (PEFT matches a key against a module name's end, after a dot)
        "rank_pattern": {re.escape(m): r * n for m, n in (fused or {}).items()},
        "alpha_pattern": {re.escape(m): alpha * n for m, n in (fused or {}).items()},
    }


def save(folder: Path, adapters: Any, lora: Any, base: str | None, c: dict | None = None) -> int:
    """Writes the PEFT folder's two files into `folder` (the adapters in the dtype they come
    in), for the decoder's checked settings `c`. Returns how many values they hold."""
    found, fused = tensors(adapters, c)
    dense = [n for n in found if _DENSE_MLP.search(n)]
    if c is not None and c["num_experts"] and dense:
        module = dense[0].removeprefix(PREFIX).rsplit(".", 2)[0]
        raise errors.ConfigError(
            f"{module}: an adapter on a dense layer's MLP in a mixture of experts, which PEFT "
            "(0.18 on, under transformers 5) loads onto the experts' fused gate_up_proj and "
            "down_proj instead (it renames gate_proj, up_proj and down_proj targets of such "
            "models); export --format=hf (merged), or train with lora.targets leaving out mlp/"
        )
    config = adapter_config(list(found), lora_lib.settings(lora), base, fused)
    safetensors.numpy.save_file(found, str(folder / WEIGHTS_FILE), {"format": "pt"})
    files.write_json(folder / CONFIG_FILE, config)
    return sum(x.size for x in found.values())
