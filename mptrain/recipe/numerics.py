"""Per-layer numerics, recorded on the device inside the train step: which layer went non-finite
first, forward or backward, and how close each layer's values and gradients are to the edges of
the compute dtype.

For every module call (flax's method interception; `__call__` only) the recorder taps the
call's floating inputs and its floating outputs with an identity whose custom VJP reports, for
each side: forward, the largest finite magnitude (amax), the count of non-finite values, and of
the non-zero values the count that underflow (below the compute dtype's smallest normal number:
subnormal there, or flushed to zero); backward, the same for the gradient flowing through that
side (into the output: incoming; out to the inputs: outgoing).

Each tap writes its numbers into the cotangent of a small zero "taps" array, one row per call,
so one `jax.grad` of the loss with respect to the taps returns the whole table, with no host
round trip. The trainer's step does not tap its own gradient: it differentiates once more with
the taps, in a branch taken only on log steps and skipped steps, the only ones whose table is
read (`step.make_train_step`'s `measure_when`; `config.numerics.every_step` taps every step).
The first non-finite value is then located on the device too: forward, the innermost call
whose inputs were finite and whose output was not; backward (looked at only when the forward was
finite), the innermost call whose incoming gradient was finite and whose outgoing gradient, or
its own parameters' gradient, was not.

Every tap is a pass over its values, so the recorder measures each value once: a value that a
call takes straight from another call's tap (the previous layer's output, the parent's input)
is not measured again but read from that tap's row; when that tap's value goes nowhere else (one
use, found in the traced program), not even its gradient is; an output returned as it came in
(an identity, such as dropout at rate 0) or returned from an inner call is read from there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from mptrain.recipe import numerics_scan

_STATS = ("amax", "nonfinite", "underflow", "nonzero")
_GROUPS = {  # (side, direction) -> the prefix of its columns
    ("in", "forward"): "in_",  # the call's floating inputs
    ("out", "forward"): "out_",  # its floating outputs
    ("out", "backward"): "grad_out_",  # the gradient flowing into the outputs (incoming)
    ("in", "backward"): "grad_in_",  # the gradient flowing out to the inputs (outgoing)
}
COLUMNS = (
    *(prefix + stat for prefix in _GROUPS.values() for stat in _STATS),
    "param_grad_nonfinite",  # the gradient of the call's module's parameters
)
COL = {name: i for i, name in enumerate(COLUMNS)}
_MAX = np.array(["amax" in name for name in COLUMNS])  # combined by max, the rest by sum
DIRECTIONS = ("forward", "backward")

Tap = tuple[int, str]  # (call index, "in" | "out")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the recorder does at one tap: `measure` (per floating leaf, whether to measure its
    forward values; None: put no tap there at all) and the taps whose numbers it reads
    instead, forward (`forward_from`) and backward (`backward_from`)."""

    measure: tuple[bool, ...] | None
    forward_from: tuple[Tap, ...] = ()
    backward_from: tuple[Tap, ...] = ()


@dataclasses.dataclass(frozen=True)
class Calls:
    """The module calls of one trace of the loss, in the order they start: each call's module
    scope (its path in the params tree), a readable path, the index of the call it runs inside
    (-1 at the top), and the recorder's `Plan` for each tap."""

    scopes: tuple[tuple[str, ...], ...]
    paths: tuple[str, ...]
    parents: tuple[int, ...]
    plans: tuple[tuple[Tap, Plan], ...] = ()
    # a call of a scanned stack's block: its row in the stack (its scope is then (STACKED,
    # [stack key,] ...) and its params' gradient that row's slice); -1 elsewhere. `groups`:
    # the scans, (first row, calls a step, steps, first layer, layers a step, the stack's key,
    # its first layer) each (`numerics_scan`)
    layers: tuple[int, ...] = ()
    groups: tuple[tuple, ...] = ()

    def descendants(self) -> np.ndarray:
        """`d[i, j]`: call j runs inside call i (at any depth)."""
        d = np.zeros((len(self.paths),) * 2, bool)
        for j, parent in enumerate(self.parents):
            while parent >= 0:
                d[parent, j] = True
                parent = self.parents[parent]
        return d

    def resolve(self, table: jax.Array) -> jax.Array:
        """Fills in the numbers the plans read from other taps (amax by max, counts by sum)."""
        plans = dict(self.plans)
        rows = list(table)
        done: set[tuple[Tap, str]] = set()

        def group(tap: Tap, direction: str) -> jax.Array:
            columns = [COL[_GROUPS[tap[1], direction] + stat] for stat in _STATS]
            plan = plans.get(tap, Plan(()))
            sources = plan.forward_from if direction == "forward" else plan.backward_from
            if (tap, direction) not in done and sources:
                own = rows[tap[0]][np.asarray(columns)]
                for source in sources:
                    other = group(source, direction)
                    own = jnp.concatenate([jnp.maximum(own[:1], other[:1]), own[1:] + other[1:]])
                rows[tap[0]] = rows[tap[0]].at[np.asarray(columns)].set(own)
            done.add((tap, direction))
            return rows[tap[0]][np.asarray(columns)]

        for tap in plans:
            for direction in DIRECTIONS:
                group(tap, direction)
        return jnp.stack(rows)


def _stats(leaves: list, tiny: float) -> jax.Array:
    """float32[4]: amax of the finite values, non-finite count, underflow count, non-zeros.

    One variadic reduction per leaf, so XLA makes one pass over it: four separate `jnp.sum`s
    and a `jnp.max` each make their own, and on CPU cost 30x more.
    """
    parts = jnp.zeros((4,), jnp.float32)
    for x in leaves:
        x = jnp.abs(x.astype(jnp.float32))
        finite = jnp.isfinite(x)
        nonzero = finite & (x > 0)
        count = lambda mask: mask.astype(jnp.int32)
        operands = (jnp.where(finite, x, 0.0), count(~finite), count(nonzero & (x < tiny)))
        operands += (count(nonzero),)
        zero = np.int32(0)
        amax, *counts = jax.lax.reduce(
            operands,
            (np.float32(0), zero, zero, zero),
            lambda a, b: (
                jnp.maximum(a[0], b[0]),
                *(p + q for p, q in zip(a[1:], b[1:], strict=True)),
            ),
            tuple(range(x.ndim)),
        )
        parts = parts.at[0].max(amax) + jnp.stack([0.0, *counts]).astype(jnp.float32)
    return parts


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _tap(leaves: list, taps: jax.Array, index: int, side: str, tiny: float, measure: tuple):
    """The identity on `leaves`; its VJP reports their statistics (see the module doc), those
    of the forward values only for the leaves whose `measure` flag is set."""
    del taps, index, side, tiny, measure
    return leaves


def _tap_forward(leaves, taps, index, side, tiny, measure):
    return leaves, (_stats([x for x, m in zip(leaves, measure, strict=True) if m], tiny), taps)


def _tap_backward(index, side, tiny, measure, residuals, grads):
    forward, taps = residuals
    backward = _stats([g for g in grads if g.dtype != jax.dtypes.float0], tiny)
    row = jnp.zeros((len(COLUMNS),), jnp.float32)
    for direction, values in zip(DIRECTIONS, (forward, backward), strict=True):
        columns = [COL[_GROUPS[side, direction] + stat] for stat in _STATS]
        row = row.at[np.asarray(columns)].set(values)
    # the taps' cotangent: zeros, with this call's row filled in
    return grads, jnp.zeros_like(taps).at[index].set(row)


_tap.defvjp(_tap_forward, _tap_backward)


def _floating(leaves: list) -> list[int]:
    return [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)
    ]


class _Recording:
    """The interceptor. Without `plans` it taps and measures everything, and works out the
    plans (`plan()`, given how often each tap's values are used); with them, it follows them."""

    def __init__(self, taps: jax.Array | None, tiny: float, calls: Calls | None = None):
        plans = None if calls is None else dict(calls.plans)
        self.taps, self.tiny, self.given = taps, tiny, plans
        # scanned stacks (`numerics_scan`): rows of their layers past the first so far, the
        # table's row of this taps array's first row, the stacks found or given
        self.offset, self.base = 0, 0
        self.groups = {g[0]: g for g in calls.groups} if calls is not None else {}
        self.index_of: list[int] = []  # each call's row in the table
        self.scopes: list[tuple[str, ...]] = []
        self.paths: list[str] = []
        self.parents: list[int] = []
        self.order: list[Tap] = []  # the taps put in, in the order they were
        self.sources: dict[Tap, list[Tap | None]] = {}  # per floating leaf: the tap it came from
        self.identity: dict[Tap, Tap] = {}  # out-taps left out: the value came from this tap
        self._open: list[int] = []
        self._made: dict[int, tuple[Tap, Any]] = {}  # id(value of a one-leaf tap) -> tap, value

    def _tapped(self, tree: Any, tap: Tap) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        floating = _floating(leaves)
        if self.taps is None or not floating:
            return tree
        made = [self._made.get(id(leaves[i])) for i in floating]
        sources = [
            m[0] if m and m[1] is leaves[i] else None for m, i in zip(made, floating, strict=True)
        ]
        if self.given is not None:
            measure = self.given[tap].measure if tap in self.given else None
        elif tap[1] == "out" and len(sources) == 1 and sources[0]:
            # an output returned as it came (from an inner call, or the call's own input)
            self.identity[tap] = sources[0]
            measure = None
        else:
            measure = tuple(tap[1] == "out" or s is None for s in sources)
        self.sources[tap] = sources
        if measure is None:
            return tree
        self.order.append(tap)
        row = tap[0] - self.base  # in this taps array (a scanned layer's own rows)
        tapped = _tap([leaves[i] for i in floating], self.taps, row, tap[1], self.tiny, measure)
        for i, x in zip(floating, tapped, strict=True):
            leaves[i] = x
        if len(tapped) == 1:
            self._made[id(tapped[0])] = (tap, tapped[0])
        return jax.tree.unflatten(treedef, leaves)

    def intercept(self, next_fun: Callable, args, kwargs, context) -> Any:
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        index = len(self.paths) + self.offset
        self.index_of.append(index)
        module = context.module
        scope = tuple(module.scope.path) if module.scope is not None else ()
        self.scopes.append(scope)
        self.paths.append("/".join(scope) or type(module).__name__)
        self.parents.append(self._open[-1] if self._open else -1)
        self._open.append(index)
        try:
            args, kwargs = self._tapped((args, kwargs), (index, "in"))
            return self._tapped(next_fun(*args, **kwargs), (index, "out"))
        finally:
            self._open.pop()

    def plan(self, uses: dict[Tap, int] | None) -> dict[Tap, Plan]:
        """The plans, from this (measure-everything) recording: an in-tap whose every value
        comes straight from a tap used only here is left out; `uses` (a tap -> how many times
        its values are used in the program) None: none is known to be used once."""
        plans = {}
        for tap, sources in self.sources.items():
            if tap in self.identity:
                plans[tap] = Plan(None, (self.identity[tap],), (self.identity[tap],))
                continue
            known = tuple(s for s in sources if s)
            once = uses is not None and sources and all(s and uses.get(s) == 1 for s in sources)
            if once:
                plans[tap] = Plan(None, known, known)
            else:
                measure = tuple(tap[1] == "out" or s is None for s in sources)
                plans[tap] = Plan(measure, known if tap[1] == "in" else ())
        return plans

    def calls(self, plans: dict[Tap, Plan]) -> Calls:
        return Calls(*numerics_scan.expand(self, plans))


@contextlib.contextmanager
def recording(
    taps: jax.Array | None, compute_dtype: Any, calls: Calls | None = None
) -> Iterator[_Recording]:
    """Records every flax module call made inside the block; with `taps` (a zero float32
    `[calls, len(COLUMNS)]` array), differentiating with respect to `taps` gives the table
    (finish it with `finish`). Pass the `calls` found by `discover` to follow their plans."""
    rec = _Recording(taps, float(jnp.finfo(compute_dtype).tiny), calls)
    token = numerics_scan.ACTIVE.set(rec)  # which a scanned stack's loop asks for
    try:
        with nn.intercept_methods(rec.intercept):
            yield rec
    finally:
        numerics_scan.ACTIVE.reset(token)


def loss_calls(loss_fn: Callable, state: Any, batch: Any) -> Calls:
    """The module calls of `loss_fn(params, model_state, batch, rng)` as the train step makes
    them (params and batch in the state's compute dtype). `state` and `batch` may be abstract
    (`jax.ShapeDtypeStruct`s, as `mptrain.plan` has them): the casts are traced too."""
    policy = state.policy

    def loss(params, model_state, batch):
        params, batch = policy.cast_params(params), policy.cast_to_compute(batch)
        return loss_fn(params, model_state, batch, jax.random.key(0))

    return discover(loss, state.model_params, state.model_state, batch)


_EMPTY_TAPS = (0, len(COLUMNS))
# The name scope of the gradient differentiated again to measure a log or skipped step (see
# `step.make_train_step`'s `measure_when`): not part of an ordinary step's work.
REPLAY = "mptrain_numerics_replay"


def _uses(jaxpr: Any, order: list[Tap]) -> dict[Tap, int] | None:
    """How many times each tap's values are used in `jaxpr` (the most used leaf counts), or
    None when its taps cannot be matched to `order` (e.g. some sit inside a nested program)."""
    found = [  # the taps: their last operand is discovery's empty taps array
        e
        for e in jaxpr.eqns
        if e.primitive.name == "custom_vjp_call" and e.invars[-1].aval.shape == _EMPTY_TAPS
    ]
    if len(found) != len(order):
        return None
    count: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        count.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    count.update(v for v in jaxpr.outvars if isinstance(v, jex_core.Var))
    return {tap: max(count[v] for v in e.outvars) for tap, e in zip(order, found, strict=True)}


def discover(fn: Callable, *args: Any) -> Calls:
    """The module calls `fn(*args)` makes and the recorder's plans for them, found by tracing
    it (nothing runs)."""
    found = []

    def traced(*args):
        with recording(jnp.zeros(_EMPTY_TAPS), jnp.float32) as rec:
            out = fn(*args)
        found.append(rec)
        return out

    program = jax.make_jaxpr(traced)(*args)
    rec = found[-1]
    return rec.calls(rec.plan(_uses(program.jaxpr, rec.order)))


def combine(table: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The table of the whole batch from each device's: amax by max, counts by sum."""
    return jnp.where(_MAX, jax.lax.pmax(table, axes), jax.lax.psum(table, axes))


def finish(table: jax.Array, calls: Calls, grads: Any) -> jax.Array:
    """The whole table from the taps' gradient: the reused numbers filled in (`Calls.resolve`)
    and `param_grad_nonfinite`, the non-finite values of each call's module's parameter
    gradients (its subtree of `grads`, found by path)."""
    if not calls.paths:  # no module calls seen (e.g. an NNX model)
        return table
    table = calls.resolve(table)
    counts = []
    for scope, layer in zip(calls.scopes, calls.layers or [-1] * len(calls.scopes), strict=True):
        subtree = grads
        for name in scope:
            subtree = subtree.get(name, {}) if isinstance(subtree, dict) else {}
        leaves = [x for x in jax.tree.leaves(subtree) if jnp.issubdtype(x.dtype, jnp.floating)]
        leaves = leaves if layer < 0 else [x[layer] for x in leaves]  # a stack: its layer
        counts.append(sum((jnp.sum(~jnp.isfinite(x), dtype=jnp.float32) for x in leaves), 0.0))
    return table.at[:, COL["param_grad_nonfinite"]].set(jnp.stack(counts))


def origin(table: jax.Array, calls: Calls) -> jax.Array:
    """int32[2]: `(call index, direction)` of the first non-finite value, `(-1, -1)` if none.

    Candidates, forward: finite inputs, non-finite output; backward (only when the whole forward
    was finite): finite incoming gradient, non-finite outgoing or parameter gradient. Of these,
    the innermost: a candidate with no candidate inside it. Forward, the first such call to run;
    backward, the last (the backward pass runs them in reverse).
    """
    inside = jnp.asarray(calls.descendants())
    col = lambda name: table[:, COL[name]]
    forward = (col("in_nonfinite") == 0) & (col("out_nonfinite") > 0)
    backward = (col("grad_out_nonfinite") == 0) & (
        (col("grad_in_nonfinite") > 0) | (col("param_grad_nonfinite") > 0)
    )
    innermost = lambda c: c & ~jnp.any(inside & c[None, :], axis=1)
    order = jnp.arange(len(calls.paths))
    first = jnp.min(jnp.where(innermost(forward), order, len(order)), initial=len(order))
    last = jnp.max(jnp.where(innermost(backward), order, -1), initial=-1)
    forward_bad = jnp.any(col("out_nonfinite") > 0)
    index = jnp.where(forward_bad, jnp.where(first < len(order), first, -1), last)
    direction = jnp.where(index < 0, -1, jnp.where(forward_bad, 0, 1))
    return jnp.stack([index, direction]).astype(jnp.int32)
