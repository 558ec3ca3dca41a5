"""What one device sees of the layout while the step's per-device function is traced: how the
mesh splits the batch's rows, each sequence, a mixture's experts and a tensor group's layers.

The step's gradient and evaluation are `shard_map`s manual over every axis of the mesh
(`sharding.grad_fn`, `forward_fn`). Inside one, JAX's own abstract mesh says so
(`jax.sharding.get_abstract_mesh()`: the axes `Manual`, their sizes, the devices' platform),
and `current()` reads the layout from it: there is no context of mptrain's own to set or to
forget, and a model learns whether it runs per device from what JAX is tracing. Outside one (a
model's init, a forward pass by hand, the evaluation of a data or fsdp mesh that JAX lays out
itself, decoding) it is None: every layer runs whole. A layer asks for the part it splits by
(`sequence`, `experts`, `tensor`); `batch` are the axes over which a count of tokens or of the
batch's statistics is summed.
"""

from __future__ import annotations

import dataclasses

import jax

from mptrain.parallel import layout, tensor


@dataclasses.dataclass(frozen=True)
class View:
    """The mesh as the per-device function sees it: each axis's size, and the devices'
    platform (which every choice made by backend follows: XLA:CPU has no 16-bit collectives)."""

    sizes: tuple[tuple[str, int], ...]
    platform: str
    manual: tuple[str, ...] = layout.AXES  # the axes the function is manual over (the rest 1)

    @property
    def shape(self) -> dict[str, int]:  # as a `Mesh`'s: what `layout.entry` reads
        return dict(self.sizes)

    @property
    def batch(self) -> tuple[str, ...]:
        """The axes over which each device computes its share of the loss: every manual one."""
        return self.manual

    @property
    def _as_bits(self) -> bool:
        return self.platform == "cpu"

    def sequence(self) -> layout.SequenceSplit | None:
        """A sequence split over a context axis, as attention gathers its keys and values;
        None where it is whole."""
        context = layout.entry(self, "length")
        if context is None:
            return None
        ints = lambda x: jax.lax.all_gather(x, context, axis=1, tiled=True)
        gather = layout.sequence_gather(context, self._as_bits)
        return layout.SequenceSplit(gather, ints, context, layout.size(self, "length"))

    def experts(self) -> layout.ExpertSplit | None:
        """A mixture's experts split over an expert axis; None where each device holds all."""
        axis = layout.entry(self, "experts")
        if axis is None:
            return None
        gather = layout.sequence_gather(axis, self._as_bits)
        return layout.ExpertSplit(gather, axis, layout.size(self, "experts"))

    def tensor(self) -> tensor.Split | None:
        """A tensor group's collectives (`parallel.tensor`); None where layers run whole."""
        return tensor.split(self.shape[tensor.AXIS], self._as_bits)


def current() -> View | None:
    """The layout one device sees, while a function manual over the mesh's axes is traced (the
    step's per-device function; an axis it is not manual over is whole here, XLA's to split);
    None elsewhere (the module doc)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = () if mesh.empty else tuple(a for a in layout.AXES if a in mesh.manual_axes)
    if not manual:
        return None
    sizes = tuple((axis, mesh.shape[axis] if axis in manual else 1) for axis in layout.AXES)
    return View(sizes, mesh.abstract_device.platform, manual)
