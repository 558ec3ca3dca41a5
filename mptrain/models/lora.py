"""Low-rank adapters (LoRA) on the language models' projections, over a frozen base.

A projection ``y = x W`` with an adapter computes ``y = x W + (alpha / rank) * (x A) B``: ``A``
(``lora_a``, ``[in, rank]``) starts random and ``B`` (``lora_b``, ``[rank, out]``) at zero, so
step 0 is the base model exactly. ``A`` is drawn as PEFT draws it (uniform within
``1 / sqrt(in)``, torch's ``kaiming_uniform_(a=sqrt(5))``), not the LoRA paper's Gaussian, so
an mptrain adapter and a PEFT one start alike. With ``dropout`` the adapter's input (only) is
dropped, during training (a ``"dropout"`` rng present), as in PEFT.

The language model's head (its output projection, ``head/kernel``) takes an adapter only where
``targets`` names it (``targets="head|q|v"``), as PEFT's ``target_modules`` does ``lm_head``
(its ``all-linear`` leaves the output layer out, and so does ``targets`` None here). The head's
logits come from a chunked loss over one matmul, so its adapter rides inside that matmul
(``head``): ``[x, scale * x A] @ [W; B]`` is ``x W + scale * (x A) B`` with one fp32
accumulation, not ``W + scale * A B`` rounded into a 16-bit kernel, which would round a young
adapter's update away. A head tied to the embedding takes none.

The adapters sit beside the kernel they adapt (``.../attn/q/kernel`` gets ``.../attn/q/lora_a``
and ``lora_b``), so a LoRA model's params are the base model's plus the adapters: the base's
checkpoints and HF folders load onto it unchanged. The Trainer trains the adapters alone
(``mptrain.recipe.frozen``): the rest is frozen, stored once in the compute dtype or in 8 bits
(``Q8`` kernels, which ``Dense`` dequantizes inside its matmul, one layer at a time, recomputed
in the backward pass rather than kept).

``config.lora`` (``SETTINGS``): ``rank`` (None: no adapters), ``alpha``, ``dropout``,
``targets`` (a regex searched in each adaptable kernel's param path, e.g.
``stacked_layers/attn/q/kernel`` or ``layers_3/mlp/down/kernel``) and ``base_dtype``
(``"compute"`` or ``"q8"``). ``spec`` turns them into the model's static ``Spec``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain import errors
from mptrain.optim import q8
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import sharding

ADAPTERS = ("lora_a", "lora_b")  # the param names of an adapter's two factors
# The keys of `config.lora` with their defaults; `targets` None: every projection a model makes
# with `dense` (the decoder's q k v o gate up down, transformer_lm's qkv out fc_in fc_out)
SETTINGS = {"rank": None, "alpha": 16.0, "dropout": 0.0, "targets": None, "base_dtype": "compute"}
BASE_DTYPES = ("compute", "q8")
ALL = "*"  # a `Spec.targets` that adapts every projection that can take an adapter
HEAD = "head"  # the language model head's module path: adapted only where `targets` names it


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a model's projections need to know (static, hashable): the rank, the scaling
    ``alpha / rank``, the adapter's dropout, and ``targets``: the module paths (as each
    projection sees its own ``self.path``, "/"-joined) that get adapters, or ``ALL``;
    ``projections``: those of every projection (the kernels a base may keep in 8 bits)."""

    rank: int
    scale: float
    dropout: float = 0.0
    targets: frozenset[str] | str = ALL
    projections: frozenset[str] = frozenset()  # every projection's module path, adapted or not

    def adapts(self, path: tuple[str, ...]) -> bool:
        return self.targets == ALL or "/".join(path) in self.targets


def enabled(config: Any) -> bool:
    """Whether `config` (a run's whole config) asks for adapters (`lora.rank` set)."""
    return (config.get("lora") or {}).get("rank") is not None


def settings(lora: Any) -> dict[str, Any]:
    """`config.lora`'s keys, checked; a `ValueError` names a bad one."""
    keys = errors.settings(lora or {}, SETTINGS)
    why = "the adapters' width; 8 to 64 is usual"
    keys["rank"] = errors.check_integer("lora.rank", keys["rank"], 1, 2**16, why)
    keys["alpha"] = errors.check_number("lora.alpha", keys["alpha"], 0.0, open_low=True)
    keys["dropout"] = errors.check_number("lora.dropout", keys["dropout"], 0.0, 1.0)
    if keys["dropout"] >= 1.0:
        raise ValueError(f"lora.dropout={keys['dropout']}: must be below 1 (1 drops every input)")
    targets = keys["targets"]
    try:
        re.compile(targets or "")
    except (re.error, TypeError) as e:
        raise ValueError(f"lora.targets={targets!r}: not a regular expression: {e}") from None
    keys["base_dtype"] = errors.check_choice("lora.base_dtype", keys["base_dtype"], BASE_DTYPES)
    return keys


def spec(lora: Any, build: Any) -> Spec:
    """The `Spec` of `config.lora` for the model `build(spec)` makes: its adaptable kernels are
    found by initialising it abstractly with adapters everywhere, and `lora.targets` must match
    at least one of them (a `ValueError` lists some if it matches none)."""
    keys = settings(lora)
    everywhere = Spec(keys["rank"], keys["alpha"] / keys["rank"], keys["dropout"])
    model = build(everywhere)
    shapes = _shapes(model)
    kernels = adaptable(shapes)
    targets = keys["targets"]  # None: every projection the model made adaptable, not the head
    chosen = {
        path
        for path in kernels
        if (module_path(path) != HEAD if targets is None else re.search(targets, path))
    }
    experts = [p for p in _experts(shapes) if targets is not None and re.search(targets, p)]
    if experts:  # a mixture's experts: `[E, in, out]` params, no projection module each
        raise ValueError(
            f"lora.targets={keys['targets']!r}: matches the experts' kernels ({experts[0]}), "
            "which take no adapters yet: target the attention's projections (and a dense MLP's)"
        )
    tied = getattr(model, "tie_embeddings", False)
    if targets is not None and re.search(targets, f"{HEAD}/kernel") and not chosen and tied:
        raise ValueError(
            f"lora.targets={targets!r}: matches only the head, which this model ties to its "
            "embedding and which then takes no adapter; target its projections"
        )
    if not chosen:
        shown = ", ".join(sorted(kernels)[:4]) + (", ..." if len(kernels) > 4 else "")
        raise ValueError(
            f"lora.targets={keys['targets']!r}: matches none of the model's {len(kernels)} "
            f"projections that can take an adapter ({shown})"
        )
    width, narrowest = min((min(kernels[p][-2:]), p) for p in chosen)
    if keys["rank"] > width:  # [in, rank] @ [rank, out] holds no more than rank `width`
        raise ValueError(
            f"lora.rank={keys['rank']}: above the width of {narrowest} ({width}), which an "
            f"adapter of rank {width} already spans in full; use a rank of at most {width}"
        )
    return dataclasses.replace(
        everywhere,
        targets=frozenset(map(module_path, chosen)),
        # the kernels an 8-bit base stores in 8 bits: the head stays in the compute dtype
        projections=frozenset(module_path(k) for k in kernels if module_path(k) != HEAD),
    )


def _shapes(model: nn.Module) -> Any:
    tokens = jnp.zeros((1, 1), jnp.int32)
    return axes_lib.declared_of(lambda: model.init(jax.random.key(0), tokens))[1]


def _experts(params: Any) -> list[str]:
    """The "/"-joined paths of a mixture's expert kernels in `params` (`moe/gate`, ...)."""
    paths = [
        "/".join(str(k.key) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    return [p for p in paths if re.search(r"(^|/)moe/(gate|up|down)$", p)]


def adaptable(params: Any) -> dict[str, tuple[int, ...]]:
    """The "/"-joined paths of the kernels in `params` that have adapters beside them, with
    their shapes (a scanned stack's with its layer axis first)."""
    found = {}

    def walk(tree: Any, path: tuple[str, ...]) -> None:
        if not isinstance(tree, dict):
            return
        if ADAPTERS[0] in tree and "kernel" in tree:
            found["/".join((*path, "kernel"))] = tuple(tree["kernel"].shape)
        for key, value in tree.items():
            walk(value, (*path, str(key)))

    walk(dict(params), ())
    return found


def module_path(kernel_path: str) -> str:
    """A kernel's param path as its module sees itself: without `/kernel`, and without the
    stacked layers' prefix and stack (a scanned block is applied on its own, one layer at a
    time, so a target of a stack is one of each of its layers)."""
    keys = tuple(kernel_path.removesuffix("/kernel").split("/"))
    if keys[0] == sharding.STACKED:
        keys = keys[len(sharding.stack_of(keys)[0]) :]
    return "/".join(keys)


def is_adapter(path: str) -> bool:
    """Whether the param at `path` ("/"-joined) is one of an adapter's factors."""
    return path.rsplit("/", 1)[-1] in ADAPTERS


def _init_a(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    bound = 1.0 / math.sqrt(shape[0])  # PEFT's: torch's kaiming_uniform_(a=sqrt(5)) on [r, in]
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def frozen_matmul(x: jax.Array, kernel: Any) -> jax.Array:
    """`x @ kernel` in the wider dtype of the two (as a ``dtype=None`` ``nn.Dense``); an 8-bit
    kernel (`q8.Q8`) is dequantized to `x`'s dtype inside a rematerialised function, so its
    16-bit copy lives for this one matmul and is remade in the backward pass, never kept."""
    if not q8.is_q8(kernel):
        dtype = jnp.result_type(x.dtype, kernel.dtype)
        return jnp.dot(x.astype(dtype), kernel.astype(dtype))

    @jax.checkpoint
    def dot(x, kernel):
        return jnp.dot(x, q8.dequantize(kernel).astype(x.dtype))

    return dot(x, kernel)


class Dense(nn.Module):
    """A bias-free projection for ``layers.run_in`` whose kernel may be frozen in 8 bits, with an
    adapter when ``lora`` says so (the module doc). Param names as ``nn.Dense``'s: ``kernel``."""

    features: int
    lora: Spec
    kernel_init: Any = nn.initializers.lecun_normal()
    use_bias: bool = False  # a bias as nn.Dense's (Qwen2's q, k, v): frozen with the kernel
    names: tuple = (None, None)  # the kernel's logical axes (`parallel.axes`), in and out

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "kernel"):  # an 8-bit kernel has no array shape to check
            kernel = self.get_variable("params", "kernel")
        else:
            init = axes_lib.declare(self.kernel_init, self.names)
            kernel = self.param("kernel", init, (x.shape[-1], self.features))
        y = frozen_matmul(x, kernel)
        if self.use_bias:
            init = axes_lib.declare(nn.initializers.zeros, self.names[1:])
            y = y + self.param("bias", init, (self.features,)).astype(y.dtype)
        if not self.lora.adapts(self.path):
            return y
        if not self.is_initializing() and not self.has_variable("params", ADAPTERS[0]):
            return y  # the adapters off: params without them (DPO's reference) are the base's
        s = self.lora
        # A splits as the kernel's input does, B as its output (a tensor group's part: `(x A) B`
        # is then a partial sum where `x W` is one); the rank is split to store a factor whose
        # other side is no width (`parallel.layout.RULES`)
        (into, out), rank = self.names, axes_lib.RANK
        a = self.param(ADAPTERS[0], axes_lib.declare(_init_a, (into, rank)), (x.shape[-1], s.rank))
        init_b = axes_lib.declare(nn.initializers.zeros, (rank, out))
        b = self.param(ADAPTERS[1], init_b, (s.rank, self.features))
        h = x
        if s.dropout > 0 and self.has_rng("dropout"):  # training: the Trainer passes the rng
            h = nn.Dropout(s.dropout, deterministic=False)(h)
        # the scale on A ([in, rank]), not on x A: a multiply of the activations kept XLA from
        # fusing the adapter's add into the base matmul (two more [tokens, out] buffers)
        h = jnp.dot(h.astype(a.dtype), a * jnp.asarray(s.scale, a.dtype))
        return y + jnp.dot(h, b.astype(h.dtype)).astype(y.dtype)


def head(module: nn.Module, x: jax.Array, kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The head's adapter, for `module` (the head, whose `lora` adapts it): ``x [..., D]`` and
    ``kernel [D, V]`` (a tensor group's part of the vocabulary) widened by the rank, to
    ``[x, scale * x A]`` and ``[W; B]``, whose product is ``x W + scale * (x A) B`` (the module
    doc); unchanged where the params hold no adapters (the adapters off)."""
    if not module.is_initializing() and not module.has_variable("params", ADAPTERS[0]):
        return x, kernel
    s, rank = module.lora, axes_lib.RANK
    init_a = axes_lib.declare(_init_a, (axes_lib.EMBED, rank))
    a = module.param(ADAPTERS[0], init_a, (x.shape[-1], s.rank))
    init_b = axes_lib.declare(nn.initializers.zeros, (rank, axes_lib.VOCAB))
    b = module.param(ADAPTERS[1], init_b, (s.rank, kernel.shape[-1]))
    h = x
    if s.dropout > 0 and module.has_rng("dropout"):  # training: the Trainer passes the rng
        h = nn.Dropout(s.dropout, deterministic=False)(h)
    h = jnp.dot(h.astype(a.dtype), a * jnp.asarray(s.scale, a.dtype)).astype(x.dtype)
    wide = jnp.concatenate([kernel, b.astype(kernel.dtype)], axis=0)
    return jnp.concatenate([x, h], axis=-1), wide


def dense(
    features: int, name: str, lora: Spec | None, kernel_init: Any = None, *,
    names: tuple = (None, None), **kwargs: Any,
) -> nn.Module:  # fmt: skip
    """The models' projection: ``nn.Dense`` (bias-free, ``dtype=None``) without adapters, the
    LoRA ``Dense`` under a ``Spec`` (every projection then takes a frozen, maybe 8-bit kernel;
    those `lora.targets` names get adapters). `names`: the kernel's logical axes, in and out
    (`parallel.axes`), which its bias and adapters take theirs from."""
    init = nn.initializers.lecun_normal() if kernel_init is None else kernel_init
    use_bias = kwargs.pop("use_bias", False)
    if lora is None:
        inits = {
            "kernel_init": axes_lib.declare(init, names),
            "bias_init": axes_lib.declare(nn.initializers.zeros, names[1:]),
        }
        return nn.Dense(features, dtype=None, use_bias=use_bias, name=name, **inits, **kwargs)
    if kwargs:  # fp8's dot_general: `models.create` refuses adapters under fp8
        raise ValueError(f"lora: the projections cannot take {', '.join(kwargs)}")
    return Dense(features, lora, init, use_bias=use_bias, names=tuple(names), name=name)


def merged(params: Any, scale: float) -> Any:
    """`params` (a LoRA model's, base and adapters in one tree) as the base model's, each adapted
    kernel ``W + scale * A B`` computed in fp32 (an 8-bit kernel dequantized first), adapters
    removed: every leaf fp32, for one rounding to whatever dtype it is exported in."""

    def walk(tree: Any) -> Any:
        if not isinstance(tree, dict):
            return q8.dequantize(tree) if q8.is_q8(tree) else jnp.asarray(tree, jnp.float32)
        out = {k: walk(v) for k, v in tree.items() if k not in ADAPTERS}
        if ADAPTERS[0] in tree:
            a, b = (jnp.asarray(tree[k], jnp.float32) for k in ADAPTERS)
            delta = jnp.einsum("...ir,...ro->...io", a, b, precision="highest")
            out["kernel"] = out["kernel"] + jnp.float32(scale) * delta
        return out

    return walk(dict(params))
