"""What a run really holds and computes in which dtype: the precision report and its parts.

`precision_report(fn, *args)` answers "is my step really running in bf16?": the FLOPs of every
matmul and convolution by operand dtype (with the source lines of those not in the compute
dtype), the collectives by op and dtype, the converts, the fp32 islands, the GPU hazards (the
scatters and 16-bit sums across devices that a GPU runs slowly or nondeterministically, see
`hlo`), the state's bytes per parameter and the unsafe-setup warnings. Its parts are usable
alone: `collectives` reads a compiled program, `state_bytes_per_param` measures the persistent
state from the arrays, and `setup_warnings` names each config choice that quietly loses
training signal.

The FLOPs and hazards come from the traced program (its jaxpr, backward pass included), not the
compiled one: the program the user wrote; on CPU XLA rewrites every bf16 matmul, scatter and
cross-device sum as an fp32 one, which would hide exactly what the report is for.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mptrain import dtypes, optim
from mptrain.inspect import hlo, program
from mptrain.optim import q8
from mptrain.recipe import fp8_names, loss_scale, numerics, precision, train_state

# The HLO reading lives in `hlo`; these names stay here for the code that calls them.
COLLECTIVES = hlo.COLLECTIVES
collectives = hlo.collectives
Hazard = hlo.Hazard


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
    - adamw stores its moments unsafely (`optim.moment_warnings`, the messages its builders warn
      with): a moment in bf16 or q8 rounded to nearest, whose changes are rounded away (the
      second moment stops decaying and tracking `g**2`), or in fp16, whose range `g**2` leaves.
    sgd's momentum buffer changes by `(1 - momentum)` of itself per step, which bf16 resolves,
    so it draws no warning. Returns an empty list when nothing is unsafe.
    """
    policy = precision.get_policy(config.precision)
    opt = config.optimizer
    warnings = []
    if policy.compute_dtype == dtypes.F16:
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
    if policy.param_dtype in (dtypes.BF16, dtypes.F16) and rounding == "nearest":
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
    rounding = opt.get("moment_rounding", "stochastic")
    return warnings + optim.moment_warnings(
        opt.get("mu_dtype"), opt.get("nu_dtype"), rounding, prefix="optimizer."
    )


# --------------------------------------------------------------------------- the report

_ISLAND_OPS = {"exp", "log", "log1p", "rsqrt", "sqrt", "logistic", "tanh", "erf", "reduce_max"}
_ISLAND_OPS |= {"reduce_sum", "integer_pow", "div"}


_LIBRARIES = ("site-packages", "dist-packages")
_FRAMEWORK = tuple(f"mptrain/{m}.py" for m in ("step", "optim", "sharding", "loss_scale"))
_FRAMEWORK += tuple(f"mptrain/{m}.py" for m in ("train_state", "precision", "metrics", "trainer"))


def _where(eqn, outer: str = "?") -> str:
    """`file.py:line` of the first frame outside installed libraries that made `eqn` (for
    backward ops, the line of the forward op), e.g. the model line that called a LayerNorm.

    An op inside a library's own jit (`jnp.take`'s gather, and its scatter-add gradient) sees
    only the library's frames: it gets `outer`, the place of the op that holds it."""
    from jax._src import source_info_util

    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    frame = next((f for f in frames if not any(lib in f.file_name for lib in _LIBRARIES)), None)
    if frame is None and outer != "?":
        return outer
    frame = frame or (frames[0] if frames else None)
    if frame is None:
        return "?"
    name = (
        os.path.relpath(frame.file_name)
        if frame.file_name.startswith(os.getcwd())
        else frame.file_name
    )
    return f"{name}:{frame.start_line}"


def _is_f32(var) -> bool:
    return getattr(var.aval, "dtype", None) == jnp.float32


def _subjaxprs(eqn):
    """`(jaxpr, times)` for every jaxpr inside `eqn` (jit, shard_map, scan, cond, ...)."""
    times = eqn.params.get("length", 1)  # scan runs its body `length` times
    mesh = eqn.params.get("mesh")  # shard_map runs its body once per device
    times *= mesh.size if eqn.primitive.name == "shard_map" and mesh is not None else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner, times


def _precision(eqn) -> str:
    """A matmul's precision by jax's name ("default", "high", "highest"), the higher of its
    operands'; an algorithm (`DotAlgorithmPreset`) by its own name."""
    found = eqn.params.get("precision")
    if isinstance(found, tuple):
        found = max(found, key=lambda p: getattr(p, "value", -1) if p is not None else -1)
    return "default" if found is None else getattr(found, "name", str(found)).lower()


def _matmul_flops(eqn) -> int:
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * int(np.prod(out.shape)) * int(np.prod([lhs[d] for d in contracting]))
    rhs = eqn.invars[1].aval.shape  # convolution: each output takes kernel / out_features MACs
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * int(np.prod(out.shape)) * int(np.prod(rhs)) // out_features


@dataclasses.dataclass
class PrecisionReport:
    """What a step computes in which dtype; `str(report)` is a readable table.

    `matmul_flops`: `{operand dtype: FLOPs}` of every dot and convolution, forward and backward.
    `matmuls`: `{(file:line, dtype): FLOPs}`, the same by source line. `collectives`: `{op:
    {dtype: bytes}}` from the compiled program. `converts`: `{"float32->bfloat16": n}`.
    `islands`: `{file:line: sorted primitives}` that run in fp32 under a 16-bit compute dtype
    (softmax, norms, reductions, the loss). `state_bytes`: bytes per parameter by part of the
    `TrainState` among the arguments. `warnings`: what quietly loses signal. `hazards`: every
    scatter and 16-bit sum across devices (`Hazard`), the 16-bit ones first. `casting`: the
    policy's `keep_fp32` rule and the params it hands to the model in fp32.
    """

    compute_dtype: str
    matmul_flops: dict[str, int]
    matmuls: dict[tuple[str, str], int]
    collectives: dict[str, dict[str, int]]
    converts: dict[str, int]
    islands: dict[str, list[str]]
    state_bytes: dict[str, float]
    warnings: list[str]
    hazards: list[hlo.Hazard] = dataclasses.field(default_factory=list)
    casting: str = ""  # the policy's keep_fp32 rule and the params it keeps in fp32
    trains: str = ""  # which params train, in what dtype, and what is frozen (`_trains`)
    fp8: str = ""  # under fp8-mixed, which matmuls run in fp8 (`fp8_names.describe`)
    axis_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # `hlo.by_axis`
    fp8_emulated: bool = False  # MXFP8 without a block-scaled GEMM: emulated (`recipe.mxfp8`)
    # {operand dtype: {precision: FLOPs}}: "default", "high", "highest" (jax's names)
    precisions: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def compute_fraction(self) -> float:
        """The share of matmul FLOPs whose operands are in the compute dtype, or narrower: the
        fp8 matmuls of `fp8-mixed` (`mptrain.recipe.fp8`) count too."""
        total = sum(self.matmul_flops.values())
        low = sum(f for d, f in self.matmul_flops.items() if self._low(d))
        return low / total if total else 1.0

    def _low(self, dtype: str) -> bool:
        return dtype == self.compute_dtype or dtype.startswith("float8")

    def offenders(self) -> list[tuple[str, str, int]]:
        """`(file:line, dtype, FLOPs)` of the matmuls in neither the compute dtype nor an fp8
        dtype (the ones `compute_fraction` leaves out), biggest first."""
        rows = [(w, d, f) for (w, d), f in self.matmuls.items() if not self._low(d)]
        return sorted(rows, key=lambda row: -row[2])

    def __str__(self) -> str:
        total = sum(self.matmul_flops.values()) or 1
        lines = [f"precision report (compute dtype {self.compute_dtype})"]
        lines += [f"casting rule: {self.casting}"] if self.casting else []
        lines += [f"trained: {self.trains}"] if self.trains else []
        fp8 = sum(f for d, f in self.matmul_flops.items() if d.startswith("float8")) / total
        share = f"{100 * fp8:.1f}% of the FLOPs"
        if self.fp8_emulated:  # a CPU: MXFP8's rounding, multiplied in the compute dtype
            share = f"MXFP8 emulated: rounded to its blocks, multiplied in {self.compute_dtype}"
        lines += [f"fp8 matmuls ({share}): {self.fp8}"] if self.fp8 else []
        lines += ["", "matmul FLOPs:"]
        for dtype, flops in sorted(self.matmul_flops.items(), key=lambda kv: -kv[1]):
            at = ", ".join(f"{p} {f:,}" for p, f in sorted(self.precisions.get(dtype, {}).items()))
            lines.append(f"  {dtype:<10} {flops:>18,}  {100 * flops / total:6.2f}%  precision {at}")
        for where, dtype, flops in self.offenders():
            lines.append(f"  not {self.compute_dtype}: {where}  {dtype}  {flops:,} FLOPs")
        lines += ["", "collectives (bytes):"]
        for op, by_dtype in sorted(self.collectives.items()):
            lines.append(f"  {op:<15} " + ", ".join(f"{d} {b:,}" for d, b in by_dtype.items()))
        if not self.collectives:
            lines.append("  none")
        if self.axis_bytes:
            by_axis = ", ".join(f"{a} {b:,}" for a, b in sorted(self.axis_bytes.items()))
            lines.append(f"  by mesh axis   {by_axis}")
        lines += ["", "GPU hazards (scatters; 16-bit sums across devices):"]
        for h in self.hazards:
            lines.append(f"  {h.kind:<16} {h.op:<22} {h.dtype:<9} x{h.count:<4} {h.where}")
        lines += [] if self.hazards else ["  none"]
        lines += ["", "converts: " + (", ".join(f"{k} {v}" for k, v in self.converts.items()))]
        lines += ["", "fp32 islands:"]
        lines += [f"  {where}  {', '.join(ops)}" for where, ops in self.islands.items()]
        lines += ["", "state bytes per parameter:"]
        lines += [f"  {part:<14} {value:8.3f}" for part, value in self.state_bytes.items()]
        lines += ["", "warnings:"] + [f"  - {w}" for w in self.warnings or ["none"]]
        return "\n".join(lines) + "\n"


def _state_parts(state: Any) -> dict[str, float]:
    """Bytes per parameter by part of a TrainState: params, each optimizer-state part, the
    loss scale, the Kahan compensation."""
    count = sum(int(np.size(x)) for x in jax.tree.leaves(state.params))
    parts: dict[str, float] = collections.Counter()
    parts["params"] = sum(_nbytes(x) for x in jax.tree.leaves(state.params)) / count
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
        parts[f"opt_state.{names[0] if names else 'other'}"] += _nbytes(leaf) / count
    parts["loss_scale"] = sum(_nbytes(x) for x in jax.tree.leaves(state.loss_scale)) / count
    compensation = jax.tree.leaves(state.param_compensation)
    parts["compensation"] = sum(_nbytes(x) for x in compensation) / count
    return dict(parts)


def _axis_bytes(prog: program.Program, states: list) -> dict[str, int]:
    """`hlo.by_axis` on the mesh the first state's params lie on (none: {})."""
    leaves = jax.tree.leaves(states[0].params) if states else []
    mesh = getattr(getattr(leaves[0], "sharding", None), "mesh", None) if leaves else None
    return hlo.by_axis(prog, dict(mesh.shape)) if mesh is not None and mesh.shape else {}


def precision_report(fn: Any, *args: Any, policy: Any = None, config: Any = None):
    """The `PrecisionReport` of `fn(*args)`, e.g. a train step, its state and a batch.

    `fn` may be jitted already (its shardings are then kept). `policy` defaults to that of the
    first `TrainState` among `args`; `config` adds its `setup_warnings`.
    """
    traced = (fn if hasattr(fn, "trace") else jax.jit(fn)).trace(*args)
    return make_report(traced.jaxpr, traced.lower().compile(), args, policy=policy, config=config)


def make_report(
    jaxpr: Any, compiled: Any, args: tuple, *, policy: Any = None, config: Any = None
) -> PrecisionReport:
    """The report from a traced program's jaxpr and its compilation (a run has both already).

    Under a 16-bit compute dtype a warning names the matmuls outside it when they take more
    than 5% of the FLOPs; every 16-bit hazard gets a warning naming its line and its fix.
    """
    from mptrain.recipe import train_state as train_state_lib

    states = [a for a in args if isinstance(a, train_state_lib.TrainState)]
    policy = precision.get_policy(policy if policy is not None else states[0].policy)
    compute = policy.compute_dtype.name
    by_line: dict[tuple[str, str], int] = collections.Counter()
    converts: dict[str, int] = collections.Counter()
    islands: dict[str, set] = collections.defaultdict(set)
    hazards: dict[tuple[str, str, str, str], int] = collections.Counter()
    precisions: dict[str, dict[str, int]] = collections.defaultdict(collections.Counter)

    def walk(jaxpr, times, outer):
        for eqn in jaxpr.eqns:
            if numerics.REPLAY in str(eqn.source_info.name_stack):
                continue  # measures log and skipped steps only: not an ordinary step's work
            name = eqn.primitive.name
            if name in ("dot_general", "conv_general_dilated"):
                dtype = np.dtype(eqn.invars[0].aval.dtype).name
                by_line[(_where(eqn, outer), dtype)] += times * _matmul_flops(eqn)
                precisions[dtype][_precision(eqn)] += times * _matmul_flops(eqn)
            elif name == "convert_element_type":
                old, new = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
                floats = jnp.issubdtype(old, jnp.floating) and jnp.issubdtype(new, jnp.floating)
                if floats and np.dtype(old) != np.dtype(new):
                    converts[f"{np.dtype(old).name}->{np.dtype(new).name}"] += times
            elif name in _ISLAND_OPS and compute != "float32" and _is_f32(eqn.invars[0]):
                where = _where(eqn, outer)  # the model's and the loss's, not the optimizer's
                if not any(part in where for part in _FRAMEWORK):
                    islands[where].add(name)
            elif name in hlo.SCATTERS:
                dtype = np.dtype(eqn.invars[0].aval.dtype)  # the updates' dtype too
                kind = hlo.scatter_kind(name, dtype, eqn.params)
                hazards[(name, dtype.name, _where(eqn, outer), kind)] += times
            elif name in hlo.TRACED_SUMS:  # one psum may sum several arrays
                dtypes = {np.dtype(v.aval.dtype).name for v in eqn.invars}
                for dtype in sorted(d for d in dtypes if hlo.is_16_bit(d)):
                    hazards[(name, dtype, _where(eqn, outer), "16-bit")] += times
            for inner, more in _subjaxprs(eqn):
                walk(inner, times * more, _where(eqn, outer))

    walk(getattr(jaxpr, "jaxpr", jaxpr), 1, "?")
    prog = program.Program(compiled.as_text())
    # A 16-bit sum in the compiled program that no traced psum explains came from XLA (a
    # sharding's reduction, say): named by its op_name, as it has no source line.
    traced = {dtype for op, dtype, _, _ in hazards if op in hlo.TRACED_SUMS}
    for op, dtype, name, runs in hlo.sixteen_bit_sums(prog):
        if dtype not in traced:
            hazards[(op, dtype, name or "compiled program", "16-bit")] += runs
    flops: dict[str, int] = collections.Counter()
    for (_, dtype), value in by_line.items():
        flops[dtype] += value
    report = PrecisionReport(
        compute_dtype=compute,
        matmul_flops=dict(flops),
        matmuls=dict(by_line),
        collectives=collectives(prog),
        axis_bytes=_axis_bytes(prog, states),
        converts=dict(converts),
        islands={where: sorted(ops) for where, ops in sorted(islands.items())},
        state_bytes=_state_parts(states[0]) if states else {},
        warnings=setup_warnings(config) if config is not None else [],
        casting=policy.describe_rules(states[0].params) if states else "",
        trains=_trains(states[0]) if states else "",
        fp8=fp8_names.describe(states[0].model_state) if states and policy.fp8 else "",
        fp8_emulated=bool(
            policy.fp8 and policy.fp8.block and not any(d.startswith("float8") for d in flops)
        ),
        precisions={dtype: dict(by) for dtype, by in precisions.items()},
        hazards=sorted(
            (hlo.Hazard(*key, kind=kind, count=n) for (*key, kind), n in hazards.items()),
            key=lambda h: (hlo.KINDS.index(h.kind), -h.count, h.where),
        ),
    )
    report.warnings += [hlo.warning(h) for h in report.hazards if h.kind == "16-bit"]
    full = precision.FULL_FLOAT32
    reduced = sum(f for p, f in report.precisions.get("float32", {}).items() if p not in full)
    if reduced:
        report.warnings.append(
            f"{reduced:,} FLOPs of float32 matmuls run at reduced precision: JAX's default runs "
            "them as one bfloat16 pass on a TPU and in TensorFloat-32 on an NVIDIA GPU (Ampere "
            "on); config.matmul_precision='highest' (what 'auto' picks under fp32 compute) makes "
            "them float32"
        )
    if compute != "float32" and report.compute_fraction < 0.95:
        where = "; ".join(f"{w} ({d}, {f:,} FLOPs)" for w, d, f in report.offenders()[:5])
        report.warnings.append(
            f"only {100 * report.compute_fraction:.1f}% of the matmul FLOPs run in {compute}; "
            f"the rest run at: {where}. An fp32 operand (a constant, an input, a param kept "
            "in fp32) promotes a matmul to fp32: cast it to the compute dtype."
        )
    return report


def _trains(state: Any) -> str:
    """Which params train and in what dtype; under adapters, what is frozen and how it is stored
    (16-bit, or 8-bit `q8` blocks): the precision report's line `trained:`."""
    count = lambda tree: sum(int(np.size(x)) for x in jax.tree.leaves(tree))
    dtypes = sorted({np.dtype(x.dtype).name for x in jax.tree.leaves(state.params)})
    text = f"{count(state.params):,} params in {'/'.join(dtypes)}"
    base = getattr(state, "frozen", None)
    if not jax.tree.leaves(base):
        return f"all {text}"
    leaves = jax.tree.leaves(base, is_leaf=q8.is_q8)
    eight = sum(int(np.prod(x.shape)) for x in leaves if q8.is_q8(x))
    rest = sorted({np.dtype(x.dtype).name for x in leaves if not q8.is_q8(x)})
    total = sum(int(np.prod(x.shape)) for x in leaves)
    stored = f"{'/'.join(rest)}" + (f" ({eight:,} of them in 8-bit q8 blocks)" if eight else "")
    return f"{text} (the adapters); {total:,} frozen (the base), stored in {stored}"
