"""`python -m mptrain.plan --fit`: the fastest configuration of a run that fits the target.

Starting from the config as given, the memory knobs mptrain owns are tried in the order of
what they cost, each candidate by a deviceless compile of the real step (`plan_step.plan`):

0. free: where a data axis holds the whole state on each of its devices, that axis folded into
   fsdp (`mesh.data=1`, `mesh.fsdp` x data): the same rows a device, 1 / data of the state;
   the search below starts from that mesh.
1. free: the loss in chunks of 256 positions (`loss.chunk_tokens`), where it is one chunk;
   and the run's share of a GPU's memory up to 95% (`memory_fraction=0.95`, where the plan's
   own environment does not set `XLA_PYTHON_CLIENT_MEM_FRACTION`): no FLOPs.
2. FLOPs, ranked by the floor: rematerialisation (`model.remat`) from the given policy
   towards `full`, and micro-batches (`batch_size` / k with `optimizer.accumulation_steps`
   x k, the step counts x k: the same global batch, the same updates). Gradient
   accumulation keeps an fp32 sum of the gradients, so memory falls with k only from k = 2.
   A micro-batch of fewer sequences than devices splits each sequence over the rest
   (`mesh.context`), as does a given batch of fewer rows than the devices (a Llama's).
3. precision, only where nothing above fits: Adam's moments fp32 -> bf16 -> q8
   (`optimizer.mu_dtype`/`nu_dtype`), then bf16 params with stochastic rounding
   (`precision=bf16-pure`, `param_rounding=stochastic`).
4. across nodes, one more mesh beside the given one: a Llama's layers split over a tensor
   group of each node's devices (`mesh.tensor`), fsdp across the nodes, where FSDP alone would
   gather every weight over the network; the lower floor wins (docs/make-it-fit.md).
5. with `peft` (`--fit --peft`), only where full training fits nowhere: rank-16 adapters on
   every projection over a frozen bf16 base (`lora.rank`), then over an 8-bit base
   (`lora.base_dtype=q8`, where the state is not split over fsdp). They train a small part of
   the model: what that does to quality is the user's to judge, and the plan says so.

Memory is monotone in each knob, which the search uses instead of compiling every
combination: the least precision level is the first at which the most memory-saving
structure fits; at that level, each remat policy from light to heavy gets the least number
of micro-batches that fits (a binary search, bounded by the lighter policy's answer), and the
fitting candidate with the lowest roofline floor (compute, memory or collectives: XLA's own
rematerialisation counted where it recomputed) wins. A host-memory knob (optimizer state in
pinned host memory) is not among them: see docs/make-it-fit.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

from mptrain import target as target_lib
from mptrain.plan import knobs as shape_knobs
from mptrain.plan import memory as plan_memory
from mptrain.plan import step as plan_step

GiB = 2**30
MAX_FRACTION = 0.95  # the most of a GPU a run is told to take: cuDNN, NCCL and CUDA need the rest
# cumulative precision levels, cheapest first
PRECISION = (
    {},
    {"optimizer.mu_dtype": "bfloat16", "optimizer.nu_dtype": "bfloat16"},
    {"optimizer.mu_dtype": "q8", "optimizer.nu_dtype": "q8"},
    {"optimizer.mu_dtype": "q8", "optimizer.nu_dtype": "q8", "precision": "bf16-pure"}
    | {"param_rounding": "stochastic"},
)
# `--peft`: adapters over a frozen base, after every level of full training
PEFT = (
    {"lora.rank": 16, "lora.alpha": 32.0},
    {"lora.rank": 16, "lora.alpha": 32.0} | {"lora.base_dtype": "q8"},
)
QUALITY = (
    "adapters train a small part of the model (LoRA): what that costs in quality against full "
    "training is not something this plan measures"
)


@dataclasses.dataclass
class Candidate:
    """One compiled configuration: its overrides of the given config and what it costs."""

    knobs: dict[str, Any]
    memory: int  # bytes a device
    state: int  # of which params and optimizer state
    state_bytes_per_param: float
    floor_s: float  # per global batch: a compiled step's floor x its micro-batches
    bound: str
    xla_remat_logged: bool  # XLA's own rematerialisation ran short of its limit and said so
    xla_recompute_flops: float = 0.0  # what it recomputed a step (found for the best only)
    fits: bool = False
    fraction: float = 0.0  # the share of the GPU's memory the run needs to be given (0: as it is)

    def overrides(self) -> list[str]:
        found = [f"--config.{key}={value}" for key, value in self.knobs.items()]
        return found + ([f"--config.memory_fraction={self.fraction:.2f}"] if self.fraction else [])

    def label(self) -> str:
        short = {"optimizer.accumulation_steps": "accum", "model.remat": "remat"}
        short |= {"optimizer.mu_dtype": "moments", "loss.chunk_tokens": "chunk"}
        shown = {k: v for k, v in self.knobs.items() if not k.endswith(("_steps", "nu_dtype"))}
        shown |= {k: v for k, v in self.knobs.items() if k == "optimizer.accumulation_steps"}
        return " ".join(f"{short.get(k, k.split('.')[-1])}={v}" for k, v in shown.items()) or "-"


@dataclasses.dataclass
class Fit:
    """What `fit` tried and found; `str(fit)` is the table `--fit` prints."""

    target: str
    devices: int
    capacity: int  # the bytes a run has as the environment stands
    device_memory: int
    tried: list[Candidate]
    best: Candidate | None
    closest: Candidate
    need: str
    seconds: float

    @property
    def fits(self) -> bool:
        return self.best is not None

    def verdict(self) -> str:
        if self.best is None:
            return (
                f"nothing fits {self.devices} x {self.target}: closest "
                f"{self.closest.memory / GiB:.1f} GiB "
                f"{'with ' + self.closest.label() if self.closest.knobs else 'as given'}; "
                f"{self.need}"
            )
        if not self.best.knobs and not self.best.fraction:
            return "fits as given"
        return "fits with " + (" ".join(self.best.overrides()) or "the config as given")

    def to_json(self) -> str:
        data = dataclasses.asdict(self) | {"fits": self.fits, "verdict": self.verdict()}
        return json.dumps(data, indent=2)

    def __str__(self) -> str:
        lines = [
            f"fit: {self.devices} x {self.target}, {self.capacity / GiB:.2f} GiB a device as "
            f"the run stands ({self.device_memory / GiB:.1f} GiB on the device); "
            f"{len(self.tried)} compile{'s' * (len(self.tried) != 1)} in {self.seconds:.0f} s",
            "",
            "  GiB a device, state bytes a param (params and optimizer state: the moments, and "
            "with accum > 1 the fp32 gradient sum, 4 more), floor of a global batch (every "
            "micro-batch)",
            f"  {'GiB':>7} {'state B/param':>13} {'floor ms':>9} {'bound':<11} {'fits':<9} knobs",
        ]
        for c in self.tried:
            fits = ("yes" if not c.fraction else f"at {c.fraction:.2f}") if c.fits else "no"
            remat = " [XLA remat]" if c.xla_remat_logged else ""
            mark = "*" if c is self.best else " "
            lines.append(
                f"{mark} {c.memory / GiB:7.2f} {c.state_bytes_per_param:13.2f} "
                f"{1e3 * c.floor_s:9.1f} {c.bound:<11} {fits:<9} {c.label()}{remat}"
            )
        lines.append("")
        if self.best is None:
            lines.append(self.verdict())
        else:
            best = self.best
            lines.append(
                f"fastest that fits: {best.memory / GiB:.1f} GiB a device, "
                f"{best.state_bytes_per_param:.2f} bytes of state a parameter, floor "
                f"{1e3 * best.floor_s:.1f} ms ({best.bound}-bound)"
            )
            if best.xla_recompute_flops:
                lines.append(
                    f"  XLA rematerialises on its own in it: {best.xla_recompute_flops / 1e12:.0f} "
                    "TFLOP a step recomputed, counted in the floor"
                )
            if "lora.rank" in best.knobs:
                lines.append(f"  note: {QUALITY}")
            if best.knobs or best.fraction:
                lines.append("  python -m mptrain.main ...")
                lines += [f"    {o}" for o in best.overrides()]
            else:
                lines.append("  fits as given: no override")
        return "\n".join(lines) + "\n"


def fit(
    config, target: str | target_lib.Target, devices: int | None = None, peft: bool = False
) -> Fit:
    """The search of the module doc for `config` on `devices` of `target` (a `Fit`); `peft`:
    adapters may be tried too (step 5). A `ConfigError` for a bad config or target, as
    `plan_step.plan` raises them."""
    started = time.monotonic()
    chip, named = target_lib.get(target) if isinstance(target, str) else (target, None)
    plan_step.check_devices(target, named, devices)  # the plain plan's rule (issue 42: D04, D06)
    count = devices or named or 1
    share = plan_memory.share(chip, config)
    capacity = int(share["fraction"] * chip.memory_bytes)
    fixed = plan_memory.MEM_FRACTION in os.environ or chip.platform != "gpu"  # the user's own
    stretch = capacity if fixed else int(MAX_FRACTION * chip.memory_bytes)
    done: dict[str, Candidate] = {}

    def measure(knobs: dict[str, Any]) -> Candidate:
        key = json.dumps(knobs, sort_keys=True)
        if key not in done:
            result = plan_step.plan(
                shape_knobs.changed(config, knobs), chip, count, check_remat=False
            )
            total = result.memory["total"]
            found = Candidate(
                knobs=knobs,
                memory=total,
                state=result.memory["params"] + result.memory["optimizer"],
                state_bytes_per_param=result.state_bytes_per_param,
                floor_s=result.floor.get("floor_s", 0.0)  # none where the compiler refused
                * knobs.get("optimizer.accumulation_steps", 1)
                / shape_knobs.get(config, "optimizer.accumulation_steps", 1),
                bound=result.floor.get("bound", "refused"),
                xla_remat_logged=bool(result.xla_remat),
                fits=total <= stretch and not result.refused,
            )
            if found.fits and total > capacity:
                found.fraction = math.ceil(100 * total / chip.memory_bytes) / 100
            done[key] = found
        return done[key]

    on = chip.devices(count)  # what the model chooses by (its attention), as the plan compiles
    base = shape_knobs.mesh(config, count, on)
    given = measure(base)
    node = int(chip.interconnect.get("node", 0))
    if split := shape_knobs.tensor(config, count, node, on):  # across nodes: a tensor group in each
        measure(dict(base) | split)
    if given.fits and not given.fraction:
        return _found(chip, count, capacity, done, _best(done), started)
    if fold := shape_knobs.sharded(config, count, base):  # the data axis's copies: FSDP's
        base = dict(base) | fold
        given = measure(base)
        if given.fits and not given.fraction:
            return _found(chip, count, capacity, done, _best(done), started)
    base = base | shape_knobs.chunk(config)  # a new dict: `given` keeps its own knobs
    remats = shape_knobs.remat_ladder(config)
    micro = shape_knobs.micro_batches(config, count, on)
    # a level whose params and moments alone, at their least bytes a parameter, exceed the
    # memory is not compiled
    per_device = given.state / max(given.state_bytes_per_param, 1e-9)
    levels = [p for p in PRECISION if _applies(config, p)]
    least = lambda p: _least_bytes(p, config) * per_device if p else given.state
    levels = [p for p in levels if least(p) <= stretch]
    if (
        peft and shape_knobs.get(config, "lora.rank") is None
    ):  # adapters' state is small: always tried
        fsdp = base.get("mesh.fsdp", shape_knobs.get(config, "mesh.fsdp", 1))
        levels += [p for p in PEFT if p.get("lora.base_dtype") != "q8" or fsdp == 1]

    def at(level: dict, remat: str, k: int) -> dict[str, Any]:
        knobs = dict(base) | level
        if remat != remats[0]:
            knobs["model.remat"] = remat
        return knobs | shape_knobs.micro(config, k, count, on)

    def fits(level, remat, k) -> bool:
        return measure(at(level, remat, k)).fits

    level = next(
        (
            p
            for p in levels
            if fits(p, remats[-1], 1) or (micro[-1] > 1 and fits(p, remats[-1], micro[-1]))
        ),
        None,
    )
    if level is not None:
        # indices into micro (k >= 2: memory falls as k grows) still worth a compile: a heavier
        # policy with as many micro-batches as a lighter one that fits only recomputes more
        bound = len(micro)
        for remat in remats:
            if fits(level, remat, 1):
                break  # no micro-batches needed; heavier policies only recompute more
            lo, hi = 1, bound - 1
            if lo > hi or not fits(level, remat, micro[hi]):
                continue
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(level, remat, micro[mid]) else (mid + 1, hi)
            bound = lo  # the next policy is tried with fewer micro-batches only
    best = _best(done)
    if best is not None and best.xla_remat_logged and chip.platform == "gpu":
        found = plan_step.plan(
            shape_knobs.changed(config, best.knobs), chip, count
        )  # with its recompute
        best.xla_recompute_flops = found.xla_remat.get("recompute_flops", 0.0)
    return _found(chip, count, capacity, done, best, started)


def _best(done: dict[str, Candidate]) -> Candidate | None:
    """The fitting candidate with the lowest floor; within 1% of it, the fewest knobs and the
    least memory share."""
    fitting = [c for c in done.values() if c.fits]
    if not fitting:
        return None
    least = min(c.floor_s for c in fitting)
    near = [c for c in fitting if c.floor_s <= 1.01 * least]
    return min(near, key=lambda c: (len(c.knobs), c.fraction, c.floor_s))


def _found(chip, count, capacity, done, best, started) -> Fit:
    tried = list(done.values())
    closest = best or min(tried, key=lambda c: c.memory)
    return Fit(
        target=chip.name,
        devices=count,
        capacity=capacity,
        device_memory=chip.memory_bytes,
        tried=tried,
        best=best,
        closest=closest,
        need="" if best else _need(chip, count, closest),
        seconds=time.monotonic() - started,
    )


def _need(chip, count: int, closest: Candidate) -> str:
    """What the closest candidate would need: a bigger chip, or more devices to shard over."""
    room = MAX_FRACTION * chip.memory_bytes
    bigger = [
        t.name
        for t in target_lib.targets().values()
        if t.platform == chip.platform and MAX_FRACTION * t.memory_bytes >= closest.memory
    ]
    ratio = closest.memory / room
    more = next((n for n in chip.counts() if n >= count * ratio * 1.25), None)
    parts = [f"needs {closest.memory / GiB:.1f} GiB a device, {ratio:.1f}x what one has"]
    if bigger:
        parts.append(f"a target with more memory: {', '.join(sorted(bigger))}")
    if more:
        parts.append(f"or more devices to shard it over, about --devices={more}")
    return "; ".join(parts)


def _least_bytes(level: dict, config) -> float:
    """The fewest bytes a parameter of a precision level's params and moments take: fp32 or
    bf16 params, two moments of 4, 2 or 1 bytes (q8's scales, sums and counters on top)."""
    if "lora.rank" in level:  # the adapters are a fraction of a percent of the params
        return 0.0
    moment = {"bfloat16": 2, "q8": 1}.get(level.get("optimizer.mu_dtype"), 4)
    pure = "bf16-pure" in (level.get("precision"), str(shape_knobs.get(config, "precision")))
    return (2 if pure else 4) + 2 * moment


def _applies(config, level: dict) -> bool:
    """Whether a precision level changes anything of `config` (an Adam, bf16-mixed run)."""
    if not level:
        return True
    if shape_knobs.get(config, "optimizer.name") != "adamw":
        return False
    if "precision" in level and str(shape_knobs.get(config, "precision")) != "bf16-mixed":
        return False
    return any(str(shape_knobs.get(config, k)) != str(v) for k, v in level.items())
