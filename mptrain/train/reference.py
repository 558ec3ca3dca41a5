"""A frozen copy of the step-0 params inside a run's state: the reference of a loss that holds
the policy against where it started (DPO's `dpo.reference="copy"`, GRPO's KL term in a full
fine-tune).

The copy is in the dtypes the policy's own forward reads the params in (the compute dtype, fp32
where a casting rule keeps a param), so the reference's step-0 log-probabilities are the
policy's exactly. It lives in `model_state[KEY]`: split over the mesh as the params are and
checkpointed, so a resume keeps it. The step hands it to the reference's forward alone, never
to the gradient's (`keeping`), and hands it back untouched (the same buffers, donated and kept).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mptrain.parallel import axes as axes_lib

KEY = "dpo_reference"  # the model_state key of the copy (DPO's first: its checkpoints keep it)


def add(policy: Any, variables: dict[str, Any]) -> dict[str, Any]:
    """`variables` (a model's init, its params boxed with their axes) with the copy beside."""
    params = axes_lib.unboxed(variables["params"])  # split as the params are
    return {**variables, KEY: policy.cast_params(params)}


def without(model_state: dict[str, Any]) -> dict[str, Any]:
    """`model_state` without the copy: what the model's own forward takes."""
    return {k: v for k, v in model_state.items() if k != KEY}


def keeping(inner: Callable, prepare: Callable) -> Callable:
    """The train step `inner(state, batch, totals)` run on `prepare(state, batch)` (which may
    read the copy: the reference's forward) and on the state without the copy, which comes
    back untouched in the new state."""

    def train_step(state, batch, totals):
        copy = state.model_state.get(KEY)
        batch = prepare(state, batch)
        state = state.replace(model_state=without(state.model_state))
        new_state, metrics, totals = inner(state, batch, totals)
        if copy is not None:
            new_state = new_state.replace(model_state={**new_state.model_state, KEY: copy})
        return new_state, metrics, totals

    return train_step


def refreshed(policy: Any, state: Any) -> Any:
    """`state` with the copy made again of its params (a run's step 0 from `init_from`, whose
    params the init's copy is not of), in the old copy's shardings; the old one deleted."""
    old = state.model_state[KEY]
    places = jax.tree.map(lambda x: x.sharding, old)
    copy = jax.jit(policy.cast_params, out_shardings=places)(state.params)
    for x in jax.tree.leaves(old):
        x.delete()
    return state.replace(model_state={**state.model_state, KEY: copy})
