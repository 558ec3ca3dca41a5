"""Precision policies: which dtype a value lives in, and which params the model gets in fp32.

The dtypes themselves, the fp32 upcast and the rounding rules are `mptrain.dtypes`'.

A `Policy` says which dtype params are stored in, computed in, and returned in. It is a small
frozen dataclass, hashable so that it can sit in a static field of the `TrainState` and be part
of a jit cache key. Casting only ever touches floating-point leaves: token ids, labels and masks
pass through with their integer or boolean dtype intact.

Its casting rule says which params are handed to the model in fp32 when the step casts the
others to the compute dtype. Under 16-bit compute the default keeps embedding tables and
normalisation scales and biases, as torch's autocast leaves them alone: a model then gathers
rows from the fp32 table and casts the rows, so a gather's gradient accumulates in fp32 (a
16-bit scatter-add is slow and nondeterministic on GPUs), and a norm's few parameters keep their
full precision. A param says that of itself where it is created (its role, `fp32=True` in
`parallel.axes.declare`); a param no model declared is known by its name
(`DEFAULT_KEEP_FP32`). `keep_fp32`, a regular expression over "/"-joined param paths, replaces
the default: the params it matches are kept.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mptrain.dtypes import DTYPES, F32, parse_dtype
from mptrain.optim import q8

_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute"}
_KEYS |= {"o": "output", "output": "output"}

PRESETS = {
    "fp32": ("float32", "float32", "float32"),
    "bf16-mixed": ("float32", "bfloat16", "float32"),
    "fp16-mixed": ("float32", "float16", "float32"),
    "bf16-pure": ("bfloat16", "bfloat16", "float32"),
    # bf16-mixed, and the matmuls the model selects in fp8 (`mptrain.recipe.fp8`)
    "fp8-mixed": ("float32", "bfloat16", "float32"),
}
FP8 = "fp8"  # the part of a policy's long form that turns the fp8 matmuls on


def _cast_floating(tree: Any, dtype: np.dtype) -> Any:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


# A flax/NNX embedding table (`.../embedding`, `pos_embedding`), and the scale and bias of a
# module whose name says it normalises (`LayerNorm_0`, `ln_attn`, `bn1`, `proj_bn`, `stem_bn`).
MATMUL_PRECISIONS = ("default", "high", "highest")  # jax's names: 1, 3 and 6 bf16 passes on TPU
# A float32 matmul at full precision, by the names the precision report and the plan read:
# jax's HIGHEST, or the F32_F32_F32 algorithm (`jax.lax.DotAlgorithmPreset`).
FULL_FLOAT32 = ("highest", "f32_f32_f32")
DEFAULT_KEEP_FP32 = (
    r"(?i)(embedding$|(^|/)([^/]*norm[^/]*|([^/]*_)?(ln|bn)(\d*|_[^/]*))/(scale|bias)$)"
)


def path_name(path: tuple) -> str:
    """A pytree path as "/"-joined names, e.g. `block_0/attn/qkv/kernel`."""
    names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(name) for name in names)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Where each kind of value lives: master params, the forward/backward pass, and outputs;
    and which params the step hands to the model in fp32 (`keep_fp32`, a regex over param
    paths; None: the default under 16-bit compute, none under fp32; "": none). The default is
    each param's declared role (`declared`, the model's `parallel.axes.Axes`, which the train
    state attaches), and for a param no model declared, `DEFAULT_KEEP_FP32` on its name.

    `output_dtype` is the dtype of the model outputs that the loss and the evaluation see: the
    Trainer's default `loss_fn` and `eval_fn` pass the logits through `cast_to_output` (a no-op
    for the zoo's fp32 logits under `output=float32`, the presets' choice); a `loss_fn` of
    your own applies it where it means to."""

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    keep_fp32: str | None = None
    # the model runs its selected matmuls in fp8 with this `mptrain.recipe.fp8.Recipe`; None: not
    fp8: Any = None
    # the precision of float32 matmuls (`MATMUL_PRECISIONS`); "auto": "highest" under fp32
    # compute, where it is the reference every mixed recipe is measured against (JAX's default
    # runs float32 dots as one bfloat16 pass on a TPU, in TensorFloat-32 on an NVIDIA GPU),
    # "default" under 16-bit compute, whose operands are 16-bit already
    matmul_precision: str = "auto"
    # the model's declared params (`parallel.axes.Axes`): the default rule keeps those whose
    # role is fp32; None: every param by its name (a policy no state was made with yet)
    declared: Any = None

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, name, np.dtype(getattr(self, name)))
        rule = self.keep_fp32
        if rule is not None and not isinstance(rule, str):
            raise ValueError(f"keep_fp32={rule!r}: must be a regular expression (a string)")
        try:
            re.compile(rule or "")
        except re.error as e:
            raise ValueError(f"keep_fp32={rule!r}: not a regular expression: {e}") from None
        wanted = str(self.matmul_precision).strip().lower()
        if wanted not in ("auto", *MATMUL_PRECISIONS):
            valid = ", ".join(("auto", *MATMUL_PRECISIONS))
            raise ValueError(f"matmul_precision={self.matmul_precision!r}: valid values: {valid}")
        if wanted == "auto":
            wanted = "highest" if self.compute_dtype == F32 else "default"
        object.__setattr__(self, "matmul_precision", wanted)

    def matmuls(self):
        """A context in which the matmuls JAX traces take `matmul_precision` (the step's own,
        not the process's: `jax.default_matmul_precision` while its trace is built)."""
        return jax.default_matmul_precision(self.matmul_precision)

    def kept_fp32(self, path: str) -> bool:
        """Whether the param at `path` ("/"-joined) is handed to the model in fp32."""
        if self.keep_fp32 is not None:  # the user's rule
            return bool(self.keep_fp32) and re.search(self.keep_fp32, path) is not None
        if self.compute_dtype == F32:
            return False
        if self.declared is not None:  # the role the param declared
            names, fp32 = self.declared.lookup(tuple(path.split("/")))
            if names is not None:
                return fp32
        return re.search(DEFAULT_KEEP_FP32, path) is not None

    def compute_dtypes(self, params: Any) -> Any:
        """Per param leaf, the dtype the model gets it in: fp32 where `keep_fp32` matches, the
        compute dtype for other floating leaves, its own dtype for the rest; None for an 8-bit
        frozen kernel (a `q8.Q8` leaf, which the model dequantizes itself: `recipe.frozen`)."""

        def one(path, x):
            if q8.is_q8(x):
                return None
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return np.dtype(x.dtype)
            return F32 if self.kept_fp32(path_name(path)) else self.compute_dtype

        return jax.tree_util.tree_map_with_path(one, params, is_leaf=q8.is_q8)

    def kept_fp32_paths(self, params: Any) -> list[str]:
        """The paths of the floating params `keep_fp32` matches, in tree order."""
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        names = [path_name(p) for p, x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
        return [name for name in names if self.kept_fp32(name)]

    def describe_rules(self, params: Any) -> str:
        """One line: the casting rule and the params it keeps in fp32 for compute."""
        kept = self.kept_fp32_paths(params)
        shown = ", ".join(kept[:6]) + (f", ... ({len(kept) - 6} more)" if len(kept) > 6 else "")
        how = "" if self.keep_fp32 is not None else " (each param's declared role)"
        return f"keep_fp32={self.keep_fp32!r}{how}: {len(kept)} params in fp32 for compute" + (
            f" ({shown})" if kept else ""
        )

    @staticmethod
    def cast_as(tree: Any, dtypes: Any) -> Any:
        """`cast_as`, for the code below the recipe that is handed a policy."""
        return cast_as(tree, dtypes)

    def cast_params(self, params: Any) -> Any:
        """`params` as the model gets them: `compute_dtypes` applied."""
        return cast_as(params, self.compute_dtypes(params))

    def cast_to_param(self, tree: Any) -> Any:
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return _cast_floating(tree, self.output_dtype)

    def __str__(self) -> str:
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}" + (f",{FP8}" if self.fp8 else "")
        )


def cast_as(tree: Any, dtypes: Any) -> Any:
    """Each leaf of `tree` cast to its dtype in `dtypes` (`Policy.compute_dtypes`' form: None
    leaves a `q8.Q8` leaf as it is)."""
    return jax.tree.map(
        lambda x, d: x if d is None else x.astype(d), tree, dtypes, is_leaf=q8.is_q8
    )


def _fp8_recipe():
    from mptrain.recipe import fp8

    return fp8.Recipe()


def get_policy(spec: str | Policy, keep_fp32: str | None = None) -> Policy:
    """Parses a preset name or the explicit `params=...,compute=...,output=...` form; with
    `keep_fp32` (a regex) that casting rule instead of the default one."""
    if isinstance(spec, Policy):
        return spec if keep_fp32 is None else dataclasses.replace(spec, keep_fp32=keep_fp32)
    if not isinstance(spec, str):
        raise ValueError(f"precision={spec!r}: must be a string ({type(spec).__name__} given)")
    text = spec.strip().lower()
    if text in PRESETS:
        fp8 = _fp8_recipe() if text == "fp8-mixed" else None
        return Policy(*(DTYPES[name] for name in PRESETS[text]), keep_fp32, fp8)
    if "=" not in text:
        raise ValueError(
            f"precision={spec!r}: unknown; valid presets are {', '.join(PRESETS)}, or the "
            "explicit form 'params=float32,compute=bfloat16,output=float32' (keys p,c,o too)"
        )
    found: dict[str, np.dtype] = {}
    parts = text.split(",")
    with_fp8 = FP8 in {part.strip() for part in parts}
    for part in parts:
        if part.strip() == FP8:
            continue
        key, sep, value = part.partition("=")
        key, part = key.strip(), part.strip()
        if not sep or key not in _KEYS:
            raise ValueError(
                f"precision={spec!r}: bad part {part!r}, expected key=dtype with key one of "
                f"params/p, compute/c, output/o; valid presets are {', '.join(PRESETS)}"
            )
        if _KEYS[key] in found:
            raise ValueError(f"precision={spec!r}: part {part!r} repeats {_KEYS[key]!r}")
        try:
            found[_KEYS[key]] = parse_dtype(value, "dtype")
        except ValueError as e:
            raise ValueError(f"precision={spec!r}: bad part {part!r}: {e}") from None
    missing = [k for k in ("params", "compute", "output") if k not in found]
    if missing:
        raise ValueError(f"precision={spec!r}: does not set {', '.join(missing)}")
    fp8 = _fp8_recipe() if with_fp8 else None
    if fp8 and found["compute"] == F32:
        raise ValueError(f"precision={spec!r}: fp8 matmuls need a 16-bit compute dtype")
    return Policy(found["params"], found["compute"], found["output"], keep_fp32, fp8)
