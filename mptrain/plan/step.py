"""A run's train step compiled for an accelerator that need not be here, and read: a `Plan`.

`plan(config, target, devices)` builds the Trainer of `config.trainer` for `devices`
compile-only devices of the target (`mptrain.target`), compiles its own train step (state,
shardings, `steps_per_call`, donation) from abstract shapes, and reads the program
(`mptrain.inspect.program`). `python -m mptrain.plan` (`mptrain.plan`) is its command line, and the
module doc there says what a plan reports.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import time
from typing import Any

from mptrain import errors
from mptrain import target as target_lib
from mptrain.inspect import hlo, program
from mptrain.plan import memory as plan_memory
from mptrain.plan import roofline

EXIT_DOES_NOT_FIT = 4
GiB = 2**30
TARGETS = target_lib.targets()  # every target by name, from mptrain/targets/*.toml


@dataclasses.dataclass
class Plan:
    """A run's step as compiled for a target; `str(plan)` is the report, `to_json()` its data.

    Figures are per device and per step (a call of `steps_per_call` steps is divided by it);
    bytes are bytes, FLOPs are FLOPs, times are seconds.
    """

    target: str
    description: str
    devices: int
    mesh: dict[str, int]
    precision: str
    steps_per_call: int
    memory: dict[str, int]
    capacity: int  # the bytes the run will have: the device's, times `share`
    share: dict[str, Any]  # {"fraction": 0.75, "why": "JAX's default ...", "device": bytes}
    xla_remat: dict[str, Any]  # XLA's own rematerialisation: {} where it did none
    state_bytes_per_param: float  # params and optimizer state, all devices, per parameter
    largest: list[dict[str, Any]]
    matmul_flops: dict[str, float]
    offenders: list[dict[str, Any]]
    fp8_kernels: dict[str, float]  # how the fp8 matmuls are lowered: {kernel kind: count}
    attention: dict[str, Any]
    hazards: list[dict[str, Any]]
    collectives: dict[str, dict[str, int]]
    collective_sites: dict[str, list[str]]  # by op, the source lines the program names
    kept_fp32: list[str]
    kernels: float
    bytes_moved: float
    floor: dict[str, Any]
    notes: list[str]
    compile_seconds: float
    jax_version: str
    # the compiler's own words where it refused the step for want of memory (a TPU's compiler
    # does): then no program was read, and the memory is the state, the inputs and the
    # temporaries the compiler named
    refused: str = ""
    # a LoRA run's frozen base (`lora`): its params and bytes a parameter (0, 0.0: none)
    frozen_params: int = 0
    frozen_bytes_per_param: float = 0.0
    axis_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # `hlo.by_axis`
    axis_overlap: dict[str, dict] = dataclasses.field(default_factory=dict)  # `hlo.overlap`
    involuntary: list[str] = dataclasses.field(default_factory=list)  # XLA's resharding remat
    idle: int = 0  # devices asked for (--devices) that the config's mesh leaves out

    @property
    def fits(self) -> bool:
        return not self.refused and self.memory["total"] <= self.capacity

    def verdict(self) -> str:
        total, share = self.memory["total"] / GiB, self.memory["total"] / self.capacity
        if self.refused:
            return (
                f"does not fit: needs {total:.1f} GiB or more of {self.capacity / GiB:.1f}; "
                f"XLA's {self.target} compiler refused the step: {self.refused}"
            )
        if self.fits:
            return f"fits, {100 * share:.0f}% of {self.capacity / GiB:.1f} GiB"
        if self.memory["total"] <= self.share["device"]:
            return (
                f"does not fit the {self.capacity / GiB:.1f} GiB the run will have "
                f"({self.share['why']}): needs {total:.1f} GiB; memory_fraction="
                f"{math.ceil(100 * self.memory['total'] / self.share['device']) / 100:.2f} "
                "would give it that"
            )
        where = "; ".join(
            f"{b['count']:g} x {b['array']} ({b['bytes'] / GiB:.2f} GiB) at {b['where']}"
            for b in self.largest[:3]
        )
        return (
            f"does not fit: needs {total:.1f} GiB of {self.capacity / GiB:.1f}; largest "
            f"buffers: {where}"
        )

    def ways_to_fit(self) -> str:
        """What makes a step that does not fit fit: `--fit`'s search, and where the data axis
        keeps the whole state on each of its devices, the state split over them."""
        ways = "--fit searches the memory knobs (precision, moments, remat, micro-batches)"
        data, fsdp = self.mesh.get("data", 1), self.mesh.get("fsdp", 1)
        if data > 1:
            ways += (
                f"; the data axis keeps the whole state on each of its {data} devices: "
                f"--config.mesh.data=1 --config.mesh.fsdp={data * fsdp} splits it over them"
            )
        return ways

    def to_json(self) -> str:
        data = dataclasses.asdict(self) | {"fits": self.fits, "verdict": self.verdict()}
        return json.dumps(data, indent=2)

    def __str__(self) -> str:
        from mptrain.plan import report as plan_report

        return plan_report.render(self)


def check_devices(target: Any, named: int | None, devices: int | None) -> None:
    """A `ConfigError` for a `--devices` that a plan (or a fit) cannot take: below 1, or
    another count than the one `--target` names (v5e-8)."""
    if devices is not None and named is not None and devices != named:
        raise errors.ConfigError(
            f"--target={target} names {named} devices and --devices={devices}: give one count"
        )
    if devices is not None and devices < 1:
        raise errors.ConfigError(f"--devices={devices}: a plan is for 1 device or more")


def plan(
    config, target: str | target_lib.Target, devices: int | None = None, check_remat=True
) -> Plan:
    """The `Plan` of `config` on `devices` devices of `target` (a name from `TARGETS`, or a
    `target.Target`); a `ConfigError` for a bad config, target or device count, or a compiler
    that is not installed. JAX's backends must start with `JAX_PLATFORMS=cpu` (see `target`).
    With `check_remat`, a GPU step near XLA's memory limit is compiled a second time without
    XLA's own rematerialisation, to report the FLOPs it recomputes (`Plan.xla_remat`)."""
    import jax

    from mptrain import config as config_lib
    from mptrain import runtime
    from mptrain.train import launch

    chip, named = target_lib.get(target) if isinstance(target, str) else (target, None)
    with errors.config_errors():
        runtime.set_determinism(config)  # the GPU compiler reads XLA's flags: set them first
    check_devices(target, named, devices)
    mesh = [config.mesh.get(axis, 1) for axis in ("data", "fsdp", "expert", "context", "tensor")]
    count = devices or named or math.prod(max(n, 1) for n in mesh)
    target_devices = chip.devices(count)
    resolved = config_lib.validate(config, devices=target_devices)
    trainer_cls = launch.import_trainer(config.trainer)
    trainer = trainer_cls(config, os.devnull, devices=target_devices, resolved=resolved)
    share = plan_memory.share(chip, config)
    started = time.monotonic()
    traced, state, sample, inputs = _trace(trainer)
    lowered = traced.lower()
    try:
        compiled, log = plan_memory.compile_logged(lowered)
    except Exception as e:  # jax.errors.JaxRuntimeError, a TPU step over its HBM
        if not str(e).startswith(_OUT_OF_MEMORY):
            raise
        seconds = time.monotonic() - started
        refused = _refused(chip, trainer, state, inputs, str(e), seconds, jax.__version__, share)
        refused.idle = count - trainer.mesh.size
        return refused
    seconds = time.monotonic() - started
    result = _read(chip, trainer, compiled, state, sample, seconds, jax.__version__, share)
    result.idle = count - trainer.mesh.size
    result.xla_remat = plan_memory.logged_remat(log)
    result.involuntary = [line for line in log.splitlines() if plan_memory.INVOLUNTARY in line]
    near = result.memory["total"] > 0.6 * chip.memory_bytes  # where XLA may have recomputed
    if check_remat and chip.platform == "gpu" and (result.xla_remat or near):
        result.xla_remat = plan_memory.recompute(result, lowered, trainer)
    return result


def _trace(trainer) -> tuple[Any, Any, dict, Any]:
    """The run's train step traced on abstract shapes: `(traced, state, one example, the
    other arguments: batches and log totals)`."""
    import jax
    import numpy as np

    from mptrain import data
    from mptrain.parallel import layout, sharding

    config, mesh = trainer.config, trainer.mesh
    example = (
        data.check_config(config) if config.trainer == "mptrain.train.trainer:Trainer" else None
    )
    if example is None:  # a source with no shapes to offer: one batch of it gives them
        batch = trainer.build_datasets()[0].get_batch(0)
        example = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype), batch)
    sample = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), example)
    init, args = trainer.make_init(sample)
    state = jax.eval_shape(init, *args)
    k = config.steps_per_call
    spec = lambda x, shape, on: jax.ShapeDtypeStruct(shape, x.dtype, sharding=on)
    if mesh.shape["context"] > 1 and "positions" not in example:  # `layout.balanced` adds them
        example = {**example, "positions": jax.ShapeDtypeStruct(example["inputs"].shape, np.int32)}
    lead = (k,) if k > 1 else ()
    batches = jax.tree.map(
        lambda x: spec(x, (*lead, config.batch_size, *x.shape[1:]), None), example
    )
    where = layout.batch_shardings(mesh, batches, stacked=k > 1)
    batches = jax.tree.map(lambda x, on: spec(x, x.shape, on), batches, where)
    jitted, make_totals, _ = trainer.make_run_step(state, sample)
    replicated = sharding.replicated(mesh)
    totals = jax.tree.map(lambda x: spec(x, x.shape, replicated), jax.eval_shape(make_totals))
    return jitted.trace(state, batches, totals), state, sample, (batches, totals)


_OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: "
_SIZE = r"\(?([0-9.]+)([KMGT])i?B?\)?"
# libtpu's refusal, as jax 0.6-0.8 word it: "... required for HLO temporaries (28.13G) exceeds
# available HBM (15.75G)", or "Used 28.13G of 15.75G hbm"
_TEMPORARIES = re.compile(rf"(?:HLO temporaries|[Uu]sed) {_SIZE}")


def _refused(chip, trainer, state, inputs, error: str, seconds, version, share) -> Plan:
    """The `Plan` of a step the target's compiler refused for want of memory: the state and
    inputs from their shapes, the temporaries as the compiler counted them (0 where its words
    do not say), and no program to read."""
    why = errors.first_line(error[len(_OUT_OF_MEMORY) :]).strip()
    found = _TEMPORARIES.search(why)
    temporaries = int(float(found[1]) * 1024 ** ("KMGT".index(found[2]) + 1)) if found else 0
    params, optimizer = (
        plan_memory.shard_bytes(state.params),
        plan_memory.shard_bytes(state.opt_state),
    )
    frozen = plan_memory.shard_bytes(getattr(state, "frozen", {}))
    memory = {
        "params": params,
        "optimizer": optimizer,
        "frozen": frozen,
        "other_state": plan_memory.shard_bytes(state) - params - optimizer - frozen,
        "inputs": plan_memory.shard_bytes(inputs),
        "temporaries": temporaries,
        "outputs": 0,
        "host": 0,
    }
    memory["total"] = sum(v for k, v in memory.items() if k != "host")
    return Plan(
        **_of_the_run(chip, trainer, state, share, seconds, version),
        memory=memory,
        largest=[],
        matmul_flops={},
        offenders=[],
        fp8_kernels={},
        attention={},
        hazards=[],
        collectives={},
        collective_sites={},
        kernels=0.0,
        bytes_moved=0.0,
        floor={},
        notes=[],
        refused=why,
    )


def _of_the_run(chip, trainer, state, share, seconds: float, version: str) -> dict[str, Any]:
    """The `Plan` fields that come from the run's config and state, not its program."""
    import jax

    config = trainer.config
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    return {
        "target": chip.name,
        "description": chip.description,
        "devices": trainer.mesh.size,
        "mesh": dict(trainer.mesh.shape),
        "precision": str(config.precision),
        "steps_per_call": config.steps_per_call,
        "capacity": int(share["fraction"] * chip.memory_bytes),
        "share": share,
        "xla_remat": {},
        "state_bytes_per_param": plan_memory.global_bytes((state.params, state.opt_state))
        / max(1, params),
        "frozen_params": (base := sum(math.prod(x.shape) for x in plan_memory.bases(state.frozen))),
        "frozen_bytes_per_param": plan_memory.global_bytes(state.frozen) / max(1, base),
        "kept_fp32": trainer.policy.kept_fp32_paths(state.params),
        "compile_seconds": round(seconds, 1),
        "jax_version": version,
    }


def device_bytes(stats) -> int:
    """A compiled step's bytes on one device as the plan totals them (`memory_analysis()`): its
    arguments, temporaries and code, and the outputs not donated back into the arguments."""
    used = stats.argument_size_in_bytes + stats.temp_size_in_bytes
    used += stats.generated_code_size_in_bytes + stats.output_size_in_bytes
    return used - stats.alias_size_in_bytes


def _read(chip, trainer, compiled, state, sample, seconds: float, version: str, share) -> Plan:
    """The `Plan` read off the compiled program (see the module doc)."""

    config, policy, k = trainer.config, trainer.policy, trainer.config.steps_per_call
    text = compiled.as_text()
    prog = program.Program(text)
    stats = compiled.memory_analysis()
    held = plan_memory.shard_bytes(state)
    params, optimizer = (
        plan_memory.shard_bytes(state.params),
        plan_memory.shard_bytes(state.opt_state),
    )
    frozen = plan_memory.shard_bytes(getattr(state, "frozen", {}))  # a LoRA run's base
    memory = {
        "params": params,
        "optimizer": optimizer,
        "frozen": frozen,
        "other_state": held - params - optimizer - frozen,
        "inputs": stats.argument_size_in_bytes - held,  # the batches and the log totals
        "temporaries": stats.temp_size_in_bytes + stats.generated_code_size_in_bytes,
        "outputs": stats.output_size_in_bytes - stats.alias_size_in_bytes,  # not donated back
    }
    memory["total"] = device_bytes(stats)  # the parts above add up to it
    # what the step keeps in the host's pinned memory (activations an offloading remat policy
    # moves there): not the device's, so outside the total
    memory["host"] = getattr(stats, "host_temp_size_in_bytes", 0)
    matmuls = roofline.matmul_flops(prog, policy.compute_dtype.name, k)
    flops, moved = matmuls["flops"], roofline.bytes_moved(prog, k)
    hazards = hlo.compiled_hazards(prog, k)
    notes = [hlo.warning(h) for h in hazards if h.kind == "16-bit"]
    notes += _notes(chip, config, flops, matmuls["fp8_kernels"])
    network = hlo.traffic(prog, chip.link, trainer.mesh.size, k)
    return Plan(
        **_of_the_run(chip, trainer, state, share, seconds, version),
        memory=memory,
        largest=prog.largest(k),
        matmul_flops=flops,
        offenders=matmuls["offenders"],
        fp8_kernels=matmuls["fp8_kernels"],
        attention=hlo.attention(
            prog, _length(sample), k, _rows(config, trainer.mesh), trainer.mesh.shape["context"]
        ),
        hazards=[dataclasses.asdict(h) for h in hazards],
        collectives=hlo.collectives(prog, k),
        collective_sites=_collective_sites(prog),
        axis_bytes=hlo.by_axis(prog, dict(trainer.mesh.shape), k),
        axis_overlap=hlo.overlap(prog, dict(trainer.mesh.shape), k),
        kernels=sum(runs for _, runs in prog.kernels()) / k,
        bytes_moved=moved,
        floor=roofline.floor(chip, flops, moved, policy.compute_dtype.name, network),
        notes=notes,
    )


def _collective_sites(prog) -> dict[str, list[str]]:
    """By collective op, the source lines of its instructions, where the program keeps them
    (XLA's combined collectives keep none)."""
    sites = collections.defaultdict(set)
    for inst, _ in prog.instructions(control_only=True):
        op, where = inst.opcode.removesuffix("-start"), prog.where(inst)
        if op in hlo.COLLECTIVES and ".py:" in where:
            sites[op].add(where)
    return {op: sorted(found) for op, found in sites.items()}


def _rows(config, mesh) -> int:
    """A device's sequences x attention heads: the leading size of its attention scores."""
    heads = config.model.get("num_heads") if "model" in config else None
    splits = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))  # not context's
    return max(1, config.batch_size // splits) * max(1, (heads or 1) // mesh.shape["tensor"])


def _length(sample: Any) -> int | None:
    """The sequence length of token inputs (`inputs`: integers `[1, L]`), else None."""
    inputs = sample.get("inputs") if isinstance(sample, dict) else None
    tokens = inputs is not None and inputs.ndim == 2 and inputs.dtype.kind in "iu"
    return inputs.shape[-1] if tokens else None


def _notes(chip, config, flops: dict[str, float], lowered) -> list[str]:
    """What a reader of the plan should know beyond its tables."""
    from mptrain import runtime

    notes = []
    if lowered:
        kinds = ", ".join(f"{n:g} as {kind}" for kind, n in sorted(lowered.items()))
        notes.append(
            f"fp8 matmuls: {kinds} (XLA's choice without the GPU to autotune on; a GEMM with "
            "fp8 operands runs on the fp8 tensor cores, where the chip has them)"
        )
    if chip.platform == "tpu" and flops.get("float32"):
        notes.append(
            "float32 matmuls run as one bfloat16 pass on a TPU at XLA's default precision: "
            "counted at the bfloat16 rate"
        )
    if chip.platform == "gpu":
        flag = runtime.DETERMINISTIC_FLAG in os.environ.get("XLA_FLAGS", "")
        late = ": config.deterministic asks for them, but this process's XLA flags were set "
        late += "before the plan could add the flag"
        late = late if config.get("deterministic") else ""
        kernels = "XLA's deterministic GPU kernels"
        notes.append(f"compiled with {kernels} (config.deterministic)" if flag else
                     f"compiled without {kernels}{late}")  # fmt: skip
        notes.append(
            "no GPU to autotune on: GEMMs keep XLA's default kernels and tiles, cuDNN "
            "workspaces count as 0; the GPU's own compile may choose others"
        )
    return notes
