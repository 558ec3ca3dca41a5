"""NNX models in the Trainer: a `flax.nnx.Module` behind the `init`/`apply` calls it makes.

`Trainer.build_model` may return an NNX module (built eagerly, with its own `nnx.Rngs`). The
Trainer wraps it in `NNXModel`, which splits it once (`nnx.split`) into a graph definition, its
`nnx.Param`s and the rest of its state (batch statistics and other variables), and then answers
the linen calls the Trainer makes:

- `init(...)` -> `{"params": <params as a plain dict>, "nnx_state": <the rest, if any>}`: the
  params become the fp32 master copy in the TrainState, the rest its `model_state`;
- `apply(variables, x, train=..., mutable=...)` rebuilds the module from the (compute-dtype)
  params and the state (`nnx.merge`), switches it to `train()` or `eval()` mode, calls it, and
  with `mutable` also returns the state the call left behind.

Everything that works on the TrainState (the policy's casts, loss scaling, skipped steps,
checkpoints and resume, sharding) therefore works the same for NNX. Not yet: random streams held
inside the module (`nnx.Rngs`, e.g. for dropout) are refused, since their keys would have to be
threaded through the step; and the per-layer numerics recorder sees linen module calls only.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

STATE = "nnx_state"


class NNXModel:
    """A linen-like face (`init`, `apply`) for an NNX module; see the module doc."""

    def __init__(self, module: nnx.Module):
        self.graphdef, params, self._rng_state, rest = nnx.split(
            module, nnx.Param, nnx.RngState, ...
        )
        if jax.tree.leaves(self._rng_state):
            raise ValueError(
                f"{type(module).__name__} holds nnx.Rngs state; mptrain's NNX support does not "
                "thread random streams through the step yet: build the module's layers without "
                "rngs kept for the forward pass (e.g. no nnx.Dropout(rngs=...))"
            )
        self._params, self._rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        self._templates = (params, rest)
        self.module_type = type(module).__name__

    def init(self, rngs: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's variables as built: the params, and the rest under `"nnx_state"`."""
        del rngs, args, kwargs  # an NNX module is initialised when it is built
        variables = {"params": self._params}
        if self._rest:
            variables[STATE] = self._rest
        return variables

    def _merge(self, variables: dict[str, Any]) -> nnx.Module:
        params, rest = self._templates
        params, rest = jax.tree.map(lambda x: x, (params, rest))  # copies of the templates
        nnx.replace_by_pure_dict(params, variables["params"])
        if self._rest:
            nnx.replace_by_pure_dict(rest, variables[STATE])
        return nnx.merge(self.graphdef, params, self._rng_state, rest)

    def apply(
        self,
        variables: dict[str, Any],
        *args: Any,
        train: bool = False,
        rngs: Any = None,
        mutable: Any = False,
        **kwargs: Any,
    ) -> Any:
        """Calls the module rebuilt from `variables`; with `mutable`, `(out, new variables)`."""
        del rngs  # random streams inside NNX modules are refused in __init__
        module = self._merge(variables)
        module.train() if train else module.eval()
        out = module(*args, **kwargs)
        if not mutable:
            return out
        _, _, _, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
        return out, ({STATE: nnx.to_pure_dict(rest)} if self._rest else {})


def wrap(model: Any) -> Any:
    """`NNXModel(model)` for an NNX module, the model itself otherwise."""
    return NNXModel(model) if isinstance(model, nnx.Module) else model
