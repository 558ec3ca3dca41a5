"""A mixture-of-experts MLP (Qwen3-MoE's and Mixtral's): a router picks `top_k` of `num_experts`
SwiGLU experts for each token, their outputs summed with the router's weights.

Where the precision goes (MaxText's `float32_weight_sum`, Megatron-LM's `--moe-router-dtype`):

  * the router: its matmul in fp32 (the tokens and the router's kernel in fp32, `HIGHEST`),
    its softmax, the top-k and the renormalisation of the chosen weights (`norm_topk_prob`;
    Mixtral always) in fp32. In 16 bits the logits of two experts a few ulps apart become equal
    or swap, and the token goes to another expert (serving engines report it at near-ties:
    tests/models/moe_test.py counts such tokens). `router_fp32=False` runs the router's matmul
    in the compute dtype (what a 16-bit `F.linear` gives), to show the difference;
  * the experts: grouped matmuls (`mptrain.models.decoder.grouped`: XLA's `ragged_dot`, or on a
    Hopper GPU JAX's Mosaic kernels) over the token copies sorted by expert, in the compute
    dtype with fp32 accumulation, no token dropped (no capacity); the sort and its inverse are
    gathers forward and backward (`_spread`, `_permute`), never scatters;
  * the weighted sum of a token's `top_k` expert outputs in fp32, cast to the compute dtype
    once (transformers rounds the weights to the model's dtype and sums in it).

Under `mesh.expert` each device holds `num_experts / expert` of a layer's experts and runs them
on the tokens of its expert group (`exchange`). What each chip compiles the grouped matmuls to:
`mptrain.models.decoder.grouped`'s doc and docs/mixture-of-experts.md.

The layer returns its output and its router's statistics (`router_stats`: each expert's count of
top-k picks and sum of router probabilities, fp32 `[2, E]`), which the decoder sums over its
layers into the load-balancing loss (`aux_loss`, transformers' `load_balancing_loss_func`:
`num_experts * sum_e f_e P_e` over every layer's tokens, `f_e` the share of top-k picks that go
to expert `e`, `P_e` its mean router probability), in fp32.

Params (`[in, out]` as flax keeps them; a HuggingFace folder's per-expert `[out, in]` weights
are transposed and stacked): `router` `[D, E]`, `gate` and `up` `[E, D, F]`, `down` `[E, F, D]`.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain import errors
from mptrain.models import layers
from mptrain.models.decoder import grouped
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import layout, view

# `config.model`'s keys of a mixture of experts (`llama.CONFIG_KEYS`), with their defaults:
# `num_experts` None is a dense MLP in every layer; `expert_d_ff` (None: `d_ff`) each expert's
# hidden width; `dense_layers` the layers (from 0) that keep the dense MLP of `d_ff` (Qwen3-MoE's
# `mlp_only_layers`); `router_aux_loss_coef` the load-balancing loss's weight in the loss;
# `router_fp32` False runs the router's matmul in the compute dtype (to show what it costs);
# `expert_matmul` the experts' grouped matmuls (`grouped.KERNELS`; "auto": by the chip);
# `shared_expert_d_ff` (None: none) a SwiGLU expert every token takes beside the routed ones,
# `shared_expert_gate` its output times sigmoid(x w), one fp32 weight a token (Qwen2-MoE's).
# `router_scoring`, `router_bias`, `router_groups`, `router_groups_per_token`, `routed_scale`:
# DeepSeek-V3's routing (`Routing`); `router_logit_bias`: a trained bias on the router's logits
# (gpt-oss's). `expert_bias`: biases on each expert's gate, up and down (gpt-oss's);
# `swiglu_limit` (None: plain SwiGLU) gpt-oss's clamped SwiGLU, `(up + 1) * g * sigmoid(alpha g)`
# with g at most the limit and up within it, `swiglu_alpha` its alpha (`experts_mlp`).
CONFIG_KEYS = {
    "num_experts": None,
    "experts_per_token": 2,
    "expert_d_ff": None,
    "norm_topk_prob": True,
    "dense_layers": None,
    "router_aux_loss_coef": 0.001,
    "router_fp32": True,
    "expert_matmul": "auto",
    "shared_expert_d_ff": None,
    "shared_expert_gate": False,
    "router_scoring": "softmax",
    "router_bias": False,
    "router_groups": 1,
    "router_groups_per_token": 1,
    "routed_scale": 1.0,
    "router_logit_bias": False,
    "expert_bias": False,
    "swiglu_limit": None,
    "swiglu_alpha": 1.702,
}
SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a router scores, chooses and weighs (`route`): `scoring` each expert by a softmax
    over the experts (Qwen's, Mixtral's) or by its own sigmoid (DeepSeek-V3's); a `bias` param
    added to the scores that choose, not to the weights (DeepSeek-V3's aux-loss-free
    balancing, `e_score_correction_bias`; never trained: `route`'s doc); the experts in
    `groups`, a token's choice limited to its `group_top` best groups (each scored by its two
    best experts); the chosen weights times `scale` (`routed_scaling_factor`)."""

    scoring: str = "softmax"
    bias: bool = False
    groups: int = 1
    group_top: int = 1
    scale: float = 1.0
    logit_bias: bool = False  # a trained bias on the logits (gpt-oss's router.bias)


SOFTMAX = Routing()


def check(keys: dict) -> None:
    """`CONFIG_KEYS`' values in the decoder's settings `keys` checked (a `ValueError` naming
    the key), in place: `expert_d_ff` filled in, `dense_layers` a sorted tuple or None."""
    if keys["num_experts"] is None:
        return
    experts = errors.check_integer("model.num_experts", keys["num_experts"], 2, 2**16)
    errors.check_integer("model.experts_per_token", keys["experts_per_token"], 1, experts)
    keys["expert_d_ff"] = keys["expert_d_ff"] or keys["d_ff"]
    errors.check_integer("model.expert_d_ff", keys["expert_d_ff"], 1, errors.INT32_MAX)
    errors.check_choice("model.expert_matmul", keys["expert_matmul"], grouped.KERNELS)
    errors.check_choice("model.router_scoring", keys["router_scoring"], SCORINGS)
    groups = errors.check_integer("model.router_groups", keys["router_groups"], 1, experts)
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise ValueError(
            f"model.router_groups={groups}: must divide model.num_experts={experts} into groups "
            "of two experts or more (a group is scored by its two best)"
        )
    top = keys["router_groups_per_token"]
    errors.check_integer("model.router_groups_per_token", top, 1, groups)
    if top * (experts // groups) < keys["experts_per_token"]:
        raise ValueError(
            f"model.router_groups_per_token={top}: {top} groups of {experts // groups} experts "
            f"hold fewer than model.experts_per_token={keys['experts_per_token']}"
        )
    keys["routed_scale"] = errors.check_number("model.routed_scale", keys["routed_scale"], 0.0,
                                               open_low=True)  # fmt: skip
    if keys["swiglu_limit"] is not None:
        errors.check_number("model.swiglu_limit", keys["swiglu_limit"], 0.0, open_low=True)
        errors.check_number("model.swiglu_alpha", keys["swiglu_alpha"], 0.0, open_low=True)
    flags = ("router_bias", "router_logit_bias", "expert_bias")
    for key in ("norm_topk_prob", "router_fp32", "shared_expert_gate", *flags):
        if not isinstance(keys[key], bool):
            raise ValueError(f"model.{key}={keys[key]!r}: must be True or False")
    if keys["shared_expert_d_ff"] is not None:
        errors.check_integer("model.shared_expert_d_ff", keys["shared_expert_d_ff"], 1, 2**31 - 1)
    elif keys["shared_expert_gate"]:
        raise ValueError("model.shared_expert_gate=True: gates a shared expert, and "
                         "model.shared_expert_d_ff is None")  # fmt: skip
    coef = keys["router_aux_loss_coef"]
    keys["router_aux_loss_coef"] = errors.check_number("model.router_aux_loss_coef", coef, 0.0)
    dense, n = keys["dense_layers"], keys["num_layers"]
    if dense in (None, (), []):
        keys["dense_layers"] = None
        return
    if isinstance(dense, str) or not isinstance(dense, tuple | list):
        raise ValueError(f"model.dense_layers={dense!r}: None, or a tuple of layer numbers")
    for layer in dense:
        errors.check_integer("model.dense_layers[...]", layer, 0, n - 1)
    keys["dense_layers"] = tuple(sorted(set(dense)))


def route(
    tokens: jax.Array,
    kernel: jax.Array,
    top_k: int,
    normalise: bool,
    fp32: bool = True,
    routing: Routing = SOFTMAX,
    bias: jax.Array | None = None,
    logit_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(logits, weights, experts)` for `tokens [T, D]` and the router's `kernel [D, E]`:
    fp32 logits `[T, E]`, the fp32 weights `[T, top_k]` of the experts `int32 [T, top_k]` the
    scores rank first (renormalised to sum to 1 where `normalise`). `fp32=False`: the
    matmul in `tokens`' dtype, its logits rounded to it (the scoring still in fp32).

    `routing` (`Routing`): the scores a softmax or each expert's sigmoid; `bias` (`[E]`, where
    `routing.bias`) added to the scores that choose, never to the weights, and with no
    gradient: DeepSeek-V3 moves it outside the gradient, by each expert's load, and mptrain
    keeps it as loaded (its `fixed` role: `parallel.axes`, no optimizer update either). With
    `routing.groups`, a token's experts come from its `group_top` groups whose two best
    (biased) scores sum highest; the weights times `routing.scale`. `logit_bias` (`[E]`,
    gpt-oss's, trained) is added to the logits themselves. All of it in fp32."""
    if fp32:
        logits = jnp.dot(
            tokens.astype(jnp.float32),
            kernel.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
    else:
        logits = jnp.dot(tokens, kernel.astype(tokens.dtype)).astype(jnp.float32)
    if logit_bias is not None:
        logits = logits + logit_bias.astype(jnp.float32)
    if routing == SOFTMAX:  # Qwen's and Mixtral's, as it always was
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, top_k)
        if normalise:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return logits, weights, experts.astype(jnp.int32)
    sigmoid = routing.scoring == "sigmoid"
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores
    if bias is not None:
        choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    choice = jax.lax.stop_gradient(choice)  # it picks; the weights carry the gradient
    if routing.groups > 1:
        count, experts = choice.shape
        grouped = choice.reshape(count, routing.groups, experts // routing.groups)
        best = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, groups]
        kept = jax.nn.one_hot(jax.lax.top_k(best, routing.group_top)[1], routing.groups)
        kept = jnp.repeat(jnp.sum(kept, axis=1) > 0, experts // routing.groups, axis=1)
        choice = jnp.where(kept, choice, -jnp.inf)
    experts = jax.lax.top_k(choice, top_k)[1]
    picked = jax.nn.one_hot(experts, scores.shape[-1], dtype=scores.dtype)  # [T, k, E]
    # a gather whose gradient scatters nothing; a product and a sum, no matmul (no TF32)
    weights = jnp.sum(scores[:, None, :] * picked, axis=-1)
    if normalise:  # transformers' DeepSeek adds 1e-20: sigmoid weights may all be tiny
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return logits, weights, experts.astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _spread(tokens, order: jax.Array, back: jax.Array, grouped, top_k: int) -> jax.Array:
    """`[T * k, D]`: the token of each copy in `order` (copy `j` is token `j // k`'s). Its
    gradient gathers the copies back into token order (`back`, the inverse of `order`) and
    sums each token's `k` in fp32: gathers, where autodiff of the gather would scatter-add
    (which a GPU's deterministic mode runs as a sort of every element). Only the first
    `grouped` copies (those in a group) pass a gradient: a kernel may leave the rows past
    its groups undefined (another device's copies, under an expert axis)."""
    return jnp.take(tokens, order // top_k, axis=0, mode="clip")


def _spread_forward(tokens, order, back, grouped, top_k):
    saved = (back, grouped, jnp.zeros((), tokens.dtype))
    return _spread(tokens, order, back, grouped, top_k), saved


def _spread_backward(top_k, saved, grad):
    back, grouped, like = saved
    rows = jnp.arange(grad.shape[0])[:, None]
    grad = _unsort(jnp.where(rows < grouped, grad, 0), back).astype(jnp.float32)
    summed = grad.reshape(-1, top_k, grad.shape[-1]).sum(axis=1)
    return summed.astype(like.dtype), None, None, None


_spread.defvjp(_spread_forward, _spread_backward)


@jax.custom_vjp
def _permute(x: jax.Array, order: jax.Array, back: jax.Array) -> jax.Array:
    """`x[order]`, `back` its inverse: the gradient is a gather too (`_spread`'s doc)."""
    return jnp.take(x, order, axis=0, mode="clip")


_permute.defvjp(
    lambda x, order, back: (_permute(x, order, back), (order, back)),
    lambda saved, grad: (_permute(grad, saved[1], saved[0]), None, None),
)
_unsort = lambda x, back: jnp.take(x, back, axis=0, mode="clip")


def experts_mlp(
    tokens: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate,
    up,
    down,
    kernel=("xla", 0),
    biases: tuple | None = None,
    clamp: tuple[float, float] | None = None,
) -> jax.Array:
    """fp32 `[T, D]`: each token's `top_k` SwiGLU experts (`gate`, `up` `[E, D, F]`, `down`
    `[E, F, D]`, in `tokens`' dtype) summed with its fp32 `weights`. The `T x top_k` copies
    of the tokens are sorted by expert, so each expert's are one group of a grouped matmul;
    a copy whose expert is not one of these `E` (another device's, `experts` outside
    `[0, E)`) is sorted last, outside every group, and adds nothing. `kernel`: the grouped
    matmuls' (`grouped.matmul`'s kernel and the GPU's multiprocessors). `biases`: each
    expert's fp32 gate, up (`[E, F]`) and down (`[E, D]`) biases, added to the fp32 results;
    `clamp`: gpt-oss's `(limit, alpha)`, its SwiGLU on the fp32 pre-activations (the gate at
    most `limit`, up within it, `(up + 1) * gate * sigmoid(alpha * gate)`), cast once."""
    count, top_k = experts.shape
    local = gate.shape[0]
    mine = (experts >= 0) & (experts < local)
    flat = jnp.where(mine, experts, local).reshape(-1)
    order = jnp.argsort(flat, stable=True)  # copy j of the sorted list: token order[j] // k
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    sizes = jnp.bincount(flat, length=local + 1)[:local].astype(jnp.int32)
    copies = _spread(tokens, order, back, jnp.sum(sizes), top_k)
    matmul = lambda x, w: grouped.matmul(x, w, sizes, *kernel)
    if biases is None and clamp is None:
        h = nn.silu(matmul(copies, gate).astype(tokens.dtype))
        h = h * matmul(copies, up).astype(tokens.dtype)
        out = matmul(h, down)  # [T * k, D], sorted; rows past the groups: junk
    else:  # each sorted copy's expert (past the groups: the last, junk as those rows are)
        mine_sorted = jnp.minimum(jnp.take(flat, order), local - 1)
        plus = lambda x, i: (
            x.astype(jnp.float32)
            + (0.0 if biases is None else jnp.take(biases[i], mine_sorted, axis=0))
        )
        g, u = plus(matmul(copies, gate), 0), plus(matmul(copies, up), 1)
        if clamp is None:
            h = nn.silu(g) * u
        else:
            limit, alpha = clamp
            g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
            h = (u + 1) * g * jax.nn.sigmoid(alpha * g)
        out = plus(matmul(h.astype(tokens.dtype), down), 2)
    out = _permute(out, back, order).reshape(count, top_k, -1)
    out = jnp.where(mine[..., None], out.astype(jnp.float32), 0.0)
    return jnp.einsum("tkd,tk->td", out, jnp.where(mine, weights.astype(jnp.float32), 0.0))


def router_stats(logits: jax.Array, picked: jax.Array, mask: jax.Array | None) -> jax.Array:
    """fp32 `[2, E]`: how many of the top-k picks each expert got (no gradient) and the sum of
    its router probabilities, over the tokens `mask` (`[T]`, None: all) keeps: what
    `aux_loss` reads, summed over the layers (transformers' loss is over all layers' tokens
    together, the padding left out where an attention mask is given)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    hits = jax.nn.one_hot(picked, logits.shape[-1], dtype=jnp.float32).sum(axis=1)
    if mask is not None:
        keep = mask.astype(jnp.float32)[:, None]
        hits, probs = hits * keep, probs * keep
    return jnp.stack([jax.lax.stop_gradient(hits.sum(axis=0)), probs.sum(axis=0)])


def aux_loss(stats: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(the load-balancing loss, each expert's share of the top-k picks)` from every layer's
    `router_stats` summed (`[2, E]`) and the tokens they count (each token once a layer):
    transformers' `load_balancing_loss_func`. While a per-device gradient is traced the counts
    are the whole batch's, and each device returns its share of the loss times the devices,
    as `layers.masked_mean` does: the loss is linear in each device's probabilities."""
    (counts, probs), tokens = stats, jnp.asarray(tokens, jnp.float32)  # squared: no int32
    local, devices = view.current(), 1
    axes = None if local is None else local.batch
    if axes is not None:
        counts, tokens = jax.lax.psum((counts, tokens), axes)
        devices = jax.lax.psum(1, axes)
    loss = devices * counts.shape[-1] * jnp.sum(counts * probs) / jnp.square(tokens)
    return loss, counts / jnp.sum(counts)


def exchange(split: layout.ExpertSplit, mlp, local: int, tokens, picked, weights) -> jax.Array:
    """fp32 `[T, D]`: `mlp(tokens, picked, weights)` (`experts_mlp` on this device's `local`
    experts) with the experts split over `split.axis`: the tokens of the whole expert group gathered
    (in their 16 bits; their gradient reduce-scattered in fp32), each device's experts run on
    the copies routed to them, and the fp32 partial sums reduce-scattered back to the tokens'
    devices. Every device moves the group's tokens whatever their routing (an all-gather, not
    the all-to-all of only the routed copies that Megatron-LM and torchtitan send): simpler,
    exact, and `size` times the bytes an all-to-all moves at even routing."""
    first = jax.lax.axis_index(split.axis) * local  # this device's experts: first, first + 1..
    group = lambda x: jax.lax.all_gather(x, split.axis, axis=0, tiled=True)
    y = mlp(split.gather(tokens[None])[0], group(picked) - first, group(weights))
    return jax.lax.psum_scatter(y, split.axis, scatter_dimension=0, tiled=True)


# the experts' kernels' logical axes (`parallel.axes`): an expert a row, then its SwiGLU's
EXPERT_AXES = {
    "gate": (axes_lib.EXPERTS, axes_lib.EMBED, axes_lib.MLP),
    "up": (axes_lib.EXPERTS, axes_lib.EMBED, axes_lib.MLP),
    "down": (axes_lib.EXPERTS, axes_lib.MLP, axes_lib.EMBED),
}


class MoE(nn.Module):
    """The mixture-of-experts MLP (the module doc): `x [B, L, D] -> (y [B, L, D], router_stats
    [2, num_experts])`; `mask` (`[B, L]`, None: every token) the tokens the stats count."""

    num_experts: int
    top_k: int
    d_ff: int  # each expert's hidden width (`moe_intermediate_size`)
    normalise: bool  # `norm_topk_prob` (Mixtral: always)
    dtype: layers.Dtype
    router_fp32: bool = True
    kernel: tuple[str, int] = ("xla", 0)  # the grouped matmuls' (`grouped.matmul`)
    shared_d_ff: int | None = None  # a shared expert's width (`shared_expert_d_ff`)
    shared_gate: bool = False  # its sigmoid gate (`shared_expert_gate`)
    routing: Routing = SOFTMAX  # how the router scores, chooses and weighs (`route`)
    expert_bias: bool = False  # biases on each expert's gate, up and down (gpt-oss's)
    clamp: tuple[float, float] | None = None  # gpt-oss's clamped SwiGLU: (limit, alpha)

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        batch, length, width = x.shape
        init = nn.initializers.normal(stddev=0.02)  # the decoder's projections'
        # the router's every expert on each device; each expert's kernels on its own
        router_init = axes_lib.declare(init, (axes_lib.EMBED, None))
        router = self.param("router", router_init, (width, self.num_experts))
        here = view.current()  # this device's experts only (`exchange`)
        split = here and here.experts()
        local = self.num_experts // (1 if split is None else split.size)
        shapes = {"gate": (width, self.d_ff), "up": (width, self.d_ff), "down": (self.d_ff, width)}
        kernels = {
            k: self.param(k, axes_lib.declare(init, EXPERT_AXES[k]), (local, *s)).astype(self.dtype)
            for k, s in shapes.items()
        }
        bias = logit_bias = None
        zeros = nn.initializers.zeros
        if self.routing.bias:  # chooses, never weighs, never trained (`route`)
            fixed = axes_lib.declare(zeros, (None,), fp32=True, fixed=True)
            bias = self.param("router_bias", fixed, (self.num_experts,))
        if self.routing.logit_bias:  # gpt-oss's, trained as the router is
            init_b = axes_lib.declare(zeros, (None,), fp32=True)
            logit_bias = self.param("router_logit_bias", init_b, (self.num_experts,))
        biases = None
        if self.expert_bias:  # fp32, an expert a row, added to the fp32 matmul results
            sizes = {"gate_bias": self.d_ff, "up_bias": self.d_ff, "down_bias": width}
            names = {
                "gate_bias": axes_lib.MLP,
                "up_bias": axes_lib.MLP,
                "down_bias": axes_lib.EMBED,
            }
            biases = tuple(
                self.param(k, axes_lib.declare(zeros, (axes_lib.EXPERTS, names[k]), fp32=True),
                           (local, n)).astype(jnp.float32)
                for k, n in sizes.items()
            )  # fmt: skip
        tokens = x.reshape(-1, width).astype(self.dtype)
        logits, weights, picked = route(
            tokens, router, self.top_k, self.normalise, self.router_fp32, self.routing, bias,
            logit_bias,
        )  # fmt: skip
        # init (the decoder's runs a layer under vmap, which the Mosaic kernels do not take)
        kernel = ("xla", 0) if self.is_initializing() else self.kernel
        mlp = lambda *a: experts_mlp(
            *a, kernels["gate"], kernels["up"], kernels["down"], kernel, biases, self.clamp
        )
        if split is None:
            y = mlp(tokens, picked, weights)
        else:
            y = exchange(split, mlp, local, tokens, picked, weights)
        if self.shared_d_ff:
            y = y + self.shared(tokens, init)
        stats = router_stats(logits, picked, None if mask is None else mask.reshape(-1))
        return y.astype(self.dtype).reshape(batch, length, width), stats

    def shared(self, tokens: jax.Array, init) -> jax.Array:
        """fp32 `[T, D]`: the shared expert's SwiGLU on every token (in the compute dtype,
        fp32 accumulation), times its gate's sigmoid (an fp32 island, as the router's)."""
        width, d_ff = tokens.shape[-1], self.shared_d_ff
        specs = {k: ((width, d_ff), EXPERT_AXES[k][1:]) for k in ("gate", "up")}
        specs["down"] = ((d_ff, width), EXPERT_AXES["down"][1:])  # a dense MLP's axes
        w = {k: self.param(f"shared_{k}", axes_lib.declare(init, a), shape)
             for k, (shape, a) in specs.items()}  # fmt: skip
        # fp32 results, and a gradient whose matmuls stay 16-bit (`layers.einsum_f32_out`)
        dot = lambda x, k: layers.einsum_f32_out("td,df->tf", x, w[k].astype(self.dtype))
        h = nn.silu(dot(tokens, "gate").astype(self.dtype)) * dot(tokens, "up").astype(self.dtype)
        out = dot(h, "down")
        if self.shared_gate:
            gate_init = axes_lib.declare(init, (axes_lib.EMBED, None))
            gate = self.param("shared_expert_gate", gate_init, (width, 1))
            logit = jnp.dot(tokens.astype(jnp.float32), gate.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)  # fmt: skip
            out = out * jax.nn.sigmoid(logit)
        return out
