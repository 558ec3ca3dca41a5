"""Each collective of a program compiled for the CPU gets a channel id of its own.

JAX (0.10) lowers every collective a `shard_map` takes with the same channel id, 1
(`jax._src.interpreters.mlir.COLLECTIVE_CHANNEL_ID`: its identity is held not to matter). XLA's
CPU runtime meets a collective's devices at a rendezvous keyed by the collective's kind, its
devices and that id, and runs a program's independent collectives at once. Two all-gathers over
the same tensor group that are both ready then share one rendezvous: device 2's first meets
device 3's second, each takes the other's buffer, and where their sizes differ the copy runs past
the end. A packed `sft_tiny` on data 4 x tensor 2 died in its first step so (glibc's "corrupted
double-linked list", SIGSEGV in a memcpy on an XLA thread, or 40 s rendezvous timeouts with three
devices already done): 0 runs of 6 trained, and 3 of 3 with an id a collective.

`install()` registers, for the CPU only, each collective's own lowering wrapped so that the op it
writes with id 1 gets a fresh id of the module's (`new_channel`, as host callbacks get theirs).
GPUs and TPUs run a device's collectives in one order (a stream, the program's schedule) and keep
JAX's lowering.
"""

from __future__ import annotations

from jax._src import core
from jax._src.interpreters import mlir
from jax._src.lax import parallel as lax_parallel
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

_SHARED = mlir.COLLECTIVE_CHANNEL_ID
_installed = False


def install() -> None:
    """Once a process: every collective primitive of `jax.lax` lowers for the CPU with its own
    channel id."""
    global _installed
    if _installed:
        return
    cpu = mlir._platform_specific_lowerings["cpu"]
    for primitive in vars(lax_parallel).values():
        if not isinstance(primitive, core.Primitive) or primitive in cpu:
            continue
        entry = mlir._lowerings.get(primitive)
        if entry is not None:
            mlir.register_lowering(
                primitive,
                _own_channels(entry.rule),
                platform="cpu",
                inline=entry.inline,
                cacheable=False,
            )
    _installed = True


def _own_channels(rule):
    def lower(ctx, *args, **params):
        block = ir.InsertionPoint.current.block
        first = len(block.operations)
        out = rule(ctx, *args, **params)
        for i in range(first, len(block.operations)):
            _renumber(block.operations[i], ctx.module_context)
        return out

    return lower


def _renumber(op, module_context) -> None:
    attributes = op.operation.attributes
    if "channel_handle" not in attributes:
        return
    handle = hlo.ChannelHandle(attributes["channel_handle"])
    if handle.handle == _SHARED:
        attributes["channel_handle"] = hlo.ChannelHandle.get(
            module_context.new_channel(), handle.channel_type
        )
