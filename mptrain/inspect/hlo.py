"""XLA's ops read without running them: collectives in compiled HLO text, GPU hazards by op.

`collectives` reads a compiled module's text (`compiled.as_text()`) for its cross-device traffic
by op and dtype. The rest says which ops XLA:GPU runs badly, by the names both the jaxpr
(`scatter-add`, `psum`) and the HLO (`all-reduce`) give them:

- Scatters combine the updates that land on one element with atomics. Their order changes from
  run to run, so floating sums come out different in the last bits: no bit-identical reruns or
  resumes. 16-bit atomics are compare-and-swap loops, slow under contention (openxla/xla#26371
  measures a bf16 scatter-add at about 20x an fp32 one). XLA:CPU upcasts 16-bit scatters, so
  a CPU's compiled program hides them: read the traced one.
- A sum across devices in 16 bits rounds at every addition and, in float16, overflows above
  65504; loss-scaled gradients are where that bites. XLA:CPU upcasts these too.

A bottom module: it imports only `program` (the reading of types), so the audit, the plan and
the scripts that plan a mesh's traffic read programs the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from mptrain.inspect import program

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
SUMS = ("all-reduce", "reduce-scatter")  # the collectives that add values across devices
SIXTEEN_BIT = {"bf16": "bfloat16", "f16": "float16"}  # HLO's 16-bit floats, by numpy name

_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _array_bytes(type_text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of every array of a type, e.g. `(f32[128,64]{1,0}, bf16[8]{0})`."""
    return [(dtype, program.nbytes(dtype, dims)) for dtype, dims in program.arrays(type_text)]


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


def collective_ops(source: str | program.Program) -> Iterator[tuple[str, str, int, str, float]]:
    """`(op, dtype, bytes, op_name, runs)` for every tensor of every collective that moves data
    in a compiled module (its text or its `program.Program`).

    `op_name` is the name JAX gave the instruction (`jit(step)/shard_map/psum`), or "" when
    the program does not say; `runs` is how often the instruction runs per call (a loop's trip
    count: `steps_per_call` steps run their collectives that many times). See `collectives`
    for what the bytes count.
    """
    prog = source if isinstance(source, program.Program) else program.Program(source)
    for inst, runs in prog.instructions():  # a TPU's collectives sit in fusions too
        op = inst.opcode.removesuffix("-start")
        if op not in COLLECTIVES:
            continue
        group = _group_size(inst.attributes)
        if group == 1 and op != "collective-permute":
            continue  # each device alone in its group: nothing moves
        if inst.opcode != op and op in ("all-gather", "reduce-scatter"):
            # the async form returns (operands, results): the gathered results count, or the
            # unscattered operands
            parts = program.top_level(inst.type)
            half = len(parts) // 2
            sizes = _array_bytes(" ".join(parts[half:] if op == "all-gather" else parts[:half]))
        elif op == "reduce-scatter":  # the result is a shard: scale it back up
            sizes = [(dtype, size * (group or 1)) for dtype, size in _array_bytes(inst.type)]
        else:
            sizes = _array_bytes(inst.type)
        name = _OP_NAME.search(inst.attributes)
        for dtype, size in sizes:
            yield op, dtype, size, name.group(1) if name else "", runs


def collectives(source: str | program.Program, per: int = 1) -> dict[str, dict[str, int]]:
    """`{op: {dtype: bytes}}` of the collectives of a compiled module (`compiled.as_text()`, or
    its `program.Program`), per call of it, or per step with `per` steps a call.

    The bytes are those of the whole logical tensor each op handles: an all-reduce's operand, a
    reduce-scatter's (unscattered) operand, an all-gather's (gathered) result; a combined op
    counts each of its tensors, and an op in a loop counts each time it runs. Async pairs count
    once (their `-start`); ops whose replica groups hold one device each move nothing and are
    left out. The dtypes are HLO's (`f32`, `bf16`, `f16`, `u16`, `s32`, `pred`, ...).
    """
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op, dtype, size, _, runs in collective_ops(source):
        found[op][dtype] += size * runs
    return {op: {d: int(b // per) for d, b in by.items()} for op, by in found.items()}


def _first_group(attributes: str) -> list[int] | int | None:
    """The device ids of a collective's first replica group where XLA lists them or writes
    them as an iota (`[2,4]<=[4,2]T(1,0)`), else only its size (`_group_size`)."""
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if listed:
        return [int(i) for i in listed.group(1).split(",") if i]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota:
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
        return ids.reshape(int(iota.group(1)), int(iota.group(2)))[0].tolist()
    return _group_size(attributes)


# what a ring sends per device, in units of the op's whole tensor, over a group of g
_WIRE = {"all-gather": 1.0, "reduce-scatter": 1.0, "all-reduce": 2.0, "all-to-all": 1.0}


def traffic(prog: program.Program, link_fn, devices: int, per: int = 1) -> dict[str, dict]:
    """`{link name: {"bytes": ..., "seconds": ...}}`: what each device sends a step over each
    kind of link, and how long that takes at the link's rate, `devices` in all. `link_fn(group)`
    names the slowest link a group crosses and its bytes/s each way (`target.Target.link`). A
    ring over g devices sends (g-1)/g of the whole tensor in an all-gather, a reduce-scatter or
    an all-to-all, twice that in an all-reduce; a collective-permute sends its tensor once. The
    seconds assume nothing overlaps them with compute: the collectives' side of the floor."""
    found: dict[str, dict[str, float]] = {}
    for op, group, size, moved, runs in _moves(prog, devices):
        wire = moved * (_WIRE[op] * (size - 1) / size if op in _WIRE else 1.0) * runs / per
        name, rate = link_fn(group)
        entry = found.setdefault(name, {"bytes": 0.0, "seconds": 0.0, "rate": rate})
        entry["bytes"] += wire
        entry["seconds"] += wire / rate if rate else 0.0
    return found


def by_axis(prog: program.Program, mesh: dict[str, int], per: int = 1) -> dict[str, int]:
    """`{"fsdp x context": bytes, ...}`: the bytes of the collectives' whole tensors a step (as
    `collectives` counts them), by the mesh axes their replica groups span. `mesh`: the axes'
    sizes in the mesh's order, whose devices the program numbers row-major. A group XLA gives
    only the size of is named by the axes whose sizes multiply to it, else "N devices"."""
    found: collections.Counter = collections.Counter()
    for _, group, size, moved, runs in _moves(prog, int(np.prod(tuple(mesh.values())))):
        found[_axes(group, size, mesh)] += moved * runs
    return {axes: int(b // per) for axes, b in found.items()}


def _axes(group: Any, size: int, mesh: dict[str, int]) -> str:
    """The mesh axes a replica group spans, `" x "`-joined (`by_axis`)."""
    names, sizes = list(mesh), tuple(mesh.values())
    if isinstance(group, list):
        coords = np.unravel_index(np.asarray(group), sizes)
        spanned = [a for a, row in zip(names, coords, strict=True) if len(set(row)) > 1]
    else:
        spanned = [a for a in names if mesh[a] > 1]
        spanned = spanned if int(np.prod([mesh[a] for a in spanned])) == size else []
    return " x ".join(spanned) or f"{size} devices"


_MATMUL_CALLS = re.compile(r"gemm|matmul|fmha", re.IGNORECASE)


def overlap(prog: program.Program, mesh: dict[str, int], per: int = 1) -> dict[str, dict]:
    """`{axes: {"hidden": bytes, "exposed": bytes, "count": ops}}` a step, by mesh axes as
    `by_axis`: a collective is hidden where the compiled schedule runs a matmul (a GEMM library
    call, a fused attention, a fusion with a dot) between its `-start` and its `-done`, so the
    two can overlap; exposed where it is synchronous or only other work runs meanwhile. A
    reading of the schedule, not a timing: a short matmul hides a short part of a long one."""
    devices, found = int(np.prod(tuple(mesh.values()))), {}
    dots = {name for name, body in prog.computations.items()
            if any(i.opcode == "dot" or _is_gemm(i) for i in body)}  # fmt: skip

    def add(axes: str, kind: str, moved: int, runs: float) -> None:
        entry = found.setdefault(axes, collections.Counter())
        entry[kind], entry["count"] = entry[kind] + moved * runs, entry["count"] + runs

    for name, body in prog.computations.items():
        runs = prog.times.get(name, 0.0)
        if not runs or name in prog.fused:
            continue
        pending: dict[str, list] = {}  # an open start -> [axes, bytes, hidden]
        for inst in body:
            if (move := _move(inst, devices)) is not None:
                axes = _axes(move[1], move[2], mesh)
                if inst.opcode.endswith("-start"):
                    pending[inst.name] = [axes, move[3], False]
                else:  # synchronous
                    add(axes, "exposed", move[3], runs)
            elif (
                inst.opcode.endswith("-done") and inst.operands[:1] and inst.operands[0] in pending
            ):
                axes, moved, hidden = pending.pop(inst.operands[0])
                add(axes, "hidden" if hidden else "exposed", moved, runs)
            elif (
                inst.opcode == "dot"
                or _is_gemm(inst)
                or any(c in dots for c in re.findall(r"calls=%([\w.\-]+)", inst.attributes))
            ):
                for entry in pending.values():
                    entry[2] = True
    keys = ("hidden", "exposed", "count")
    return {axes: {k: int(c[k] // per) for k in keys} for axes, c in found.items()}


def _is_gemm(inst: program.Instruction) -> bool:  # a GEMM library call, a fused attention
    return bool(_MATMUL_CALLS.search(inst.attribute("custom_call_target") or ""))


def _move(inst: program.Instruction, devices: int) -> tuple | None:
    """`(op, group, size, bytes)` of a collective that moves data (`_moves`), else None."""
    op = inst.opcode.removesuffix("-start")
    if op not in COLLECTIVES:
        return None
    group = _first_group(inst.attributes)
    size = len(group) if isinstance(group, list) else group
    if size is None:
        size, group = devices, list(range(devices))  # `{}`: one group of every device
    if size <= 1 and op != "collective-permute":
        return None
    parts = program.top_level(inst.type)
    if inst.opcode != op and op in ("all-gather", "reduce-scatter"):
        half = len(parts) // 2
        parts = parts[half:] if op == "all-gather" else parts[:half]
    moved = sum(b for _, b in _array_bytes(" ".join(parts)))
    if op == "reduce-scatter" and inst.opcode == op:
        moved *= size  # the result is a shard: the whole tensor is g of them
    return op, group, size, moved


def _moves(prog: program.Program, devices: int) -> Iterator[tuple[str, Any, int, int, float]]:
    """`(op, group, size, bytes, runs)` of every collective that moves data: its first replica
    group (device ids, or its size only: `_first_group`), the devices in it, its whole
    tensor's bytes (a reduce-scatter's unscattered operand, an all-gather's result)."""
    for inst, runs in prog.instructions():
        move = _move(inst, devices)
        if move is not None:
            yield (*move, runs)


# a module path with an attention module in it (`block_0/attn/...`, not `ln_attn` or `attn_norm`)
_ATTENTION_NAME = re.compile(r"(^|/)(self_)?(attn|attention)(_\d+)?/|softmax", re.IGNORECASE)


def attention(
    prog: program.Program, length: int | None, per: int = 1, rows: int = 1, context: int = 1
) -> dict:
    """`program.Program.attention` (which fused kernel runs, its calls), with the `[.., L, L]`
    buffers of a materialised attention counted only where they are attention scores: an
    array whose last two dims are `length` (`length / context` queries on a split sequence,
    over the gathered `length` keys), whose leading dims hold a multiple of `rows`
    (a device's sequences x heads), written by an op of an attention module (its module path
    has an `attn` or `attention` module, or it is a softmax). A shape alone cannot tell: a
    LayerNorm's `[B, L, D]` or a scan's `[layers, B, L, D]` with D = L has it too (the tiny
    config's width and length are both 32; Llama 8B's at 4,096)."""
    found = prog.attention(None, per)
    count, size, sites = 0.0, 0, set()
    for inst, runs in prog.kernels() if length else ():
        named = f"{inst.attribute('op_name') or ''} {prog.where(inst)}"
        if not _ATTENTION_NAME.search(named):
            continue
        for dtype, dims in program.arrays(inst.type):
            lead = int(np.prod(dims[:-2]))
            scores = dims[-2:] == (length // context, length)
            if len(dims) >= 3 and scores and lead >= 2 and lead % rows == 0:
                count, size = count + runs / per, size + program.nbytes(dtype, dims)
                sites.add(prog.where(inst))
    name = found["implementation"]  # as it reads with no buffers
    if count:
        fused = found["forward_calls"]
        name = name.removesuffix(", no [B, H, L, L] buffer") if fused else "materialized"
    found |= {"implementation": name, "buffers": count, "buffer_bytes": size}
    return found | {"buffer_sites": sorted(sites)}


# --------------------------------------------------------------------------- GPU hazards

SCATTERS = {"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"}
SCATTERS |= {"select_and_scatter", "select_and_scatter_add"}  # a max-pool's gradient
TRACED_SUMS = ("psum", "psum_invariant", "unreduced_psum", "reduce_scatter")
TRACED_SUMS += ("unreduced_reduce_scatter",)  # psum_scatter; pmean is a psum and a division
TRACED_SUMS += tuple(f"{name}_start" for name in TRACED_SUMS)  # the async forms
KINDS = ("16-bit", "nondeterministic", "deterministic")  # worst first


def is_16_bit(dtype) -> bool:
    """Whether `dtype` is a floating type of 16 bits or fewer (bf16, f16, the fp8s)."""
    return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize <= 2


@dataclasses.dataclass(frozen=True)
class Hazard:
    """A scatter, or a 16-bit sum across devices, of a step as a GPU runs it, `count` times.

    `kind`: "16-bit" (16-bit atomics, slow and nondeterministic, or a sum that drops bits: the
    report warns), "nondeterministic" (atomics whose order varies: fast, but no bit-identical
    reruns) or "deterministic" (no two updates meet, or their order cannot matter).
    """

    op: str
    dtype: str
    where: str
    count: int
    kind: str


def scatter_kind(name: str, dtype, params: dict) -> str:
    """The `Hazard.kind` of the scatter-family primitive `name` on `dtype` with `params`."""
    windows, strides = params.get("window_dimensions"), params.get("window_strides")
    if params.get("unique_indices") or (
        windows and all(s >= w for w, s in zip(windows, strides, strict=True))
    ):
        return "deterministic"  # no two updates meet: unique indices, pooling windows apart
    if name == "scatter":
        return "nondeterministic"  # overwrites, no atomics: which repeated index wins varies
    if is_16_bit(dtype):
        return "16-bit"
    exact = name in ("scatter-min", "scatter-max") or not jnp.issubdtype(dtype, jnp.floating)
    return "deterministic" if exact else "nondeterministic"  # min, max, integer sums: any order


def sixteen_bit_sums(source: str | program.Program) -> Iterator[tuple[str, str, str, float]]:
    """`(op, dtype, op_name, runs)` of every 16-bit floating tensor a compiled module sums across
    devices, dtype by its numpy name, runs per call. XLA:CPU upcasts these: only other backends
    show them."""
    for op, dtype, _, name, runs in collective_ops(source):
        if op in SUMS and dtype in SIXTEEN_BIT:
            yield op, SIXTEEN_BIT[dtype], name, runs


def warning(h: Hazard) -> str:
    """What a 16-bit `Hazard` costs, where it is, and what to do instead."""
    if h.op not in SCATTERS:
        return (
            f"{h.where}: {h.op} sums {h.dtype} across devices ({h.count}x per step): every "
            "16-bit addition drops low bits (of loss-scaled gradients, say), and float16 "
            "overflows above 65504. Cast to float32 before the sum and back after it, as "
            "mptrain's data-parallel step does with its gradients."
        )
    if h.op.startswith("select_and_scatter"):
        fix = "a max-pool's gradient: pool in float32 (cast the pool's input up, its result back)"
    elif h.op in ("scatter-add", "scatter-sub"):
        fix = (
            f"usually the gradient of a gather from a {h.dtype} table (an embedding lookup): "
            "keep the table in float32 and cast the gathered rows (config.keep_fp32, a regex "
            "of param paths, names the params the step leaves in float32), or, for a small "
            "vocabulary, look rows up with a one-hot matmul"
        )
    else:
        fix = f"an indexed update (`x.at[i]`) of a {h.dtype} array: make it in float32"
    return (
        f"{h.where}: {h.op} on {h.dtype} ({h.count}x per step) runs with 16-bit atomics on "
        "GPUs: slow (openxla/xla#26371: about 20x slower than float32 under contention) and "
        f"nondeterministic, so reruns and resumed runs stop being bit-identical. It is {fix}."
    )


def _scatter_name(prog: program.Program, inst: program.Instruction) -> str:
    """`scatter-add`, `scatter-max`, ... by what a compiled scatter's applied function does."""
    if inst.opcode == "select-and-scatter":
        return "select_and_scatter_add"
    applied = re.search(r"to_apply=%([\w.\-]+)", inst.attributes)
    body = prog.computations.get(applied.group(1), []) if applied else []
    root = body[-1].opcode if body else "parameter"  # the root prints last
    suffix = {"add": "-add", "subtract": "-sub", "multiply": "-mul", "maximum": "-max"}
    return "scatter" + (suffix | {"minimum": "-min"}).get(root, "")


def compiled_hazards(prog: program.Program, per: int = 1) -> list[Hazard]:
    """The hazards of a compiled program for a GPU or TPU (not XLA:CPU's, which upcasts
    them): its scatters and its 16-bit sums across devices, each run divided by `per`; worst
    first. The kinds follow `scatter_kind`, from the compiled attributes."""
    found: dict[tuple[str, str, str, str], float] = collections.Counter()
    for inst, runs in prog.instructions():
        if inst.opcode not in ("scatter", "select-and-scatter"):
            continue
        name = _scatter_name(prog, inst)
        dtype = program.dtype_name(inst.arrays[0][0]) if inst.arrays else "?"
        window = inst.attribute("window") or ""
        params: dict = {"unique_indices": "unique_indices=true" in inst.attributes}
        for key, field in (("window_dimensions", "size"), ("window_strides", "stride")):
            values = re.search(rf"\b{field}=([\dx]+)", window)
            params[key] = tuple(int(v) for v in values.group(1).split("x")) if values else None
        if params["window_dimensions"] and params["window_strides"] is None:
            params["window_strides"] = (1,) * len(params["window_dimensions"])
        found[(name, dtype, prog.where(inst), scatter_kind(name, dtype, params))] += runs / per
    for op, dtype, where, runs in sixteen_bit_sums(prog):
        found[(op, dtype, where or "compiled program", "16-bit")] += runs / per
    hazards = [
        Hazard(op, dtype, where, count, kind) for (op, dtype, where, kind), count in found.items()
    ]
    return sorted(hazards, key=lambda h: (KINDS.index(h.kind), -h.count, h.where))
