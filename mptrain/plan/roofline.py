"""What a compiled step costs on a chip at best: FLOPs at its peaks, bytes at its bandwidth.

`matmuls` finds a compiled program's matrix products (`program.Program`): every dot (those in
GEMM fusions included), convolution, cuBLAS GEMM and cuDNN convolution or fused attention, with
its operand dtype and FLOPs. `matmul_flops` sums them by how the chip runs them: the operand
dtype, with float32 split by precision: XLA's default (TensorFloat-32
on NVIDIA tensor cores, one bfloat16 pass on a TPU) or HIGHEST (true float32). `floor` turns
those, the bytes the kernels move and the bytes the collectives send into the least time a
step can take, max(FLOPs / peak, bytes / bandwidth, sent / link rate), and the MFU that floor
implies. The floor is a bound, not a measurement: a real step also waits on launches, on
collectives that do not overlap, on non-matmul work that is not memory-bound, and on kernels
that do not reach the peak.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from mptrain.inspect import program
from mptrain.recipe import precision

GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# cuDNN's block-scaled GEMM (MXFP8, `mptrain.recipe.mxfp8`): [B, M, K] x [B, N, K] -> [B, M, N]
BLOCK_SCALED = "__cudnn$blockScaledDot"
CONVOLUTIONS = ("__cudnn$convForward", "__cudnn$convBackwardInput", "__cudnn$convBackwardFilter")
CONVOLUTIONS += ("__cudnn$convBiasActivationForward",)


def matmuls(prog: program.Program) -> Iterator[tuple[program.Instruction, str, float, float]]:
    """`(instruction, operand dtype, FLOPs, runs per call)` of every matrix product of `prog`."""
    for inst, runs in prog.instructions():
        target = inst.attribute("custom_call_target") or ""
        if inst.opcode == "dot" or target in GEMMS:
            flops = _dot_flops(prog, inst, target)
        elif target == BLOCK_SCALED:
            lhs, out = program.arrays(prog.operand_type(inst, 0)), inst.arrays
            flops = 2.0 * math.prod(out[0][1]) * lhs[0][1][-1] if lhs and out else 0.0
        elif inst.opcode == "convolution" or target in CONVOLUTIONS:
            flops = _convolution_flops(prog, inst, target)
        elif target.startswith(program.ATTENTION):
            flops = _attention_flops(prog, inst, target)
        else:
            continue
        yield inst, _operand_dtype(prog, inst), flops, runs


def _operand_dtype(prog: program.Program, inst: program.Instruction) -> str:
    """The dtype a matmul multiplies in: its widest floating operand (a one-hot of
    booleans times a bf16 table is a bf16 matmul; bf16 times f32 runs in f32)."""
    found = [program.arrays(prog.operand_type(inst, i))[:1] for i in range(2)]
    dtypes = [program.dtype_name(a[0][0]) for a in found if a]
    floats = [d for d in dtypes if d.startswith(("float", "bfloat"))]
    if not floats:
        return dtypes[0] if dtypes else "?"
    return max(floats, key=lambda d: int(re.search(r"\d+", d).group()))


def _dot_flops(prog: program.Program, inst: program.Instruction, target: str) -> float:
    if target:  # a cuBLAS call: its dimension numbers are in its backend config
        numbers = inst.backend_config().get("gemm_backend_config", {})
        numbers = numbers.get("dot_dimension_numbers", {})
        contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    else:
        dims = inst.attribute("lhs_contracting_dims") or ""
        contracting = [int(d) for d in re.findall(r"\d+", dims)]
    lhs = program.arrays(prog.operand_type(inst, 0))
    out = inst.arrays
    if not lhs or not out:
        return 0.0
    return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in contracting)


def _convolution_flops(prog: program.Program, inst: program.Instruction, target: str) -> float:
    """2 multiply-adds for every (output element, input feature, window tap) that falls on
    a real input: padding and a base (lhs) dilation's holes are no work. TPUs write their
    matmuls, batched ones included, as such convolutions. A cuDNN call counts its whole
    windows (its operands play the forward convolution's parts by what it computes)."""
    labels = re.split(r"_|->", inst.attribute("dim_labels") or "")
    shapes = [program.arrays(prog.operand_type(inst, i))[:1] for i in range(2)] + [inst.arrays[:1]]
    if len(labels) != 3 or not all(shapes):
        return 0.0
    if target:
        out, kernel = {
            "__cudnn$convBackwardInput": (shapes[0], shapes[1]),
            "__cudnn$convBackwardFilter": (shapes[1], shapes[2]),
        }.get(target, (shapes[2], shapes[1]))
        features = kernel[0][1][labels[1].index("o")]
        return 2.0 * math.prod(out[0][1]) * math.prod(kernel[0][1]) / features
    lhs, rhs, out = (shape[0][1] for shape in shapes)
    window = _window(inst.attribute("window") or "")
    taps = 1
    for d, size in enumerate(window["size"]):
        taps *= _valid_taps(
            lhs[labels[0].index(str(d))],
            out[labels[2].index(str(d))],
            size,
            window["stride"][d],
            window["pad"][d],
            window["lhs_dilate"][d],
            window["rhs_dilate"][d],
        )
    batch, features = out[labels[2].index("b")], out[labels[2].index("f")]
    return 2.0 * batch * features * rhs[labels[1].index("i")] * taps


def _attention_flops(prog: program.Program, inst: program.Instruction, target: str) -> float:
    """cuDNN flash attention: 2 matmuls of `[B,H,Lq,D] x [B,H,D,Lk]` size forward, 5 in the
    backward pass (scores recomputed, then the gradients of values, probabilities, queries
    and keys); causal masking skips half of each. Packed rows (`PADDING_CAUSAL`, cuDNN's
    packed layout) are counted as one causal row: the kernel also skips the tiles between
    examples, so their share of it is an upper bound (rows of n equal examples do 1/n of it).
    A sliding window of W keys (`sliding_window_length`) does W(W+1)/2 + (L-W)W of the L^2
    (query, key) pairs, the tiles outside it skipped. A padding mask over `Lk` keys for `Lq`
    queries is a split sequence's prefix (`models.decoder.context_attention`, its only user): device
    `i`'s two chunks see `i c` and `(2C - 1 - i) c` of the keys, `C = Lk / (2 Lq)`, so a call
    does `(2C - 1) / (4C)` of its product on average, the kernel skipping the keys past the
    length."""
    config = inst.backend_config().get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    query = program.arrays(prog.operand_type(inst, 0))
    if not scores or not query:
        return 0.0
    matmuls = 5 if "Backward" in target else 2
    causal = 0.5 if config.get("mask_type") in ("CAUSAL", "PADDING_CAUSAL") else 1.0
    window, length = int(config.get("sliding_window_length") or 0), scores[-1]
    if causal < 1 and 0 < window < length:
        causal = (window * (window + 1) / 2 + (length - window) * window) / length**2
    if config.get("mask_type") == "PADDING" and length > scores[-2]:
        context = length / (2 * scores[-2])
        causal = (2 * context - 1) / (4 * context)
    return 2.0 * matmuls * math.prod(scores) * query[0][1][-1] * causal


def _window(text: str) -> dict[str, list]:
    """A convolution's `window={size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=...}`, defaulted."""
    fields = dict(re.findall(r"(\w+)=([\w\-]+)", text))
    size = [int(n) for n in fields.get("size", "").split("x") if n]
    found = {"size": size}
    for key in ("stride", "lhs_dilate", "rhs_dilate"):
        found[key] = [int(n) for n in fields[key].split("x")] if key in fields else [1] * len(size)
    pads = fields.get("pad", "").split("x") if "pad" in fields else ["0_0"] * len(size)
    found["pad"] = [int(p.split("_")[0]) for p in pads]
    return found


def _valid_taps(size: int, out: int, window: int, stride: int, pad: int, lhs: int, rhs: int):
    """How many (output position, window tap) pairs of one spatial dimension land on a real
    input element, not on padding or a hole of the input's dilation."""
    where = np.arange(out)[:, None] * stride + np.arange(window)[None, :] * rhs - pad
    return int(np.sum((where >= 0) & (where % lhs == 0) & (where // lhs < size)))


def is_highest(inst: program.Instruction) -> bool:
    """Whether a matmul asks for full float32 precision (HIGHEST, or the F32_F32_F32 algorithm)."""
    text = inst.attributes.lower()
    names = "|".join(precision.FULL_FLOAT32)  # as XLA prints them: `highest`, `dot_f32_f32_f32`
    return bool(re.search(rf"operand_precision=\{{({names})|\"({names})\"|dot_({names})", text))


def matmul_flops(prog: program.Program, compute: str, per: int = 1) -> dict[str, Any]:
    """The matmuls of `prog`, each run divided by `per` (the steps a call runs):

    `flops`: FLOPs by operand dtype (`float32_highest` for float32 at HIGHEST); `offenders`: the
    five biggest source lines outside the `compute` dtype and fp8 (none under float32 compute);
    `fp8_kernels`: how the fp8 matmuls are lowered, `{kernel kind: count}`.
    """
    flops: dict[str, float] = collections.Counter()
    outside: dict[tuple[str, str], float] = collections.Counter()
    fp8: dict[str, float] = collections.Counter()
    for inst, dtype, value, runs in matmuls(prog):
        key = "float32_highest" if dtype == "float32" and is_highest(inst) else dtype
        flops[key] += value * runs / per
        if dtype.startswith("float8"):
            fp8[prog.lowering(inst)] += runs / per
        elif dtype != compute:
            outside[(prog.where(inst), key)] += value * runs / per
    offenders = [
        {"where": where, "dtype": dtype, "flops": value}
        for (where, dtype), value in sorted(outside.items(), key=lambda kv: -kv[1])[:5]
    ]
    return {
        "flops": dict(flops),
        "offenders": offenders if compute != "float32" else [],
        "fp8_kernels": dict(fp8),
    }


def peak(chip: Any, dtype: str) -> float:
    """`chip`'s matmul rate for `dtype` (a `target.Target`), else the nearest it has: fp8 on
    a chip without fp8 tensor cores runs as 16-bit, float16 on a TPU as bfloat16."""
    nearest = {"float8": ("float16", "bfloat16"), "float16": ("bfloat16",)}
    family = "float8" if dtype.startswith("float8") else dtype
    for name in (dtype, *nearest.get(family, ())):
        if chip.peak(name):
            return chip.peak(name)
    return chip.roofline["float32_highest"]


def floor(
    chip: Any, flops: dict[str, float], moved: float, compute: str, network: dict | None = None
) -> dict[str, Any]:
    """The floor of a step on `chip` from its FLOPs by dtype, its bytes moved and its
    collectives' traffic (`hlo.traffic`: seconds by link), max(compute, memory, collectives),
    with the side that binds named, and the MFU it implies against the peak of the `compute`
    dtype (float32 at HIGHEST where most of the float32 FLOPs ask for it: the rate of the
    precision that runs). Nothing is taken to overlap less than perfectly: each side is the
    least time its own resource needs."""
    peaks = {dtype: peak(chip, dtype) for dtype in flops}
    sides = {
        "compute": sum(value / peaks[dtype] for dtype, value in flops.items()),
        "memory": moved / chip.roofline["bandwidth"],
        "collectives": sum(link["seconds"] for link in (network or {}).values()),
    }
    bound = max(sides, key=sides.get)
    floor_s = max(sides[bound], 1e-12)
    if compute == "float32" and flops.get("float32_highest", 0) > flops.get("float32", 0):
        compute = "float32_highest"
    reference = peak(chip, compute)
    # the same step with its fp8 matmuls at the compute dtype's peak: what fp8 buys on this floor
    slow = {d: peak(chip, compute) if d.startswith("float8") else peaks[d] for d in flops}
    unfp8 = max(sum(v / slow[d] for d, v in flops.items()), sides["memory"], sides["collectives"])
    return {
        "without_fp8_s": unfp8,
        "compute_s": sides["compute"],
        "memory_s": sides["memory"],
        "collectives_s": sides["collectives"],
        "network": network or {},
        "floor_s": floor_s,
        "bound": bound,
        "bandwidth": chip.roofline["bandwidth"],
        "peaks": peaks,
        "mfu_dtype": compute,
        "mfu_peak": reference,
        "mfu": sum(flops.values()) / floor_s / reference,
    }


def dma_bytes(inst: program.Instruction) -> int:
    """Device-memory bytes of an asynchronous copy (a TPU's DMA into or out of on-chip memory):
    a `copy-start`, typed (destination, source, context), reads its source and writes its
    destination; a `slice-start`, ((source), destination, context), reads of its source the
    slice it writes. Each side counts where it is in device memory."""
    sides = program.placed(inst.type)
    if inst.opcode == "copy-start":
        return sum(program.nbytes(d, dims) for d, dims, hbm in sides[:2] if hbm)
    if inst.opcode == "slice-start":
        (_, _, source), (dtype, dims, destination) = sides[:2]
        return program.nbytes(dtype, dims) * (source + destination)
    return 0


def bytes_moved(prog: program.Program, per: int = 1) -> float:
    """Bytes the kernels of `prog` and its asynchronous copies read from and write to device
    memory (HBM; not a TPU's on-chip memory), each once per run (no cache reuse), over `per`:
    the floor's memory side. A kernel counts what it touches (`kernel_bytes`): a slice of a
    stacked buffer, not the buffer."""
    total = 0.0
    for inst, runs in prog.kernels():
        total += runs * kernel_bytes(prog, inst)
    for inst, runs in prog.instructions(control_only=True):
        total += runs * dma_bytes(inst)
    return total / per


def kernel_bytes(prog: program.Program, inst: program.Instruction) -> float:
    """Bytes one run of the kernel `inst` reads and writes in device memory: each operand and
    result whole, except where it moves a slice of a buffer in place. A dynamic-update-slice
    (alone, or the root of a fusion, of a tuple's element) writes its update into the buffer
    it was given, which it neither reads nor rewrites; a fused parameter that only reaches
    dynamic-slices (through bitcasts) is read a slice at a time. A scanned model's layer
    writes its slice of the stacked activations and reads its layer's slice of the stacked
    params: counting those buffers whole counted each a layer's count of times too many."""
    hbm = lambda type_text: program.type_bytes(type_text, hbm=True)
    operands = [prog.types.get(name, "") for name in inst.operands]
    if inst.opcode == "dynamic-update-slice":  # in place: the update in, the update out
        return 2 * hbm(operands[1]) + sum(hbm(t) for t in operands[2:])
    if inst.opcode == "dynamic-slice":
        return 2 * hbm(inst.type) + sum(hbm(t) for t in operands[1:])
    callee = (inst.attribute("calls") or "").lstrip("%")
    body = prog.computations.get(callee)
    if inst.opcode != "fusion" or not body:
        return hbm(inst.type) + sum(hbm(t) for t in operands)
    users = collections.defaultdict(list)
    for user in body:
        for position, name in enumerate(user.operands):
            users[name].append((user, position))
    params = {p.index: p for p in body if p.opcode == "parameter"}

    def read(name: str) -> float | None:  # the bytes read through `name`; None: all of it
        found = 0.0
        for user, position in users[name]:
            if user.opcode in program.VIEWS:
                inner = read(user.name)
                if inner is None:
                    return None
                found += inner
            elif user.opcode == "dynamic-slice" and position == 0:
                found += hbm(user.type)
            elif not (user.opcode == "dynamic-update-slice" and position == 0):
                return None
        return found

    total = 0.0
    for i, type_text in enumerate(operands):
        through = read(params[i].name) if i in params else None
        total += hbm(type_text) if through is None else min(hbm(type_text), through)
    return total + sum(hbm(t) for t in prog.written(inst))  # a slice in place: the slice
