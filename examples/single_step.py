"""The textbook single mixed-precision step, written with mptrain.

A one-layer linear regression (`nn.Dense(1)`), plain SGD, bf16 compute with fp32 master weights
and a static loss scale of 128. Run: `python examples/single_step.py`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import mptrain


def main():
    model = nn.Dense(1)
    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = x @ jnp.arange(1.0, 9.0)[:, None] + 0.5
    params = model.init(jax.random.key(1), x)["params"]

    def loss_fn(params, model_state, batch, rng):
        del rng  # params and batch arrive already cast to bf16
        pred = model.apply({"params": params}, batch["x"])
        loss = jnp.mean((pred.astype(jnp.float32) - batch["y"].astype(jnp.float32)) ** 2)
        return loss, (model_state, {})

    state = mptrain.TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=optax.sgd(0.05),
        policy=mptrain.get_policy("bf16-mixed"),
        loss_scale=mptrain.StaticLossScale(128.0),
    )
    train_step = jax.jit(mptrain.make_train_step(loss_fn), donate_argnums=0)
    eval_step = jax.jit(mptrain.make_eval_step(lambda p, s, b: {"loss": loss_fn(p, s, b, None)[0]}))
    batch = {"x": x, "y": y}
    before = eval_step(state, batch)
    state, _ = train_step(state, batch)
    after = eval_step(state, batch)
    print(f"policy: {state.policy}, loss scale: {float(state.loss_scale.loss_scale):g}")
    print(f"loss before the step: {float(before['loss']):.4f}")
    print(f"loss after the step:  {float(after['loss']):.4f}")
    print(f"params dtype: {jax.tree.leaves(state.params)[0].dtype}, step: {int(state.step)}")


if __name__ == "__main__":
    main()
