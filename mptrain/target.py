"""The accelerators a run can be planned for, each from a spec file in `mptrain/targets/`.

A `Target` is one kind of chip: its memory, the roofline figures the plan's floor is made of
(peak matmul FLOP/s by operand dtype, memory bandwidth), and `devices(n)`: n compile-only
devices of it. XLA compiles for those exactly as for the real chips, on any host, with no
accelerator attached: nothing runs and nothing is allocated. That needs the compiler of the
accelerator in this Python: the CUDA plugin and cuDNN for NVIDIA GPUs, libtpu for TPUs (the
extra `mptrain[plan]`), and a JAX whose backends start with `JAX_PLATFORMS=cpu` (else the CUDA
plugin looks for a driver, and the GPU compiler is not there to ask).

A spec is TOML (`tomllib`): `name`, `description`, `platform` ("gpu" | "tpu"), `memory_bytes`
(what one device reports), `[interconnect]` (`node`: devices on the fast links; `within`,
`between`: bytes/s each way per device on them and on the network between nodes, and their
names), `[roofline]` (`bandwidth` in bytes/s; FLOP/s by operand dtype:
`bfloat16`, `float16`, `float8`, `float32` at XLA's default precision, `float32_highest`), and
either `[device]` (a GPU: the chip facts XLA's GPU compiler reads, as its GpuTargetConfigProto
names them, `compute_capability` as "9.0"; `cudnn` at the top as "9.10") or `[topology]` (a TPU:
libtpu's name `prefix`, `chip_config`, `torus` dimensions and `host_bounds`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import importlib.util
import os
import tomllib
from typing import Any

from mptrain import errors

EXTRA = "pip install 'mptrain[plan]'"
# A TPU slice of n chips, as libtpu names it, by the dimensions of the chip's torus.
_SLICES = {
    2: {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16)},
    3: {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4)},
}
_SLICES[2][256] = (16, 16)
_SLICES[3] |= {128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8)}
GPUS_PER_HOST = 8
# CUDA's launch limits, the same on every NVIDIA GPU since compute capability 3.0; XLA's GPU
# compiler divides by them, so a spec without them crashes it.
_CUDA_LIMITS = {"block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535}
_CUDA_LIMITS |= {"block_dim_limit_z": 65535, "thread_dim_limit_x": 1024}
_CUDA_LIMITS |= {"thread_dim_limit_y": 1024, "thread_dim_limit_z": 64}


@dataclasses.dataclass(frozen=True)
class Target:
    """One kind of accelerator, read from `mptrain/targets/<name>.toml` (see the module doc)."""

    name: str
    description: str
    platform: str
    memory_bytes: int
    roofline: dict[str, float]
    spec: dict[str, Any]  # [device] of a GPU, [topology] of a TPU
    cudnn: str = ""
    interconnect: dict[str, float] = dataclasses.field(default_factory=dict)

    def link(self, group: list[int] | int) -> tuple[str, float]:
        """`(name, bytes/s each way per device)` of the slowest link a collective over `group`
        (its device ids, or only its size: then devices 0..size-1) crosses: the node's own
        (NVLink, a TPU slice's ICI) while it stays within `interconnect.node` devices, else
        the network between nodes (a GPU cluster's, a TPU's DCN)."""
        ids = range(group) if isinstance(group, int) else group
        net, node = self.interconnect, int(self.interconnect.get("node", 0)) or None
        if node is None or len({i // node for i in ids}) <= 1:
            return net.get("within_name", "link"), net.get("within", 0.0)
        return net.get("between_name", "network"), net.get("between", 0.0)

    def peak(self, dtype: str) -> float | None:
        """Peak matmul FLOP/s for operands of `dtype` ("bfloat16", "float8_e4m3fn", "float32",
        "float32_highest", ...), or None where the chip has no such rate."""
        key = "float8" if dtype.startswith("float8") else dtype
        return self.roofline.get(key)

    def counts(self) -> list[int]:
        """The device counts `devices` takes."""
        if self.platform == "gpu":
            return [*range(1, GPUS_PER_HOST + 1), *(GPUS_PER_HOST * k for k in (2, 4, 8, 16))]
        return sorted(_SLICES[self.spec["torus"]])

    def devices(self, count: int = 1) -> list:
        """`count` compile-only devices of this accelerator (GPUs: up to 8 a host, then hosts
        of 8; TPUs: a slice of `count` chips). A `ConfigError` names what is missing: a count
        the chip does not come in, the extra `mptrain[plan]`, or `JAX_PLATFORMS=cpu`."""
        if count not in self.counts():
            raise errors.ConfigError(
                f"--devices={count}: a {self.name} plan takes "
                f"{', '.join(map(str, self.counts()))} devices"
            )
        _check_installed(self.platform)
        from jax.experimental import topologies

        # libtpu locks the chips for one process; compiling for them needs none of them
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

        try:
            if self.platform == "gpu":
                self._answer_capability_checks()
                hosts, per_host = max(1, count // GPUS_PER_HOST), min(count, GPUS_PER_HOST)
                topology = topologies.get_topology_desc(
                    self.name,
                    "cuda",
                    target_config=self.gpu_config(),
                    topology=f"1x{hosts}x{per_host}",
                )
            else:
                topo = self.spec
                shape = _SLICES[topo["torus"]][count]
                chips = (*shape, 1, 1)[:3]
                bounds = tuple(min(b, n) for b, n in zip(topo["host_bounds"], chips, strict=True))
                topology = topologies.get_topology_desc(
                    topology_name=f"{topo['prefix']}:{'x'.join(map(str, shape))}",
                    platform="tpu",
                    chip_config_name=topo["chip_config"],
                    chips_per_host_bounds=bounds,
                    num_slices=1,
                )
        except NotImplementedError as e:
            raise errors.ConfigError(
                f"--target={self.name}: JAX cannot compile for {self.platform.upper()}s in this "
                f"process ({errors.first_line(e)}): start Python with JAX_PLATFORMS=cpu set, "
                "as `python -m mptrain.plan` does, so that no backend looks for a driver"
            ) from None
        return list(topology.devices)

    def _answer_capability_checks(self) -> None:
        """jax's cuDNN module checks some features (the packed layout of packed rows: Hopper
        or newer) against this process's own GPU as it traces; a process compiling for this
        chip has none, so those checks answer for this chip's compute capability."""
        from jax._src.cudnn import fused_attention_stablehlo as fused

        have = tuple(int(x) for x in self.spec["compute_capability"].split("."))
        version = lambda capability: tuple(int(x) for x in capability.split("."))
        fused.check_compute_capability = lambda capability: have >= version(capability)
        fused.is_cuda_compute_capability_equal = lambda capability: have == version(capability)

    def gpu_config(self) -> str:
        """The GpuTargetConfigProto (text) XLA's GPU compiler is given for this chip."""
        device = _CUDA_LIMITS | self.spec
        major, minor = device.pop("compute_capability").split(".")
        lines = [f"  {key}: {value}" for key, value in device.items()]
        lines += [f"  device_memory_size: {self.memory_bytes}"]
        lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}"]
        dnn_major, dnn_minor = self.cudnn.split(".")
        return "\n".join(
            [
                "gpu_device_info {",
                *lines,
                "}",
                'platform_name: "CUDA"',
                f"dnn_version_info {{ major: {dnn_major} minor: {dnn_minor} }}",
                f'device_description_str: "{self.description}"',
            ]
        )


def _check_installed(platform: str) -> None:
    """A `ConfigError` naming the pip line when the compiler for `platform` is missing."""
    import jax

    if platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            raise errors.ConfigError(f"TPU targets need libtpu, not installed here: {EXTRA}")
        return
    try:
        plugin = importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        raise errors.ConfigError(
            f"GPU targets need the CUDA compiler plugin (jax-cuda12-plugin=={jax.__version__}) "
            f"and cuDNN, not installed here: {EXTRA}"
        ) from None
    if plugin != jax.__version__:
        raise errors.ConfigError(
            f"jax-cuda12-plugin {plugin} does not match jax {jax.__version__}: {EXTRA} (or pip "
            f"install jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__})"
        )
    if importlib.util.find_spec("nvidia.cudnn") is None:
        raise errors.ConfigError(f"GPU targets need cuDNN (nvidia-cudnn-cu12): {EXTRA}")


@functools.cache
def targets() -> dict[str, Target]:
    """Every target whose spec ships in `mptrain/targets/`, by name."""
    found = {}
    for spec in sorted(importlib.resources.files(__package__).joinpath("targets").iterdir()):
        if spec.name.endswith(".toml"):
            data = tomllib.loads(spec.read_text())
            section = data.pop("device", None) or data.pop("topology")
            target = Target(spec=section, **data)
            found[target.name] = target
    return found


def get(name: str) -> tuple[Target, int | None]:
    """The target called `name`, and the device count its name gives (`v5e-8`: 8), if any; a
    `ConfigError` listing the known names for anything else."""
    known = targets()
    text = str(name).strip().lower()
    base, _, count = text.rpartition("-")
    if base in known:  # a count: ASCII digits only ("²".isdigit() is True, int("²") fails)
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise errors.ConfigError(
                f"--target={name!r}: the chip count after '-' must be a whole number of at "
                f"least 1; a {base} plan takes {', '.join(map(str, known[base].counts()))}"
            )
        return known[base], int(count)
    if text in known:
        return known[text], None
    names = ", ".join(sorted(known))
    raise errors.ConfigError(
        f"--target={name!r}: unknown; known targets: {names} (a TPU name may carry its chip "
        "count, e.g. v5e-8)"
    )


def compile_only() -> None:
    """Makes this process's JAX start its CPU backend only, as compiling for an absent
    accelerator needs (the CUDA plugin would look for a driver), unless its backends have
    started (a `ConfigError` from `Target.devices` then says what to do); and turns off the
    persistent compilation cache, which cannot load back an executable compiled without its
    device (it warns and compiles again)."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_enable_compilation_cache", False)
