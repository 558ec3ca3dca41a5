"""The names of the decoder's params in a HuggingFace folder, both ways (`mptrain.hf`'s table):
each param of the llama tree (`mptrain.models.decoder`'s layout) is one HF tensor a layer,
transposed where it is a kernel, or a block of rows of one (a family's fused projections,
Phi-3's `qkv_proj` [q | k | v] and `gate_up_proj` [gate | up]: `families.Family.fused`)."""

from __future__ import annotations

import dataclasses
import re

from mptrain import errors
from mptrain.hf import families
from mptrain.parallel import sharding

LAYER_PREFIX = "model.layers.{}."
# A block's params (path under the layer) -> HF name under model.layers.i., transposed?
LAYER_NAMES = {
    ("attn_norm", "scale"): ("input_layernorm.weight", False),
    ("attn", "q", "kernel"): ("self_attn.q_proj.weight", True),
    ("attn", "k", "kernel"): ("self_attn.k_proj.weight", True),
    ("attn", "v", "kernel"): ("self_attn.v_proj.weight", True),
    ("attn", "o", "kernel"): ("self_attn.o_proj.weight", True),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", True),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", True),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", True),
    # the families' switches (`mptrain.hf.families`): biases, each head's q and k norms
    ("attn", "q", "bias"): ("self_attn.q_proj.bias", False),
    ("attn", "k", "bias"): ("self_attn.k_proj.bias", False),
    ("attn", "v", "bias"): ("self_attn.v_proj.bias", False),
    ("attn", "o", "bias"): ("self_attn.o_proj.bias", False),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", False),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", False),
    # multi-head latent attention's (DeepSeek's: `blocks.LatentSpec`); its q without a latent
    # is the table's q_proj
    ("attn", "q_a", "kernel"): ("self_attn.q_a_proj.weight", True),
    ("attn", "q_a", "bias"): ("self_attn.q_a_proj.bias", False),
    ("attn", "q_a_norm", "scale"): ("self_attn.q_a_layernorm.weight", False),
    ("attn", "q_b", "kernel"): ("self_attn.q_b_proj.weight", True),
    ("attn", "kv_a", "kernel"): ("self_attn.kv_a_proj_with_mqa.weight", True),
    ("attn", "kv_a", "bias"): ("self_attn.kv_a_proj_with_mqa.bias", False),
    ("attn", "kv_a_norm", "scale"): ("self_attn.kv_a_layernorm.weight", False),
    ("attn", "kv_b", "kernel"): ("self_attn.kv_b_proj.weight", True),
    ("attn", "sinks"): ("self_attn.sinks", False),  # gpt-oss's, a logit a head
}
# Gemma's four norms a block (`post_norms`): its post_attention_layernorm follows the attention
POST_NORM_NAMES = {
    **LAYER_NAMES,
    ("attn_post_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", False),
    ("mlp_post_norm", "scale"): ("post_feedforward_layernorm.weight", False),
}
TOP_NAMES = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("head", "kernel"): ("lm_head.weight", True),
}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One param and the HF tensors it is made of: one per layer when stacked; `rows`, the
    block of a fused tensor's rows it is (`start`, `stop`, the tensor's rows), or None."""

    path: str  # "stacked_layers/attn/q/kernel", for messages
    names: tuple[str, ...]
    transposed: bool
    lead: tuple[int, ...]  # the param's leading axes over `names` (layers, experts), row-major
    shape: tuple[int, ...]  # one tensor's, as the param has it
    rows: tuple[int, int, int] | None = None
    # `(offset, parts)`: the param is every `parts`-th column of the tensor's last axis from
    # `offset` (gpt-oss's gate and up, interleaved in `gate_up_proj`)
    stride: tuple[int, int] | None = None

    @property
    def stacked(self) -> bool:  # a tensor a row of the param
        return bool(self.lead)

    @property
    def hf_shape(self) -> tuple[int, ...]:  # as the file has each of `names`
        shape = tuple(reversed(self.shape)) if self.transposed else self.shape
        if self.stride is not None:
            return (*shape[:-1], shape[-1] * self.stride[1])
        return shape if self.rows is None else (self.rows[2], *shape[1:])


def _fused(c: dict) -> dict:
    """`{param path under a layer: (HF name, (start, stop, rows))}` of `c`'s family's fused
    tensors: each part's block of rows, in the order the family lists them."""
    out = {}
    width = {"q": c["num_heads"] * c["head_dim"], "gate": c["d_ff"], "up": c["d_ff"]}
    width |= dict.fromkeys("kv", c["num_kv_heads"] * c["head_dim"])
    for (module, name), parts in families.FAMILIES[c["family"]].fused:
        total, start = sum(width[p] for p in parts), 0
        for part in parts:
            out[(module, part, "kernel")] = (name, (start, start + width[part], total))
            start += width[part]
    return out


def leaf(keys: tuple[str, ...], shape: tuple[int, ...], c: dict | None = None) -> Leaf:
    """The `Leaf` of the param at `keys` (its path) of `shape`, for the checked settings `c`
    (None: a Llama's names)."""
    path, first = "/".join(keys), 0
    if keys[0] == sharding.STACKED:  # one of several stacks: its keys, and its first layer
        stack, first = sharding.stack_of(keys)
        keys = (sharding.STACKED, *keys[len(stack) :])
    top, rest = keys[0], keys[1:]
    layer = re.fullmatch(r"layers_(\d+)", top)
    table = POST_NORM_NAMES if c and c["post_norms"] else LAYER_NAMES
    fused = _fused(c) if c else {}
    rows = None
    if rest in fused:
        name, rows = fused[rest]
        table = {rest: (name + ".weight", True)}
    if c and c["num_experts"] and rest[0] == "moe":
        table = families.FAMILIES[c["family"]].experts.names
    each = int(c is not None and rest in table and "{}" in table[rest][0])  # an expert a tensor
    if (top == sharding.STACKED or layer) and rest in table and len(shape) > each:
        name, transposed, *stride = table[rest]
        lead = shape[: each + (not layer)]
        layers = [layer[1]] if layer else range(first, first + shape[0])
        expert = (lambda n, j: n.format(j)) if each else lambda n, j: n
        names = tuple(
            LAYER_PREFIX.format(i) + expert(name, j)
            for i in layers
            for j in range(shape[len(lead) - 1] if each else 1)
        )
        return Leaf(path, names, transposed, lead, shape=shape[len(lead) :], rows=rows,
                    stride=stride[0] if stride else None)  # fmt: skip
    if keys in TOP_NAMES:
        name, transposed = TOP_NAMES[keys]
        return Leaf(path, (name,), transposed, lead=(), shape=shape)
    raise errors.ConfigError(f"params/{path}: no tensor of a HuggingFace folder maps onto it")


def order(name: str) -> tuple:
    """HF's order: the embedding, the layers in turn, the final norm, the head."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        known = [n for n, _ in POST_NORM_NAMES.values()]
        rest = name[layer.end() :]
        return (1, int(layer[1]), known.index(rest) if rest in known else len(known), rest)
    return (0 if "embed" in name else 2 if "norm" in name else 3, 0, 0, "")
