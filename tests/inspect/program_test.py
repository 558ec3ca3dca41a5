"""Reading compiled programs (`mptrain.inspect.program`, `mptrain.plan.roofline`, `hlo.collectives`) and the
targets a plan compiles for (`mptrain.target`), on small programs written the way XLA prints
them: these need no compiler for the accelerator (`plan_test.py` reads the real ones)."""

import importlib.metadata
import os

import pytest

from mptrain import errors, target
from mptrain import plan as plan_lib
from mptrain.inspect import hlo, program
from mptrain.models import attention
from mptrain.plan import roofline

HERE = os.getcwd()

# A GEMM fusion inside a loop that runs 3 times, a one-hot (pred) embedding matmul, a cuDNN
# attention call, an async all-gather, and stack frames whose innermost one is a library's.
MODULE = f"""HloModule jit_step, is_scheduled=true

FileNames
1 "{HERE}/mptrain/models/layers.py"
2 "/venv/lib/python3.11/site-packages/flax/linen/linear.py"

FunctionNames
1 "embed"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=9}}
2 {{file_name_id=2 function_name_id=1 line=7 end_line=7 column=1 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=2}}

%gemm (p0: bf16[4,8], p1: bf16[8,16]) -> bf16[4,16] {{
  %p0 = bf16[4,8]{{1,0}} parameter(0)
  %p1 = bf16[8,16]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[4,16]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/dense/dot_general" stack_frame_id=2}}
}}

%onehot (q0: pred[4,256], q1: bf16[256,8]) -> bf16[4,8] {{
  %q0 = pred[4,256]{{1,0}} parameter(0)
  %q1 = bf16[256,8]{{1,0}} parameter(1)
  ROOT %dot.2 = bf16[4,8]{{1,0}} dot(%q0, %q1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/embed/dot_general"}}
}}

%fill (r0: bf16[2,64,2,32]) -> f32[2,2,64,64] {{
  %r0 = bf16[2,64,2,32]{{3,2,1,0}} parameter(0)
  ROOT %zero = f32[2,2,64,64]{{3,2,1,0}} broadcast(f32[] constant(0)), dimensions={{}}
}}

%copy (s0: bf16[4,8]) -> bf16[4,8] {{
  ROOT %s0 = bf16[4,8]{{1,0}} parameter(0)
}}

%body (t: (s32[], bf16[4,8], bf16[8,16])) -> (s32[], bf16[4,8], bf16[8,16]) {{
  %t = (s32[], bf16[4,8]{{1,0}}, bf16[8,16]{{1,0}}) parameter(0)
  %x = bf16[4,8]{{1,0}} get-tuple-element(%t), index=1
  %w = bf16[8,16]{{1,0}} get-tuple-element(%t), index=2
  %fusion.1 = bf16[4,16]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%gemm, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}
  ROOT %out = (s32[], bf16[4,8]{{1,0}}, bf16[8,16]{{1,0}}) tuple(%t, %x, %w)
}}

%cond (c: (s32[], bf16[4,8], bf16[8,16])) -> pred[] {{
  %c = (s32[], bf16[4,8]{{1,0}}, bf16[8,16]{{1,0}}) parameter(0)
  ROOT %lt = pred[] constant(true)
}}

ENTRY %main (a: bf16[4,8], b: bf16[8,16], ids: pred[4,256], table: bf16[256,8], q: bf16[2,64,2,32]) -> bf16[4,8] {{
  %a = bf16[4,8]{{1,0}} parameter(0)
  %b = bf16[8,16]{{1,0}} parameter(1)
  %ids = pred[4,256]{{1,0}} parameter(2)
  %table = bf16[256,8]{{1,0}} parameter(3)
  %q = bf16[2,64,2,32]{{3,2,1,0}} parameter(4)
  %init = (s32[], bf16[4,8]{{1,0}}, bf16[8,16]{{1,0}}) tuple(%a, %a, %b)
  %while.1 = (s32[], bf16[4,8]{{1,0}}, bf16[8,16]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  %fusion.2 = bf16[4,8]{{1,0}} fusion(%ids, %table), kind=kLoop, calls=%onehot
  %attn = (bf16[2,2,64,32]{{3,2,1,0}}, f32[2,2,64]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={{"cudnn_fmha_backend_config": {{"intermediate_tensor_shape": {{"dimensions": ["2", "2", "64", "64"]}}, "mask_type": "CAUSAL"}}}}
  %scores = f32[2,2,64,64]{{3,2,1,0}} fusion(%q), kind=kLoop, calls=%fill
  %view = f32[2,2,64,64]{{3,2,1,0:T(8,128)S(1)}} custom-call(%scores), custom_call_target="ConcatBitcast"
  %all-gather-start = ((bf16[2,8]{{1,0}}, f32[4]{{0}}), (bf16[8,8]{{1,0}}, f32[16]{{0}})) all-gather-start(%a, %b), channel_id=1, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, use_global_device_ids=true
  ROOT %done = bf16[4,8]{{1,0}} fusion(%a), kind=kLoop, calls=%copy
}}
"""


@pytest.fixture(scope="module")
def prog():
    return program.Program(MODULE)


def test_a_loop_body_runs_its_known_trip_count(prog):
    assert prog.entry == "main"
    assert prog.times["body"] == 3 and prog.times["gemm"] == 3
    assert "gemm" in prog.fused and "body" not in prog.fused


def test_matmul_flops_by_operand_dtype_weigh_each_by_its_runs(prog):
    found = {inst.name: (dtype, flops, runs) for inst, dtype, flops, runs in roofline.matmuls(prog)}
    assert found["dot.1"] == ("bfloat16", 2 * 4 * 16 * 8, 3)
    assert found["dot.2"][:2] == ("bfloat16", 2 * 4 * 8 * 256)  # a one-hot of booleans
    # cuDNN causal attention: 2 matmuls of B*H*Lq*Lk*D multiply-adds, half of them skipped
    assert found["attn"] == ("bfloat16", 2 * 2 * (2 * 2 * 64 * 64) * 32 * 0.5, 1)
    summed = roofline.matmul_flops(prog, "bfloat16")
    assert summed["flops"] == {"bfloat16": 3 * 1024 + 16384 + 2 * 2 * 16384 * 32 * 0.5}
    assert summed["offenders"] == [] and summed["fp8_kernels"] == {}


def test_where_is_the_innermost_frame_outside_installed_libraries(prog):
    dot = next(inst for inst in prog.computations["gemm"] if inst.opcode == "dot")
    assert prog.where(dot) == "mptrain/models/layers.py:42"  # not flax's linear.py:7
    fusion = next(inst for inst in prog.computations["main"] if inst.name == "fusion.2")
    assert prog.where(fusion) == "fusion.2"  # no frame, no op_name: its own name
    assert prog.lowering(dot) == "Triton GEMM fusion"


def test_kernels_attention_and_largest_buffers(prog):
    kernels = {inst.name: runs for inst, runs in prog.kernels()}
    assert kernels == {
        "fusion.1": 3,
        "fusion.2": 1,
        "attn": 1,
        "scores": 1,
        "all-gather-start": 1,
        "done": 1,
    }
    attention = prog.attention(length=64)
    assert attention["forward_calls"] == 1 and attention["backward_calls"] == 0
    assert attention["buffers"] == 1 and attention["buffer_bytes"] == 4 * 2 * 2 * 64 * 64
    assert attention["implementation"].startswith("cuDNN fused flash attention: 1 forward")
    assert prog.attention(length=None)["buffers"] == 0
    assert prog.largest()[0] == {
        "array": "f32[2,2,64,64]",
        "where": "scores",
        "bytes": 65536,
        "count": 1,
    }


def test_an_async_all_gather_counts_its_gathered_results_once():
    assert hlo.collectives(MODULE) == {"all-gather": {"bf16": 128, "f32": 64}}
    scatter = (
        "ENTRY %main (a: f32[16], b: bf16[8]) -> f32[4] {\n"
        "  %rs = ((f32[16]{0}, bf16[8]{0}), (f32[4]{0}, bf16[2]{0})) reduce-scatter-start(%a, %b),"
        " replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add\n}\n"
    )
    assert hlo.collectives(scatter) == {"reduce-scatter": {"f32": 64, "bf16": 16}}
    assert list(hlo.sixteen_bit_sums(scatter)) == [("reduce-scatter", "bfloat16", "", 1.0)]


def test_a_collective_is_behind_a_matmul_only_where_one_runs_between_its_start_and_done():
    """`hlo.overlap` on a schedule of a 2 x 2 mesh: a gather over `tensor` with a GEMM between
    its start and done is hidden, one with only other work exposed, a synchronous sum over
    `fsdp` exposed."""
    text = """ENTRY %main (a: bf16[8], b: bf16[4,4], c: f32[16]) -> f32[16] {
  %g1 = (bf16[8]{0}, bf16[16]{0}) all-gather-start(%a), replica_groups={{0,1}}, dimensions={0}
  %mm = bf16[4,4]{1,0} custom-call(%b, %b), custom_call_target="__cublas$gemm"
  %d1 = bf16[16]{0} all-gather-done(%g1)
  %g2 = (bf16[8]{0}, bf16[16]{0}) all-gather-start(%a), replica_groups={{0,1}}, dimensions={0}
  %e = bf16[4,4]{1,0} exponential(%b)
  %d2 = bf16[16]{0} all-gather-done(%g2)
  ROOT %s = f32[16]{0} all-reduce(%c), replica_groups={{0,2}}, to_apply=%add
}
"""
    mesh = {"fsdp": 2, "tensor": 2}
    found = hlo.overlap(program.Program(text), mesh)
    assert found == {
        "tensor": {"hidden": 32, "exposed": 32, "count": 2},
        "fsdp": {"hidden": 0, "exposed": 64, "count": 1},
    }
    assert hlo.by_axis(program.Program(text), mesh) == {"tensor": 64, "fsdp": 64}


def test_a_collective_in_a_loop_counts_each_run_and_per_step_divides():
    """`steps_per_call` steps are a while loop: its collectives run once per step, so a plan
    of k steps a call reports each step's bytes, not a k-th of them."""
    looped = """ENTRY %main (p: f32[64]) -> f32[64] {
  ROOT %w = (s32[], f32[64]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""
    body = """%body (s: (s32[], f32[64])) -> (s32[], f32[64]) {
  %x = f32[64]{0} get-tuple-element(%s), index=1
  %ar = f32[64]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %bf = bf16[64]{0} all-reduce(%y), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[64]) tuple(%i, %ar)
}
"""
    text = body + looped
    assert hlo.collectives(text) == {"all-reduce": {"f32": 4 * 256, "bf16": 4 * 128}}
    assert hlo.collectives(text, per=4) == {"all-reduce": {"f32": 256, "bf16": 128}}
    (h,) = hlo.compiled_hazards(program.Program(text), per=4)
    assert (h.op, h.dtype, h.count, h.kind) == ("all-reduce", "bfloat16", 1, "16-bit")


def test_a_collective_inside_a_fusion_counts_as_a_tpu_program_has_them():
    """XLA's TPU compiler puts FSDP's all-gathers inside fusions (with the kernel that uses
    them): they move data all the same."""
    text = """%fused (p: bf16[96,2304]) -> bf16[768,2304] {
  %p = bf16[96,2304]{1,0} parameter(0)
  ROOT %ag = bf16[768,2304]{1,0} all-gather(%p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

ENTRY %main (x: bf16[96,2304]) -> bf16[768,2304] {
  %x = bf16[96,2304]{1,0} parameter(0)
  ROOT %f = bf16[768,2304]{1,0} fusion(%x), kind=kOutput, calls=%fused
}
"""
    assert hlo.collectives(text) == {"all-gather": {"bf16": 768 * 2304 * 2}}


def test_tpu_convolutions_count_only_the_taps_that_land_on_input():
    """Lines of a v5e program: a matmul's input gradient as a padded convolution, and batched
    attention scores as a base-dilated one; their FLOPs are the matmuls'."""
    text = """HloModule m

ENTRY %main (x: bf16[32,32,1], y: bf16[8,64,32], q: bf16[8,64,2,16], k: bf16[8,2,64,64]) -> bf16[8,64,32] {
  %x = bf16[32,32,1]{1,0,2} parameter(0)
  %y = bf16[8,64,32]{1,2,0} parameter(1)
  %q = bf16[8,64,2,16]{3,2,1,0} parameter(2)
  %k = bf16[8,2,64,64]{3,2,1,0} parameter(3)
  %c1 = bf16[8,64,32]{1,2,0} convolution(%x, %y), window={size=8 pad=7_7 rhs_reversal=1}, dim_labels=bf0_0oi->0fb
  ROOT %c2 = bf16[8,2,16,64]{3,2,1,0} convolution(%q, %k), window={size=8x2 stride=7x1 lhs_dilate=8x2}, dim_labels=0f1b_01oi->01bf
}
"""
    found = {i.name: f for i, _, f, _ in roofline.matmuls(program.Program(text))}
    assert found["c1"] == 2 * 512 * 32 * 32  # [B*L, 32] x [32, 32]
    assert found["c2"] == 2 * 8 * 2 * 64 * 64 * 16  # B, H, Lq, Lk, D


def test_a_tpu_on_chip_memory_space_is_not_device_memory():
    text = "(f32[256,768]{1,0:T(8,128)S(1)}, bf16[2,8]{1,0}, s32[]{:S(2)})"
    assert program.arrays(text, hbm=True) == [("bf16", (2, 8))]
    assert program.type_bytes(text) == 4 * 256 * 768 + 32 + 4
    assert program.type_bytes(text, hbm=True) == 32


def test_the_floor_is_the_slower_of_compute_and_memory():
    chip = target.targets()["h100"]
    flops = {"bfloat16": 989.4e12, "float32": 494.7e12}  # a second each at the peaks
    compute = roofline.floor(chip, flops, moved=3.35e12, compute="bfloat16")
    assert compute["compute_s"] == pytest.approx(2.0) and compute["memory_s"] == pytest.approx(1)
    assert compute["bound"] == "compute" and compute["floor_s"] == pytest.approx(2.0)
    assert compute["mfu"] == pytest.approx((989.4 + 494.7) / 989.4 / 2)
    memory = roofline.floor(chip, flops, moved=4 * 3.35e12, compute="bfloat16")
    assert memory["bound"] == "memory" and memory["floor_s"] == pytest.approx(4.0)
    a100 = target.targets()["a100"]
    assert roofline.peak(a100, "float8_e4m3fn") == a100.roofline["float16"]  # no fp8 units


def test_targets_ship_as_spec_files_and_unknown_names_list_the_known():
    names = set(target.targets())
    assert {"h100", "h200", "a100", "b200", "v4", "v5e", "v5p", "v6e"} <= names
    assert plan_lib.TARGETS is target.targets()
    v5e, count = target.get("v5e-8")
    assert (v5e.name, v5e.platform, count) == ("v5e", "tpu", 8)
    assert target.get("H100") == (target.targets()["h100"], None)
    with pytest.raises(errors.ConfigError, match=r"--target='h101': unknown; known targets: a100"):
        target.get("h101")
    h100 = target.targets()["h100"]
    config = h100.gpu_config()
    assert "cuda_compute_capability { major: 9 minor: 0 }" in config
    assert "dnn_version_info { major: 9 minor: 10 }" in config
    assert "device_memory_size: 84942979072" in config and "block_dim_limit_y: 65535" in config
    with pytest.raises(errors.ConfigError, match=r"--devices=12: a h100 plan takes 1, 2, 3"):
        h100.devices(12)


def test_a_missing_compiler_names_the_pip_line(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(
        errors.ConfigError, match=r"jax-cuda12-plugin.*pip install 'mptrain\[plan\]'"
    ):
        target.targets()["h100"].devices(1)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(errors.ConfigError, match=r"TPU targets need libtpu.*mptrain\[plan\]"):
        target.targets()["v5e"].devices(1)


class _Device:
    """What `attention.backend_of` reads of a compile-only device."""

    def __init__(self, platform, capability=None):
        self.platform, self.compute_capability = platform, capability


def test_the_attention_backend_is_read_off_the_target_devices():
    assert attention.backend_of([_Device("tpu")]) == attention.Backend("tpu")
    gpu = attention.backend_of([_Device("gpu", "9.0")])
    assert (gpu.platform, gpu.compute_capability) == ("gpu", (9, 0))
    import jax

    assert attention.backend_of(jax.local_devices()) is attention.local_backend()


def test_a_tpu_flash_kernel_is_found_by_its_name_across_its_attribute_lines():
    text = """HloModule m

ENTRY %main (q: bf16[192,1024,64]) -> bf16[192,1024,64] {
  %q = bf16[192,1024,64]{2,1,0} parameter(0)
  %splash_mha_fwd_residuals.1 = (bf16[192,1024,64]{2,1,0}, f32[192,1024,128]{2,1,0}) custom-call(%q, %q, %q), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="splash"}
  %splash_mha_dkv_no_residuals.1 = (bf16[192,1024,64]{2,1,0}, bf16[192,1024,64]{2,1,0}) custom-call(%q, %q, %q), custom_call_target="tpu_custom_call"
  ROOT %splash_mha_dq_no_residuals.1 = bf16[192,1024,64]{2,1,0} custom-call(%q, %q, %q), custom_call_target="tpu_custom_call"
}
"""
    found = program.Program(text).attention(length=1024)
    assert (found["forward_calls"], found["backward_calls"], found["buffers"]) == (1, 2, 0)
    assert found["implementation"].startswith("Pallas TPU flash attention: 1 forward + 2 backward")


def test_a_tpu_dma_counts_the_device_memory_side_of_each_copy():
    """XLA's TPU compiler keeps small arrays in on-chip memory and moves them with
    asynchronous copies: a prefetch reads device memory, an eviction writes it, and a sliced
    prefetch reads only its slice."""
    text = """HloModule m

ENTRY %main (p: f32[768,384], q: f32[128,768]) -> f32[128,768] {
  %p = f32[768,384]{1,0:T(8,128)} parameter(0)
  %q = f32[128,768]{1,0:T(8,128)} parameter(1)
  %prefetch = (f32[128,768]{1,0:T(8,128)S(1)}, f32[128,768]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%q)
  %got = f32[128,768]{1,0:T(8,128)S(1)} copy-done(%prefetch)
  %evict = (f32[128,768]{1,0:T(8,128)}, f32[128,768]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%got)
  %back = f32[128,768]{1,0:T(8,128)} copy-done(%evict)
  %slice = ((f32[768,384]{1,0:T(8,128)}), f32[192,384]{1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:192], [0:384]}
  %part = f32[192,384]{1,0:T(8,128)S(1)} slice-done(%slice)
  ROOT %out = f32[128,768]{1,0:T(8,128)} add(%back, %back)
}
"""
    prog = program.Program(text)
    dmas = {
        i.name: roofline.dma_bytes(i) for i, _ in prog.instructions() if i.opcode.endswith("start")
    }
    assert dmas == {"prefetch": 4 * 128 * 768, "evict": 4 * 128 * 768, "slice": 4 * 192 * 384}
    kernel = 3 * 4 * 128 * 768  # the add reads %back twice and writes %out
    assert roofline.bytes_moved(prog) == kernel + sum(dmas.values())
