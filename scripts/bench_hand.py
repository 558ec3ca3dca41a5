"""The hand-written side of `scripts/bench.py`: a config's model and preset in plain flax + optax.

It does what each preset means, as a careful user would write it: the params cast to the compute
dtype inside the differentiated function (embedding tables and norms left in fp32, as torch's
autocast leaves them), fp32 logits and loss, the optax optimizer of the
config (clip + adamw for the LM, nesterov SGD + weight decay for the ResNet; constant or cosine
schedule, linear warmup), params rounded to nearest (stochastically for bf16-pure, as mptrain
does by default), and a dynamic loss scale written out (scale, unscale, all-finite test, select,
grow/back off) where the row asks for one. It has no skipping without a scale, no metrics
besides the loss, no checkpoints. `tests/bench_test.py` checks that it lands on mptrain's params.
"""

from __future__ import annotations

import functools
import importlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from mptrain import config as config_lib


def make_hand(config, train_source):
    """`(compiled step, fresh, compile seconds)` for `config`'s model and preset written in plain
    flax + optax; `fresh()` is a new step-0 state (the step donates the one it is given)."""
    policy = config_lib.policy_of(config)  # the preset, the casting rule, the matmul precision
    compute, param_dtype = policy.compute_dtype, policy.param_dtype
    dynamic = config.loss_scale.kind == "dynamic"
    model = importlib.import_module(f"mptrain.models.{config.model.name}")
    model = model.create_model(config.model, compute)
    opt = config.optimizer
    lr, warmup = opt.learning_rate, opt.warmup_steps
    if opt.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, config.num_train_steps)
    elif opt.schedule == "constant":
        schedule = optax.constant_schedule(lr)
        if warmup:
            ramp = optax.linear_schedule(0.0, lr, warmup)
            schedule = optax.join_schedules([ramp, schedule], [warmup])
    else:
        raise ValueError(f"the hand-written step mirrors no {opt.schedule!r} schedule")
    if opt.name == "adamw":
        tx = optax.adamw(schedule, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay)
    else:  # what mptrain's sgd computes: momentum first, then decoupled weight decay
        tx = optax.chain(
            optax.trace(opt.momentum, opt.nesterov),
            optax.add_decayed_weights(opt.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
    if opt.grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip_norm), tx)
    cast = lambda tree, dtype: jax.tree.map(lambda x: x.astype(dtype), tree)

    def init(rng, inputs):
        # the plain arrays (the zoo's params come boxed with their logical axes, flax's way)
        variables = dict(nn.unbox(model.init({"params": rng, "dropout": rng}, inputs, train=False)))
        params = variables.pop("params")
        return {
            "params": cast(params, param_dtype),
            "opt_state": tx.init(params),
            "model_state": variables,  # BatchNorm statistics, fp32
            "scale": jnp.float32(config.loss_scale.init_scale if dynamic else 1.0),
            "good_steps": jnp.int32(0),
            "step": jnp.int32(0),
        }

    def round_params(new, step):
        if param_dtype != jnp.bfloat16:
            return cast(new, param_dtype)
        key = jax.random.fold_in(jax.random.key(config.seed), step)
        leaves, treedef = jax.tree.flatten(new)
        out = []
        for x, k in zip(leaves, jax.random.split(key, len(leaves)), strict=True):
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32)  # add noise below bf16's last bit
            bits = (bits + (jax.random.bits(k, x.shape, jnp.uint32) >> 16)) & jnp.uint32(0xFFFF0000)
            out.append(jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16))
        return treedef.unflatten(out)

    def step(state, batch):
        inputs = batch["inputs"]  # tokens stay integers, images go to the compute dtype
        inputs = inputs.astype(compute) if jnp.issubdtype(inputs.dtype, jnp.floating) else inputs
        mutable = list(state["model_state"]) or False

        def loss_fn(params):
            # embeddings and norms in fp32, the rest in the compute dtype, as autocast does
            as_compute = jax.tree.map(
                lambda p, d: p.astype(d), params, policy.compute_dtypes(params)
            )
            variables = {"params": as_compute, **state["model_state"]}
            out = model.apply(variables, inputs, train=True, mutable=mutable)
            logits, model_state = out if mutable else (out, state["model_state"])
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"]
            ).mean()
            return (loss * state["scale"] if dynamic else loss), (loss, model_state)

        grads, (loss, model_state) = jax.grad(loss_fn, has_aux=True)(state["params"])
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if dynamic:  # without a scale, no pass over the gradients to unscale them
            grads = jax.tree.map(lambda g: g / state["scale"], grads)
        params32 = cast(state["params"], jnp.float32)
        updates, opt_state = tx.update(grads, state["opt_state"], params32)
        new = {
            "params": round_params(optax.apply_updates(params32, updates), state["step"]),
            "opt_state": opt_state,
            "model_state": model_state,
            "scale": state["scale"],
            "good_steps": state["good_steps"] + 1,
            "step": state["step"] + 1,
        }
        if dynamic:
            finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
            grow = finite & (new["good_steps"] >= config.loss_scale.growth_interval)
            new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
            new["scale"] = jnp.where(grow, state["scale"] * 2, new["scale"])
            new["scale"] = jnp.where(finite, new["scale"], jnp.maximum(state["scale"] / 2, 1.0))
            new["good_steps"] = jnp.where(finite & ~grow, new["good_steps"], 0)
            new["step"] = state["step"] + 1
        return new, loss

    sample = train_source.get_batch(0)
    init_rng, _ = jax.random.split(jax.random.key(config.seed))  # as mptrain splits it
    fresh = functools.partial(jax.jit(init), init_rng, sample["inputs"][:1])
    started = time.perf_counter()
    with policy.matmuls():  # float32 matmuls at mptrain's precision, as a careful user sets it
        compiled = jax.jit(step, donate_argnums=0).lower(fresh(), jax.device_put(sample)).compile()
    return compiled, fresh, time.perf_counter() - started
