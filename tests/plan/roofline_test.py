"""The floor's memory side counts what kernels move (issue 43): a scanned model's layer reads
and writes its slice of a stacked buffer in place, so a kernel's dynamic-slice or
dynamic-update-slice counts the slice, not the buffer. Compiled for this CPU: XLA fuses the
slices of a scan's loop here as it does for a GPU, and no accelerator compiler is needed."""

import jax
import jax.numpy as jnp
import pytest

from mptrain.inspect import program
from mptrain.plan import roofline

LAYERS, N = 16, 256
LAYER = N * N * 4  # bytes of one layer's f32[N, N] slice
STACKED = LAYERS * LAYER


def _scanned_compiled():
    def layers(xs, w):  # reads layer i's slice of xs, writes layer i's slice of the output
        def layer(carry, x):
            y = jnp.tanh(x @ w + carry)
            return y, 2.0 * y

        return jax.lax.scan(layer, jnp.zeros((N, N)), xs)

    xs = jax.ShapeDtypeStruct((LAYERS, N, N), jnp.float32)
    w = jax.ShapeDtypeStruct((N, N), jnp.float32)
    return jax.jit(layers).lower(xs, w).compile()


def _scanned_program() -> program.Program:
    return program.Program(_scanned_compiled().as_text())


def _slicing(prog, opcode):
    """The loop's kernels whose work is `opcode` (alone, or inside their fusion)."""
    found = []
    for inst, runs in prog.kernels():
        body = prog.computations.get((inst.attribute("calls") or "").lstrip("%"), [])
        if runs == LAYERS and (inst.opcode == opcode or any(b.opcode == opcode for b in body)):
            found.append(inst)
    return found


def test_a_stacked_buffers_slices_are_counted_as_slices():
    prog = _scanned_program()
    reads, writes = _slicing(prog, "dynamic-slice"), _slicing(prog, "dynamic-update-slice")
    assert reads and writes, prog.text
    for inst in reads + writes:
        whole = program.type_bytes(inst.type) + sum(
            program.type_bytes(prog.types[name]) for name in inst.operands
        )
        assert whole >= STACKED  # a stacked buffer is among what it is given or returns
        assert roofline.kernel_bytes(prog, inst) <= 2 * LAYER + 64, inst  # a slice in, one out
    # The whole call: each layer moves about ten [N, N] arrays (its slices, the matmul, the
    # tanh; 11 x STACKED in all), where counting the stacked buffers whole once a layer gave 56
    assert roofline.bytes_moved(prog) <= 16 * STACKED
    # and the plan's list of what kernels write names the layer's slice, not the stack: the
    # stacked output is written whole once (made before the loop), never once a layer
    for inst in writes:
        assert all(program.type_bytes(t) <= LAYER + 64 for t in prog.written(inst)), inst
    stacks = [row for row in prog.largest() if row["bytes"] >= STACKED]
    assert all(row["count"] <= 1 for row in stacks), prog.largest()


def test_the_kernels_bytes_agree_with_xlas_own_cost_analysis():
    """XLA:CPU's cost analysis ("bytes accessed") counts each kernel once, a loop's body too,
    where the floor counts the body as often as the loop runs: summed once a kernel, the
    floor's bytes are XLA's (7,077,941 against 7,078,037 here: a few scalars apart). A GPU
    program compiled without the GPU has no cost analysis to compare with."""
    compiled = _scanned_compiled()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    prog = program.Program(compiled.as_text())
    once = sum(roofline.kernel_bytes(prog, inst) for inst, _ in prog.kernels())
    assert once == pytest.approx(analysis["bytes accessed"], rel=1e-4)


class _Fmha:
    """A cuDNN fused attention call as the compiled program holds one: its backend config and
    its query operand's type, `[B, L, H, D]`."""

    def __init__(self, **config):
        self.config = {"intermediate_tensor_shape": {"dimensions": ["2", "4", "64", "64"]}}
        self.config |= {"mask_type": "CAUSAL", **config}

    def backend_config(self):
        return {"cudnn_fmha_backend_config": self.config}

    def operand_type(self, inst, index):
        return "bf16[2,64,4,16]{3,2,1,0}"


def test_a_sliding_windows_attention_counts_the_pairs_inside_it():
    """Causal attention over L = 64 does L^2 / 2 of the score pairs; a window of W keys does
    W(W+1)/2 + (L-W)W of them (each query its W keys once the window fills)."""
    causal, fwd = _Fmha(), "__cudnn$fmhaSoftmax"
    full = roofline._attention_flops(causal, causal, fwd)
    assert full == 2 * 2 * (2 * 4 * 64 * 64) * 16 * 0.5  # two matmuls, half the pairs
    windowed = _Fmha(sliding_window_length=8)
    pairs = 8 * 9 / 2 + (64 - 8) * 8
    assert roofline._attention_flops(windowed, windowed, fwd) == full * pairs / (64 * 64 / 2)
    backward = roofline._attention_flops(windowed, windowed, "__cudnn$fmhaSoftmaxBackward")
    assert backward == roofline._attention_flops(windowed, windowed, fwd) * 5 / 2
    wide = _Fmha(sliding_window_length=64)  # a window as long as the row: plain causal
    assert roofline._attention_flops(wide, wide, fwd) == full
