"""What `scripts/bench.py` reports beside its times: model FLOPs, MFU, device memory, the tables.

Model FLOPs are the matmul and convolution FLOPs of one training step, counted the same way on
every backend, so that TFLOP/s and MFU compare across machines and with PyTorch's figures. The
convention is PaLM's and Megatron's: three times the forward pass (the backward takes the
gradients of each matmul's input and of its weights, twice the forward), no recomputation.
It counts the first layer's input gradient, which autodiff skips (the LM's one-hot embedding,
0.06% of GPT-2-small's step; the ResNet's stem, about 0.6%). The forward pass is counted

- for the transformer LM (`lm_flops`): from the config, every matmul written out;
- for any other model: from its traced forward pass, by `mptrain.inspect.audit`, which counts
  each dot and convolution of the jaxpr from its shapes (`traced_flops`).

Not from the traced step: the audit counts the input gradient of a strided convolution at its
dilated size, zeros included (four times the forward for stride 2), which no GPU kernel
multiplies. The audit's count of the step stays in the JSON (`audit_step_gflop_per_step`): for
the LM it is the model FLOPs less the embedding's input gradient, exactly (tests/bench_test.py).
XLA's `cost_analysis()` is kept as a labelled extra column only: on a GPU it leaves out what runs
in library calls (it counted 3.0 GFLOP for a ResNet-18 step that XLA:CPU counts as 372, the
cuDNN convolutions missing), and fused attention kernels likewise.

MFU is model FLOPs per second over the dense peak of the devices the step ran on, for the dtype
of its matmuls (`PEAKS`); a device not in the table (a CPU) gets no MFU. Peak device memory is
the allocator's `peak_bytes_in_use`, where the backend keeps one (GPU, TPU; not the CPU).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from mptrain import config as config_lib
from mptrain.models import layers

# Dense matmul peaks per chip in TFLOP/s, from the vendors' datasheets (no sparsity), by
# operand dtype. "float32" is an fp32 matmul as JAX runs it by default (TF32 on NVIDIA Ampere
# and later, one bf16 pass on a TPU); "float32-highest" is strict fp32, what
# `config.matmul_precision="highest"` asks for ("auto" under fp32 compute): six bf16 passes on a
# TPU (mptrain/targets/*.toml). None: no such unit (TPUs have no fp16 one).
# Patterns match the lower-cased `device.device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite");
# variants not listed (H100 NVL, H200 NVL, ...) have other clocks and get no MFU rather than a
# wrong one.
PEAKS: tuple[tuple[str, str, dict[str, float | None]], ...] = (
    (r"h100 (80gb hbm3|sxm)", "NVIDIA H100 SXM", dict(bf16=989, f16=989, f32=495, strict=67)),
    (r"h100 pcie", "NVIDIA H100 PCIe", dict(bf16=756, f16=756, f32=378, strict=51)),
    (r"h200$", "NVIDIA H200 SXM", dict(bf16=989, f16=989, f32=495, strict=67)),
    (r"a100", "NVIDIA A100", dict(bf16=312, f16=312, f32=156, strict=19.5)),
    (r"^tpu v4$", "Google TPU v4", dict(bf16=275, f16=None, f32=275, strict=45.8)),
    (r"^tpu v5 ?(lite|e)$", "Google TPU v5e", dict(bf16=197, f16=None, f32=197, strict=32.8)),
    (r"^tpu v5p?$", "Google TPU v5p", dict(bf16=459, f16=None, f32=459, strict=76.5)),
)
_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float32-highest": "strict"}


def matmul_dtype(config: Any) -> str:
    """The `PEAKS` column for the matmuls of `config`'s step: its compute dtype, and
    "float32-highest" for float32 at its policy's matmul precision "highest" (what
    `matmul_precision="auto"` picks under fp32 compute)."""
    policy = config_lib.policy_of(config)
    compute = policy.compute_dtype.name
    strict = compute == "float32" and policy.matmul_precision == "highest"
    return "float32-highest" if strict else compute


def peak_tflops(device_kind: str, dtype: str) -> tuple[float | None, str | None]:
    """`(dense peak TFLOP/s of one chip, the chip's name in PEAKS)` for matmuls of `dtype` (a
    `matmul_dtype` result); `(None, None)` for a device not in the table, `(None, name)` for a
    dtype it has no unit for."""
    kind = device_kind.lower().strip()
    for pattern, name, peaks in PEAKS:
        if re.search(pattern, kind):
            return peaks[_SHORT[dtype]], name
    return None, None


def lm_flops(config: Any) -> int:
    """Model FLOPs of one training step of `transformer_lm`, from the config: 3x the forward.

    Forward, per token, with width d, MLP width f, window T (`data.seq_len`), vocabulary V:
      each block: QKV projection 2*3*d*d, attention scores 2*T*d and the weighted sum of the
        values 2*T*d, output projection 2*d*d, MLP 2*2*d*f;
      the head 2*d*V; the embedding, a one-hot matmul for V <= `layers.ONE_HOT_MAX_VOCAB`, 2*V*d
        (above that a gather, no FLOPs).
    The attention counts the whole T x T score matrix, the masked half included: what the model
    materialises, and the convention of PaLM's MFU and of PyTorch's FLOP counter (a causal
    kernel that skips the masked half does about half this attention work).
    """
    m = config.model
    d, f, t = m.d_model, m.d_ff, config.data.seq_len
    vocab = m.get("vocab_size", 256)
    block = 2 * 3 * d * d + 2 * 2 * t * d + 2 * d * d + 2 * 2 * d * f
    embed = 2 * vocab * d if vocab <= layers.ONE_HOT_MAX_VOCAB else 0
    forward = m.num_layers * block + 2 * d * vocab + embed
    return 3 * forward * config.batch_size * t


def traced_flops(report: Any) -> int:
    """Dot and convolution FLOPs of a traced program, in every dtype, from its
    `mptrain.inspect.audit` precision report (its `matmul_flops`)."""
    return int(sum(report.matmul_flops.values()))


def model_flops(config: Any, forward: Callable[[], Any]) -> tuple[int, str]:
    """`(model FLOPs of a step, where they come from)`: `lm_flops` for the transformer LM, else
    3x the audit's count of `forward()`, the precision report of the traced forward pass."""
    if config.model.name == "transformer_lm":
        return lm_flops(config), "3 x forward, from the config (bench_report.lm_flops)"
    return 3 * traced_flops(forward()), "3 x the traced forward pass (mptrain.inspect.audit)"


def flop_figures(config: Any, flops: int, step_ms: float, devices: list) -> dict:
    """A row's FLOP fields: the TFLOP/s that `flops` a step make in `step_ms`, the dense peak of
    `devices` for the preset's matmul dtype and the MFU against it (None: peak unknown)."""
    dtype = matmul_dtype(config)
    chip, name = peak_tflops(devices[0].device_kind, dtype)
    peak = None if chip is None else chip * len(devices)
    tflops = flops / step_ms / 1e9
    return {
        "model_tflop_per_s": tflops,
        "peak_dtype": dtype,
        "peak_device": name,
        "peak_tflop_per_s": peak,
        "mfu": None if peak is None else tflops / peak,
    }


def device_peak_bytes(devices: Any) -> int | None:
    """The largest `peak_bytes_in_use` of `devices` since the process started; None where the
    backend keeps no such count (XLA:CPU). JAX cannot reset it: it is the process's peak."""
    stats = [device.memory_stats() for device in devices]
    if not stats or any(not s or "peak_bytes_in_use" not in s for s in stats):
        return None
    return max(int(s["peak_bytes_in_use"]) for s in stats)


# --------------------------------------------------------------------------- tables


def _num(value: float | None, spec: str, width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}{spec}}"


def case_label(row: dict) -> str:
    """A row's case, with the matmul precision its float32 matmuls ran at ("fp32@highest")."""
    fp32 = row["peak_dtype"].startswith("float32")
    return f"{row['case']}@{row['matmul_precision']}" if fp32 else row["case"]


def print_tables(header: str, rows: list[dict]) -> None:
    """Two tables, the times and the figures, under `header` (device, jax, date)."""
    head = (
        f"{'model':<6} {'case':<15} {'size':<5} {'compile s':>11} {'loop ms':>8} {'bare ms':>8} "
        f"{'hand ms':>8} {'loop/hand':>9} {'bare/hand':>9} {'loop/bare':>9}"
    )
    print(f"\n{header}\n\n{head}\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<6} {case_label(r):<15} {r['size']:<5} "
            f"{r['compile_s']:>5.1f}/{r['hand_compile_s']:<5.1f} "
            f"{r['loop_ms']:>8.2f} {r['bare_ms']:>8.2f} {r['hand_ms']:>8.2f} "
            f"{r['loop_over_hand']:>9.3f} {r['bare_over_hand']:>9.3f} "
            f"{r['loop_steps_per_s_over_bare']:>9.3f}"
        )
    print(
        "compile: mptrain/hand. loop/hand, bare/hand: medians of per-block ratios (lower is "
        "faster for mptrain); loop/bare: the loop's steps/s as a fraction of the bare step's."
    )
    head = (
        f"{'model':<6} {'case':<15} {'per s':>9} {'GFLOP':>9} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'peak':>11} {'XLA GFLOP':>10} {'B/param':>8} {'temp MiB':>15} {'args MiB':>15} "
        f"{'dev MiB':>8}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        rate = r.get("tokens_per_s") or r.get("images_per_s")
        mem, hand = r["memory"], r["hand_memory"]
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "n/a" if r["peak_tflop_per_s"] is None else f"{r['peak_tflop_per_s']:g}"
        peak = f"{peak} {_SHORT[r['peak_dtype']]}"
        print(
            f"{r['model']:<6} {case_label(r):<15} {rate:>9.0f} {r['model_gflop_per_step']:>9.4g} "
            f"{r['model_tflop_per_s']:>8.4g} {mfu:>6} {peak:>11} "
            f"{r['xla_gflop_per_step']:>10.4g} {r['bytes_per_param']:>8.2f} "
            f"{mem['temp_mib']:>7.1f}/{hand['temp_mib']:<7.1f} "
            f"{mem['argument_mib']:>7.1f}/{hand['argument_mib']:<7.1f} "
            f"{_num(r['device_peak_mib'], '.0f', 8)}"
        )
    print(
        "per s: tokens (lm) or images (resnet) a second of the loop. GFLOP: model FLOPs a step, "
        "3x the forward's matmuls and convolutions (lm: from the config, attention's full T x T; "
        "others: the audit's count of the traced forward pass); TFLOP/s and MFU: those over the "
        "loop's step time, MFU against the dense peak of the chips for the row's matmul dtype "
        "(fp32@highest: strict fp32, the fp32 preset's own; fp32@default: TF32 on NVIDIA, one "
        "bf16 pass on a TPU, as JAX runs it by default). XLA GFLOP: XLA's cost analysis of the "
        "step, which misses cuDNN's work on a GPU. temp, args: the compiled steps' memory "
        "analysis, mptrain/hand. dev MiB: the devices' peak bytes in use so far in this process "
        "(both sides' states live at once; run one case per process for a row's own peak)."
    )
