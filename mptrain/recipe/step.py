"""The mixed-precision train and eval steps: the whole recipe, pure and jittable.

Read top to bottom, `train_step` is the recipe: cast to the compute dtype inside the
differentiated function, compute the loss, scale it in fp32, differentiate, unscale and check the
gradients in fp32, update, and keep the old state bit-for-bit when the step was not finite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from mptrain import dtypes
from mptrain.optim import layerwise
from mptrain.parallel import layout, sharding
from mptrain.recipe import fp8 as fp8_lib
from mptrain.recipe import loss_scale as loss_scale_lib
from mptrain.recipe import numerics
from mptrain.recipe import train_state as train_state_lib

# loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, aux))
LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, tuple[Any, dict[str, Any]]]]
# metric_fn(params, model_state, batch) -> dict of scalars
MetricFn = Callable[[Any, Any, Any], dict[str, jax.Array]]


# batch keys whose floats stay fp32 under 16-bit compute: sums of log-probabilities (DPO's
# reference, `data.dpo`), whose differences of a few nats a bf16 rounding (0.5 at -200) would
# swamp; a GRPO batch's advantages, its sampler's log-probabilities and the host's figures
FP32_BATCH_KEYS = ("reference_logps", "advantages", "sampling_logps", "old_logps", "record")


def cast_batch(policy: Any, batch: Any) -> Any:
    """The batch's floats in the compute dtype (images, say), but `FP32_BATCH_KEYS`'."""
    if not isinstance(batch, dict):
        return policy.cast_to_compute(batch)
    keep = {k: v for k, v in batch.items() if k in FP32_BATCH_KEYS}
    return {**policy.cast_to_compute({k: v for k, v in batch.items() if k not in keep}), **keep}


def _like(new: Any, old: Any) -> Any:
    """Casts `new` leafwise to the dtypes of `old` (the loss_fn may return compute-dtype state)."""
    return jax.tree.map(lambda n, o: jnp.asarray(n).astype(jnp.asarray(o).dtype), new, old)


def _combine(probe_grads: tuple, axes: tuple[str, ...]) -> tuple:
    """Across devices: the numerics table as `numerics.combine` does, fp8 amaxes by max."""
    table, amaxes = probe_grads
    table = None if table is None else numerics.combine(table, axes)
    return table, jax.tree.map(lambda a: jax.lax.pmax(a, axes), amaxes)


def _split_probes(model_state: Any) -> tuple[Any, Any]:
    """`(model_state without the fp8 probes, the probes or None)`."""
    if not isinstance(model_state, dict) or fp8_lib.PROBES not in model_state:
        return model_state, None
    rest = {k: v for k, v in model_state.items() if k != fp8_lib.PROBES}
    return rest, model_state[fp8_lib.PROBES]


def _fp8_update(model_state: Any, amaxes: Any, old: Any, new: Any) -> Any:
    """The fp8 scaling state after this step's `amaxes` (None: no fp8 layers): a history entry
    per optimizer update, so with gradient accumulation (`optax.MultiSteps`) the micro-batches
    of an update are max-combined first (`fp8.update`). A skipped step drops it, as the rest of
    `model_state`."""
    if amaxes is None:
        return model_state
    before, after = _multi_steps(old.opt_state), _multi_steps(new.opt_state)
    if before is None:  # no accumulation: every step is an update
        return fp8_lib.update_state(model_state, amaxes, old.policy.fp8)
    applied, micro_batches = after.mini_step == 0, before.mini_step + 1
    return fp8_lib.update_state(model_state, amaxes, old.policy.fp8, applied, micro_batches)


def _multi_steps(opt_state: Any) -> optax.MultiStepsState | None:
    """The `optax.MultiSteps` state inside `opt_state` (gradient accumulation), or None."""
    is_multi = lambda x: isinstance(x, optax.MultiStepsState)
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_multi) if is_multi(x)]
    return found[0] if found else None


def _recording(taps, compute_dtype, calls):
    if taps is None:
        return contextlib.nullcontext()
    return numerics.recording(taps, compute_dtype, calls)


def make_train_step(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    per_layer: bool = False,
    measure_when: Callable[[train_state_lib.TrainState], jax.Array] | None = None,
) -> Callable[[train_state_lib.TrainState, Any], tuple[train_state_lib.TrainState, dict]]:
    """Returns `train_step(state, batch) -> (state, metrics)`; the caller jits it.

    `mesh`: a mesh of several devices (of the five axes `data`, `fsdp`, `expert`, `context`,
    `tensor`: `parallel.layout`; one it leaves out has size 1) makes the gradient and its
    reduction explicit: params gathered in the compute dtype, gradients reduced in fp32, one
    finiteness count (see `mptrain.parallel.sharding`); the state's params are split as they
    declared (`state.axes`). Jit the step with the state in
    `sharding.state_shardings(mesh, state)` and the batch in `layout.batch_shardings(mesh, batch)`.
    `per_layer`: also record every module call's numerics (`mptrain.recipe.numerics`): the
    metrics get `numerics` (the table) and `numerics_origin` (where the first non-finite value
    appeared). Off, the step is exactly the step without it. `measure_when(state) -> bool[]` (with
    `per_layer`): measure only on the steps it picks and on skipped steps, the only ones whose
    table anyone reads; elsewhere the table is zeros and the step costs what it costs without
    numerics. The table is then measured by differentiating once more, instrumented, in a
    `lax.cond` branch: the same inputs, so the same values, non-finite ones included.
    """

    mesh = None if mesh is None else layout.full_mesh(mesh)

    def train_step(state: train_state_lib.TrainState, batch: Any):
        with state.policy.matmuls():  # float32 matmuls at the policy's precision
            return _step(state, batch)

    def _step(state: train_state_lib.TrainState, batch: Any):
        policy, scaler = state.policy, state.loss_scale
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def scaled_loss(params, probes, batch, rng, model_state):
            # `probes`: the numerics taps and the fp8 layers' probes, zeros whose gradients are
            # the per-layer table and the fp8 amaxes (`recipe.numerics`, `recipe.fp8`)
            taps, amax_probes = probes
            if amax_probes is not None:
                model_state = {**model_state, fp8_lib.PROBES: amax_probes}
            # The low-precision zone starts here: `params` arrive cast to the compute dtype by a
            # cast *inside* the differentiated function, so jax.grad carries the cotangent back
            # through it, gradients arrive in fp32 and the master copy never leaves fp32. The
            # params the policy keeps (their role: embedding tables, norms) arrive in fp32: a gather
            # from an fp32 table has an fp32 gradient, not a 16-bit scatter-add.
            with _recording(taps, policy.compute_dtype, calls):
                loss, (model_state, aux) = loss_fn(params, model_state, batch, rng)
            # Scale in fp32: fp16 tops out at 65504, so a scaled fp16 loss would overflow.
            loss = jnp.asarray(loss, jnp.float32)
            return scaler.scale(loss), (loss, model_state, aux)

        taps = calls = None
        if per_layer:  # a zero row per module call; its gradient is the numerics table
            calls = numerics.loss_calls(loss_fn, state, batch)
            taps = jnp.zeros((len(calls.paths), len(numerics.COLUMNS)), jnp.float32)
        grads_of = sharding.grad_fn(scaled_loss, policy, mesh, _combine, state.axes)
        rest, amax_probes = _split_probes(state.model_state)
        inputs = (cast_batch(policy, batch), rng, rest)
        lazy = per_layer and measure_when is not None
        grads, (table, amaxes), (loss, model_state, aux) = grads_of(
            state.params, (None if lazy else taps, amax_probes), *inputs, frozen=state.frozen
        )
        # ... and ends here: unscale in fp32 so that large gradients cannot overflow on the way.
        grads = scaler.unscale(grads)
        # The global norm (for clipping and the metrics) says whether every gradient is finite:
        # a NaN or an inf anywhere makes it non-finite, and so does a sum of squares beyond
        # fp32's range (gradients above ~1e19), from which no update is safe either. One
        # reduction the step needs anyway, instead of a pass per leaf (DeepSpeed's fp16
        # optimizer detects overflow from the norm too).
        grad_norm = layerwise.norm(grads)
        finite = jnp.isfinite(grad_norm)
        model_state = _like(model_state, state.model_state)
        # A skipped step keeps params, opt_state (and with it the optimizer's count, so the
        # schedule does not drift) and model_state bit-identical; only the counters move.
        if policy.param_dtype != dtypes.F16:
            applied = finite  # known before the update: the update keeps what it skips
            updated = state.apply_gradients(grads=grads, apply=applied, global_norm=grad_norm)
            model_state = _fp8_update(model_state, amaxes, state, updated)
            model_state = loss_scale_lib.select_tree(applied, model_state, state.model_state)
            updated = updated.replace(model_state=model_state)
        else:
            # fp16 params at their range's edge can overflow from a finite update; such a step
            # is skipped too, but the scaled gradients did not overflow, so the loss scale does
            # not back off. (bf16 and fp32 params share fp32's range: an update from gradients
            # that passed the check above cannot reach it.) Checking the new params costs a
            # pass over them before the select, so only fp16 params pay for it.
            updated = state.apply_gradients(
                grads=grads, model_state=model_state, global_norm=grad_norm
            )
            fp8_state = _fp8_update(updated.model_state, amaxes, state, updated)
            updated = updated.replace(model_state=fp8_state)
            (bad_params,) = count_nonfinite((updated.params,), mesh, state.axes)
            applied = finite & (bad_params == 0)
            updated = loss_scale_lib.select_tree(applied, updated, state)
        new_state = updated.replace(
            step=state.step + 1,
            loss_scale=scaler.adjust(finite),
            skipped_steps=state.skipped_steps + jnp.where(applied, 0, 1).astype(jnp.int32),
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_scale": scaler.loss_scale,
            "grads_finite": finite,
            "applied": applied,
            "skipped_steps": new_state.skipped_steps,
            **dtypes.to_f32(aux),
        }
        if amax_probes is not None:  # per fp8 layer and tensor: the updates that clipped
            metrics["fp8_saturated"] = fp8_lib.counters(new_state.model_state)
            metrics["fp8_amax"] = fp8_lib.counters(new_state.model_state, "amax")
        if per_layer:

            def measure():  # non-finite counts of the param gradients need no unscaling
                with jax.named_scope(numerics.REPLAY):  # the precision report leaves it out
                    grads, (table, _), _ = grads_of(
                        state.params, (taps, amax_probes), *inputs, frozen=state.frozen
                    )
                    return numerics.finish(table, calls, grads)

            if lazy:
                wanted = ~applied | measure_when(state)
                table = jax.lax.cond(wanted, measure, lambda: jnp.zeros_like(taps))
            else:
                table = numerics.finish(table, calls, grads)
            metrics["numerics"] = table
            metrics["numerics_origin"] = numerics.origin(table, calls)
        return new_state, metrics

    return train_step


def make_eval_step(
    metric_fn: MetricFn, mesh: Mesh | None = None
) -> Callable[[train_state_lib.TrainState, Any], dict[str, jax.Array]]:
    """Returns `eval_step(state, batch) -> metrics`, the forward pass under the state's policy;
    on a `mesh` with a context axis, laid out as the train step is (`sharding.forward_fn`: each
    device its part of each sequence, in `layout.balanced`'s order). `mesh`: as the train
    step's."""
    mesh = None if mesh is None else layout.full_mesh(mesh)

    def eval_step(state: train_state_lib.TrainState, batch: Any):
        policy = state.policy
        batch = cast_batch(policy, batch)
        if mesh is not None and (mesh.shape["context"] > 1 or mesh.shape["tensor"] > 1):
            with policy.matmuls():
                forward = sharding.forward_fn(metric_fn, policy, mesh, axes=state.axes)
                metrics = forward(state.model_params, state.model_state, batch)
            return dtypes.to_f32(metrics)
        with policy.matmuls():
            params = sharding.cast_params(policy, state.model_params)
            metrics = metric_fn(params, state.model_state, batch)
        return dtypes.to_f32(metrics)

    return eval_step


def count_nonfinite(trees: tuple, mesh: Mesh | None, axes: Any = None) -> jax.Array:
    """A float32 vector: per tree, how many of its floating values are NaN or inf.

    On a mesh of several devices each device counts its own shards and one all-reduce adds the
    counts (a replicated leaf is counted once per device: a count is only ever compared with
    zero). Elsewhere it is a plain count. `axes`: the params' declared axes (the trees' split).
    """

    def local(*trees):
        counts = []
        for tree in trees:
            leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
            bad = [jnp.sum(~jnp.isfinite(x), dtype=jnp.float32) for x in leaves]
            counts.append(sum(bad, jnp.zeros((), jnp.float32)))
        return jnp.stack(counts)

    if mesh is None or mesh.size == 1:
        return local(*trees)
    summed = jax.shard_map(
        lambda *trees: jax.lax.psum(local(*trees), sharding.AXES),
        mesh=mesh,
        in_specs=tuple(sharding.specs(mesh, tree, axes) for tree in trees),
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    return summed(*trees)
