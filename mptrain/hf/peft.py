"""A LoRA run's adapters as a PEFT adapter folder, which `peft` loads onto the base HF folder.

PEFT's layout: `adapter_config.json` (`peft_type` "LORA", `task_type` "CAUSAL_LM", `r`,
`lora_alpha`, `lora_dropout`, `target_modules`, `base_model_name_or_path`, ...) and
`adapter_model.safetensors`, one pair of tensors per adapted projection, named after the
projection's weight in the base (`model.layers.3.self_attn.q_proj.weight`) under the wrapper's
prefix: `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (`[r, in]`, torch's
layout: mptrain's `lora_a` `[in, r]` transposed) and `...lora_B.weight` (`[out, r]`). PEFT
scales by `lora_alpha / r`, as mptrain does, so the numbers carry over unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from mptrain import files
from mptrain.hf import _leaf
from mptrain.models import lora as lora_lib
from mptrain.recipe import precision

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # what PEFT's wrapper puts before the base model's names
_FACTORS = {"lora_a": "lora_A", "lora_b": "lora_B"}


def tensors(adapters: Any) -> dict[str, np.ndarray]:
    """PEFT's tensors (by name) of `adapters` (a LoRA model's adapter params, numpy)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        keys = tuple(precision.path_name(path).split("/"))
        x = np.asarray(x)
        kernel = _leaf((*keys[:-1], "kernel"), x.shape)  # the projection's HF names
        slices = list(x) if kernel.stacked else [x]
        for name, part in zip(kernel.names, slices, strict=True):
            module = name.removesuffix(".weight")
            out[f"{PREFIX}{module}.{_FACTORS[keys[-1]]}.weight"] = np.ascontiguousarray(part.T)
    return out


def adapter_config(names: list[str], settings: dict, base: str | None) -> dict[str, Any]:
    """`adapter_config.json` for the tensors `names`: `target_modules` lists the projections'
    short names (`q_proj`, ...) when every layer has the same ones, else is a regex (PEFT
    full-matches a string against each module's name) of exactly the adapted modules."""
    modules = sorted({n.removeprefix(PREFIX).rsplit(".", 2)[0] for n in names})
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    layer_ids = {re.search(r"layers\.(\d+)\.", m)[1] for m in modules if "layers." in m}
    every = len(modules) == len(short) * len(layer_ids) or not layer_ids
    targets = short if every else "|".join(re.escape(m) for m in modules)
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
    }


def save(folder: Path, adapters: Any, lora: Any, base: str | None) -> int:
    """Writes the PEFT folder's two files into `folder` (the adapters in the dtype they come
    in). Returns how many values they hold."""
    found = tensors(adapters)
    config = adapter_config(list(found), lora_lib.settings(lora), base)
    safetensors.numpy.save_file(found, str(folder / WEIGHTS_FILE), {"format": "pt"})
    files.write_json(folder / CONFIG_FILE, config)
    return sum(x.size for x in found.values())
