"""Rematerialisation ("activation checkpointing") of the language models' blocks, by name.

Each block tags the values a policy may keep with ``jax.ad_checkpoint.checkpoint_name``: the
outputs of its projections (``PROJECTIONS``, MaxText's names where they exist) and the
attention's output (``CONTEXT``). A policy of ``POLICIES`` says which of them the backward pass
finds stored; the rest of the block is recomputed from the block's input, which is always
kept. ``model.remat`` names one; ``make_policy`` turns the name into the ``jax.checkpoint``
policy applied to every block.

MaxText's own policies are the model for these (``full``, ``minimal``, ``minimal_offloaded``,
...). torchtitan's selective checkpointing keeps matmul outputs too, but every second one;
``full`` is its full checkpointing.
"""

from __future__ import annotations

from typing import Any

import jax

# (a model tags those it has: Llama's separate q, k, v, transformer_lm's fused qkv)
PROJECTIONS = (
    *("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_down"),
    "qkv_proj",
)
CONTEXT = "context"  # the attention's output, before the out projection
BLOCK_INPUT = "block_input"  # a block's input (the residual stream), which "full" keeps

POLICIES = {
    "none": "nothing recomputed: every activation the backward pass needs is kept",
    "full": "only each block's input kept; the whole block recomputed in the backward pass",
    "minimal": "the projections' outputs kept (MaxText's 'minimal'); attention, norms and the "
    "MLP's nonlinearity recomputed",
    "minimal_with_context": "'minimal' and the attention's output kept: attention not recomputed",
    "minimal_offloaded": "the projections' outputs moved to pinned host memory and fetched back "
    "for the backward pass; the rest recomputed",
    "full_offloaded": "'full' with each block's input moved to pinned host memory and fetched "
    "back for the backward pass: nothing of the forward pass kept on the device",
}


def make_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of a ``POLICIES`` name; None for ``"none"`` (no remat)."""
    policies = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return policies.nothing_saveable
    if name == "minimal":
        return policies.save_only_these_names(*PROJECTIONS)
    if name == "minimal_with_context":
        return policies.save_only_these_names(*PROJECTIONS, CONTEXT)
    if name.endswith("_offloaded"):
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[BLOCK_INPUT] if name == "full_offloaded" else PROJECTIONS,
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"remat={name!r}: one of {', '.join(POLICIES)}")


def check(name: Any, host_memory: bool, platform: str) -> str:
    """``model.remat`` checked: a ``POLICIES`` name, and an offloading one only where the
    devices the step is compiled for (``platform``) have pinned host memory."""
    from mptrain import errors

    name = errors.check_choice("model.remat", name, tuple(POLICIES))
    if name.endswith("_offloaded") and not host_memory:
        raise ValueError(
            f"model.remat={name!r}: the {platform} devices the step is compiled for have no "
            "pinned host memory to offload to; use 'minimal' or 'full'"
        )
    return name
