"""The text of a `plan.Plan`: what `python -m mptrain.plan` prints (`str(plan)`)."""

from __future__ import annotations

from typing import Any

GiB = 2**30


def render(plan: Any) -> str:
    """The report of `plan` (a `plan.Plan`): memory against what the run will have, the
    largest buffers, matmul FLOPs by dtype, attention, hazards, collectives, kernels and the
    roofline floor with the side that binds."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in plan.mesh.items())
    idle = getattr(plan, "idle", 0)
    idle = (
        f"; {idle} of the {plan.devices + idle} devices asked for sit idle (the mesh's axes "
        "multiply to fewer: mesh.data=-1 takes every device)"
        if idle
        else ""
    )
    lines = [
        f"plan: {plan.precision} on {plan.devices} x {plan.description} ({plan.target}), "
        f"mesh {mesh}{idle}",
        f"  per device and per step; {'refused' if plan.refused else 'compiled'} for the target "
        f"on this host in {plan.compile_seconds:.1f} s (jax {plan.jax_version}); nothing ran",
        "",
        "memory                          GiB",
    ]
    parts = ("params", "optimizer", "frozen", "other_state", "inputs", "temporaries", "outputs")
    names = {
        "frozen": "frozen base",
        "params": "params (trained)" if plan.memory.get("frozen") else "params",
    }
    for part in parts:
        if part in plan.memory and (part != "frozen" or plan.memory[part]):
            name = names.get(part, part.replace("_", " "))
            lines.append(f"  {name:<24} {plan.memory[part] / GiB:9.3f}")
    lines.append(f"  {'total':<24} {plan.memory['total'] / GiB:9.3f}   {plan.verdict()}")
    lines.append(
        f"  planned against {plan.capacity / GiB:.1f} GiB: {plan.share['why']}, of the "
        f"device's {plan.share['device'] / GiB:.1f} GiB; state "
        f"{plan.state_bytes_per_param:.2f} bytes a parameter"
        + (
            f" trained; the frozen base {plan.frozen_bytes_per_param:.2f} bytes a parameter "
            f"({plan.frozen_params:,} params)"
            if plan.frozen_params
            else ""
        )
    )
    remat = plan.xla_remat
    if remat:
        lines.append(
            f"  XLA's own rematerialisation: {remat['before'] / GiB:.1f} GiB before, "
            f"{remat['after'] / GiB:.1f} GiB after (its limit {remat['limit'] / GiB:.1f} "
            "GiB)"
            + (
                f", {remat['recompute_flops'] / 1e12:.1f} TFLOP recomputed a step "
                f"(+{100 * remat['recompute_share']:.0f}% of the step's FLOPs)"
                if "recompute_flops" in remat
                else ""
            )
        )
    if plan.refused:  # no program: the memory from shapes and the compiler's count
        lines += [
            "",
            "no program to read: the compiler refused the step, so its buffers, FLOPs, hazards,",
            "collectives and floor are unknown; the memory above is the state and inputs by",
            "their shapes and the temporaries as the compiler counted them, a lower bound",
        ]
        return "\n".join(lines) + "\n"
    if plan.memory.get("host"):
        host = plan.memory["host"] / GiB
        lines.append(f"  {'host (pinned), apart':<24} {host:9.3f}   offloaded activations")
    lines += ["", "largest buffers the kernels write (count x type, GiB each, where):"]
    lines += [
        f"  {b['count']:>5g} x {b['array']:<26} {b['bytes'] / GiB:7.3f}  {b['where']}"
        for b in plan.largest[:5]
    ]
    total = sum(plan.matmul_flops.values()) or 1.0
    kept = f"; {len(plan.kept_fp32)} params kept fp32" if plan.kept_fp32 else ""
    lines += ["", f"matmul FLOPs by operand dtype{kept}:"]
    for dtype, flops in sorted(plan.matmul_flops.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {dtype:<24} {flops / 1e12:10.3f} TFLOP  {100 * flops / total:6.2f}%")
    lines += [f"  not in the compute dtype: {o['where']} ({o['dtype']})" for o in plan.offenders]
    att = plan.attention
    lines += ["", f"attention: {att['implementation']}"]
    if att["buffers"]:
        lines.append(
            f"  {att['buffers']:g} [.., L, L] buffers ({att['buffer_bytes'] / GiB:.2f} GiB in "
            f"all) at {', '.join(att['buffer_sites'])}"
        )
    lines += ["", "hazards (scatters; 16-bit sums across devices):"]
    lines += [
        f"  {h['kind']:<16} {h['op']:<22} {h['dtype']:<9} x{h['count']:g}  {h['where']}"
        for h in plan.hazards
    ] or ["  none"]
    lines += ["", "collectives (bytes a step):"]
    for op, by_dtype in sorted(plan.collectives.items()):
        lines.append(f"  {op:<15} " + ", ".join(f"{d} {b:,}" for d, b in by_dtype.items()))
        sites = plan.collective_sites.get(op, [])
        lines += (
            [f"    at {', '.join(sites[:4])}" + (", ..." if len(sites) > 4 else "")]
            if sites
            else []
        )
    lines += [] if plan.collectives else ["  none"]
    if plan.axis_bytes:
        by_axis = ", ".join(f"{axes} {b:,}" for axes, b in sorted(plan.axis_bytes.items()))
        lines.append(f"  by mesh axis   {by_axis}")
        hidden = [f"{a} {v['hidden'] / 1e9:.1f} of {plan.axis_bytes[a] / 1e9:.1f} GB, "
                  f"{v['count']:,} ops" for a, v in sorted(plan.axis_overlap.items())
                  if v["hidden"]]  # fmt: skip
        lines += [f"  behind matmuls {'; '.join(hidden)} (the schedule's starts and dones)"]
    lines += [f"  XLA resharded by gathering whole: {line.strip()}" for line in plan.involuntary]
    floor = plan.floor
    lines += [
        "",
        f"kernels: {plan.kernels:,.0f} a step (a lower bound: a library call may launch several)",
        "",
        "roofline floor: the least time this chip's peaks allow, NOT a measurement",
        f"  compute {total / 1e12:9.3f} TFLOP at "
        + ", ".join(f"{p / 1e12:.0f} TFLOP/s ({d})" for d, p in floor["peaks"].items())
        + f": {1e3 * floor['compute_s']:.3f} ms",
        f"  memory  {plan.bytes_moved / 1e9:9.3f} GB read and written at "
        f"{floor['bandwidth'] / 1e12:.2f} TB/s: {1e3 * floor['memory_s']:.3f} ms",
    ]
    lines += [
        f"  collectives {link['bytes'] / 1e9:5.3f} GB sent by each device over {name} at "
        f"{link['rate'] / 1e9:.0f} GB/s each way: {1e3 * link['seconds']:.3f} ms"
        for name, link in floor["network"].items()
    ]
    lines += [
        f"  floor   {1e3 * floor['floor_s']:.3f} ms a step, {floor['bound']}-bound: at most "
        f"{100 * floor['mfu']:.0f}% MFU (of {floor['mfu_peak'] / 1e12:.0f} TFLOP/s, "
        f"{floor['mfu_dtype']})",
    ]
    fp8 = sum(v for d, v in plan.matmul_flops.items() if d.startswith("float8"))
    if fp8 and "without_fp8_s" in floor:  # (a plan read back from an older JSON has none)
        lines.append(
            f"  fp8     {100 * fp8 / total:.0f}% of the FLOPs; at {floor['mfu_dtype']}'s peak "
            f"the floor would be {1e3 * floor['without_fp8_s']:.3f} ms: fp8 "
            f"{floor['without_fp8_s'] / floor['floor_s']:.2f}x on this floor"
        )
    lines += [""] + [f"note: {note}" for note in plan.notes] if plan.notes else []
    return "\n".join(lines) + "\n"
