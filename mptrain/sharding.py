"""Device mesh and shardings: data parallel over `mesh.data`, params sharded over `mesh.fsdp`.

The mesh has two axes, `("data", "fsdp")`. Batches are split over both (every device sees a
different slice of the global batch); params and optimizer state are split over `fsdp` along
their largest dimension that divides evenly, and replicated where none does. The trainer always
has a mesh: on one device it is 1x1, and nothing is split.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp")


def mesh_shape(config, num_devices: int | None = None) -> tuple[int, int]:
    """`(data, fsdp)` with -1 resolved; a `ValueError` naming the key when it does not fit the
    devices or does not divide `batch_size`. `num_devices` defaults to all of JAX's devices."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    data, fsdp = config.mesh.data, config.mesh.fsdp
    for key, value in (("mesh.data", data), ("mesh.fsdp", fsdp)):
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ValueError(f"{key}={value!r}: must be a positive integer or -1 (all the rest)")
    if data == -1 and fsdp == -1:
        raise ValueError("mesh.data=-1: mesh.data and mesh.fsdp cannot both be -1")
    if fsdp == -1:
        fsdp = num_devices // data if num_devices % data == 0 else 0
    if data == -1:
        data = num_devices // fsdp if num_devices % fsdp == 0 else 0
    if data * fsdp == 0 or data * fsdp > num_devices:
        raise ValueError(
            f"mesh.data={config.mesh.data}, mesh.fsdp={config.mesh.fsdp}: the mesh needs more "
            f"devices than the {num_devices} there are"
        )
    if config.batch_size % (data * fsdp):
        raise ValueError(
            f"batch_size={config.batch_size}: the global batch must divide evenly over the "
            f"{data}x{fsdp} mesh ({data * fsdp} devices)"
        )
    return data, fsdp


def create_mesh(config) -> Mesh:
    data, fsdp = mesh_shape(config)
    devices = np.asarray(jax.devices()[: data * fsdp]).reshape(data, fsdp)
    return Mesh(devices, AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The leading (batch) dimension split over every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _leaf_spec(shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    if fsdp > 1:
        for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[dim] % fsdp == 0:
                spec = [None] * len(shape)
                spec[dim] = "fsdp"
                return PartitionSpec(*spec)
    return PartitionSpec()


def state_shardings(mesh: Mesh, state: Any) -> Any:
    """Per leaf: split over `fsdp` on the largest evenly divisible dimension, else replicated."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, _leaf_spec(np.shape(x), fsdp)), state)
