"""What a run really holds and computes in which dtype: collectives, state bytes, warnings.

`collectives` reads a compiled program and says how many bytes each kind of collective moves in
which dtype; `state_bytes_per_param` measures the persistent state from the arrays themselves;
`setup_warnings` reads a config and names each choice that quietly loses training signal.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from mptrain import loss_scale, optim, precision, train_state

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\((.*)$"
)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def _array_bytes(text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of every array type written in `text`, e.g. `f32[128,64]{1,0}`."""
    found = []
    for dtype, dims in _ARRAY.findall(text):
        size = np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)
        bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype))
        found.append((dtype, int(size) * bits // 8))
    return found


def _group_size(attributes: str) -> int | None:
    """Devices per replica group, from any of XLA's ways to write them: listed
    (`{{0,1},{2,3}}`), iota (`[2,2]<=[4]`) or mesh axes (`mesh['axis_0'=2,'axis_1'=4] ...
    {'axis_1'}`); None when none of them is there (`{}`: all devices)."""
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", attributes)
    if iota:
        return int(iota.group(1))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attributes)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2))]))
    return None


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """`{op: {dtype: bytes}}` of the collectives in an HLO module's text (`compiled.as_text()`).

    The bytes are those of the whole logical tensor each op handles: an all-reduce's operand, a
    reduce-scatter's (unscattered) operand, an all-gather's (gathered) result; a combined op
    counts each of its tensors. Async pairs count once (their `-start`); ops whose replica
    groups hold one device each move nothing and are left out. The dtypes are HLO's (`f32`,
    `bf16`, `f16`, `u16`, `s32`, `pred`, ...).
    """
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        result, op, operands = match.groups()
        if _group_size(operands) == 1 and op != "collective-permute":
            continue  # each device alone in its group: nothing moves
        if op == "reduce-scatter":  # operands are printed as names: scale the result back up
            parts = _group_size(operands) or 1
            sizes = [(dtype, size * parts) for dtype, size in _array_bytes(result)]
        else:
            sizes = _array_bytes(result)
        for dtype, size in sizes:
            found[op][dtype] += size
    return {op: dict(by_dtype) for op, by_dtype in found.items()}


def _nbytes(x: Any) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize


def state_bytes_per_param(params: Any, opt_state: Any) -> float:
    """Persistent bytes of params plus optimizer state, per parameter, measured from the arrays.

    Counts every param leaf and every optimizer-state array with at least one dimension
    (moments, momentum, accumulators); scalars such as step counts are per-state, not per-param,
    and are left out. Works on arrays and on `jax.ShapeDtypeStruct`s. AdamW gives 12 for fp32
    and bf16-mixed, 10 for bf16 params with fp32 moments and 6 with bf16 moments (Kahan
    compensation, kept in the TrainState and not in `opt_state`, would add 2 more).
    """
    param_leaves = [x for x in jax.tree.leaves(params) if hasattr(x, "dtype")]
    count = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in param_leaves)
    if count == 0:
        raise ValueError("params hold no arrays; cannot compute bytes per parameter")
    state_leaves = [
        x
        for x in jax.tree.leaves(opt_state)
        if hasattr(x, "dtype")
        and np.ndim(x) > 0
        and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    total = sum(_nbytes(x) for x in param_leaves) + sum(_nbytes(x) for x in state_leaves)
    return total / count


def setup_warnings(config: Any) -> list[str]:
    """Human-readable warnings about a config that quietly loses training signal.

    Reads `precision`, `param_rounding`, `loss_scale.kind` and `optimizer.{name, learning_rate,
    mu_dtype, nu_dtype, moment_rounding}`. Warns when:
    - the compute dtype is fp16 and nothing scales the loss: fp16's smallest subnormal is
      6e-8, and gradients below it (common in the backward pass of deep nets) flush to zero;
    - params are 16-bit, rounded to nearest, and `learning_rate` is below half the dtype's
      epsilon (bf16: 0.0039, fp16: 0.00049). Round-to-nearest drops any update smaller than
      half a unit in the last place, so a step of about `learning_rate` (the size of an Adam
      step) leaves every weight with |w| > learning_rate / (eps / 2) unchanged, which by then
      includes weights of magnitude 1. A decaying schedule makes this worse as training ends;
    - adamw keeps its second moment in bf16 with round-to-nearest: it moves by `(1 - b2)` of
      itself per step, below bf16's resolution, so it stops decaying and tracking `g**2`
      (likewise, more mildly, for the first moment);
    - adamw keeps a moment in fp16: `g**2` overflows above |g| ~ 256 and flushes to zero below
      |g| ~ 2.4e-4, which turns the Adam step into `mu / eps`.
    sgd's momentum buffer changes by `(1 - momentum)` of itself per step, which bf16 resolves,
    so it draws no warning. Returns an empty list when nothing is unsafe.
    """
    policy = precision.get_policy(config.precision)
    opt = config.optimizer
    warnings = []
    if policy.compute_dtype == precision.F16:
        scaler = loss_scale.create_loss_scale(config.loss_scale.kind, policy)
        if isinstance(scaler, loss_scale.NoOpLossScale):
            warnings.append(
                "float16 compute without loss scaling (loss_scale.kind="
                f"{config.loss_scale.kind!r}): gradients below float16's smallest value, "
                "6e-8, flush to zero and those weights stop training. Use "
                "loss_scale.kind='dynamic' (what 'auto' picks for float16), or bfloat16."
            )
    rounding = train_state.resolve_param_rounding(config.get("param_rounding", "auto"), policy)
    learning_rate = opt.get("learning_rate")
    if policy.param_dtype in (precision.BF16, precision.F16) and rounding == "nearest":
        half_eps = float(jnp.finfo(policy.param_dtype).eps) / 2
        if isinstance(learning_rate, int | float) and learning_rate < half_eps:
            warnings.append(
                f"params are stored in {policy.param_dtype.name} and rounded to nearest, and "
                f"optimizer.learning_rate={learning_rate:g} is below {half_eps:.3g}: an update "
                f"of about the learning rate is rounded away for every weight with |w| > "
                f"{learning_rate / half_eps:.3g}, so those weights stop training. Use "
                "param_rounding='stochastic' or 'kahan', or fp32 params (e.g. 'bf16-mixed')."
            )
    if opt.get("name", "adamw") != "adamw":
        return warnings  # sgd's momentum changes by (1 - momentum) per step: bf16 copes
    nearest = opt.get("moment_rounding", "stochastic") == "nearest"
    for key in ("mu_dtype", "nu_dtype"):
        dtype = optim.state_dtype(opt.get(key), f"optimizer.{key}")
        if dtype == precision.BF16 and nearest and key == "nu_dtype":
            warnings.append(
                "optimizer.nu_dtype=bfloat16 with optimizer.moment_rounding='nearest': the "
                "second moment moves by (1 - b2) of itself per step, below bfloat16's "
                "resolution, so it stops decaying and stops tracking g**2. Use "
                "moment_rounding='stochastic' (the default) or nu_dtype='float32'."
            )
        elif dtype == precision.BF16 and nearest:
            warnings.append(
                "optimizer.mu_dtype=bfloat16 with optimizer.moment_rounding='nearest': changes "
                "of the first moment smaller than bfloat16's resolution are rounded away. Use "
                "moment_rounding='stochastic' (the default) or mu_dtype='float32'."
            )
        elif dtype == precision.F16 and key == "nu_dtype":
            warnings.append(
                "optimizer.nu_dtype=float16: g**2 overflows float16 for |g| > 256 and flushes to "
                "zero for |g| < 2.4e-4, where the Adam step becomes mu / eps. Use float32 (or "
                "bfloat16, which has float32's range)."
            )
        elif dtype == precision.F16:
            warnings.append(
                "optimizer.mu_dtype=float16: gradients above 65504 overflow and tiny ones flush "
                "to zero. Use float32 (or bfloat16, which has float32's range)."
            )
    return warnings


def log_start(config: Any, state: Any, compiled_step: Any, mesh: Any, start: int) -> None:
    """Logs what a run holds and how it starts: precision, loss scale, params, state bytes per
    param and per device, the compiled step's memory, the mesh, any warmup cut and the
    unsafe-setup warnings."""
    with jax.transfer_guard("allow"):
        scale = float(state.loss_scale.loss_scale)
    per_param = state_bytes_per_param(state.params, state.opt_state)
    on_one = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    memory = compiled_step.memory_analysis()
    logging.info(
        f"mptrain: precision {state.policy}, param rounding {state.param_rounding}, loss scale "
        f"{type(state.loss_scale).__name__} (scale {scale:g}), "
        f"{sum(x.size for x in jax.tree.leaves(state.params))} params, {per_param:.1f} state "
        f"bytes/param, mesh {dict(mesh.shape)}"
    )
    logging.info(
        f"mptrain: per device: state {on_one / 2**20:.1f} MiB; the compiled train step "
        f"{memory.temp_size_in_bytes / 2**20:.1f} MiB temporaries, "
        f"{memory.argument_size_in_bytes / 2**20:.1f} MiB arguments"
    )
    warmup = optim.warmup_steps(config)
    if warmup != config.optimizer.warmup_steps:
        logging.info(
            f"mptrain: optimizer.warmup_steps={config.optimizer.warmup_steps} is not shorter "
            f"than the run's updates; warming up over {warmup} instead"
        )
    for warning in setup_warnings(config):
        logging.warning("mptrain: %s", warning)
    if start:
        logging.info("mptrain: resuming from step %d", start)
