"""What the decoder (`mptrain.models.decoder`, its `RECORD.check_mesh`) needs of its settings
and the data under `config.mesh`'s expert, context and tensor axes: each a `ValueError` naming
the keys, raised before anything compiles."""

from __future__ import annotations

from typing import Any

from mptrain.models.decoder.model import Llama


def check_mesh(config, model: Llama, example: Any) -> None:
    """What the decoder needs of its settings and the data under `config.mesh`'s expert,
    context and tensor axes (its `RECORD.mesh`); a `ValueError` naming the keys."""
    mesh = config.mesh
    context, tensor = mesh.get("context", 1), mesh.get("tensor", 1)
    if (expert := mesh.get("expert", 1)) != 1:  # an equal part of every layer's experts
        experts = {s.experts for s in model.specs} - {0}
        if not experts:
            raise ValueError(
                f"mesh.expert={expert}: model.num_experts="
                f"{config.model.get('num_experts')}: no experts to split over devices"
            )
        if max(experts) % expert:
            raise ValueError(
                f"mesh.expert={expert}: does not divide model.num_experts={max(experts)}; "
                "each device holds an equal part of every layer's experts"
            )
    shared = config.model.get("shared_expert_d_ff")
    if shared is not None and tensor != 1:  # under an expert axis: held as the attention is
        raise ValueError(
            f"mesh.tensor={tensor}: model.shared_expert_d_ff={shared} (a shared expert) is "
            "not split over a tensor axis yet; use data, fsdp and expert"
        )
    if context != 1:
        _check_context(config, model, context, example)
    if tensor != 1:
        _check_tensor(config, model, tensor, context, example)


def _check_context(config, model: Llama, context: int, example: Any) -> None:
    """What a sequence split over `mesh.context` devices needs (`parallel.layout`): the
    materialised attention, the TPU's splash kernel (`splash.split_attention`), or cuDNN's
    (`models.decoder.context_attention`) on rows of one sequence each without a sliding window; no
    longrope (a row's switch reads its largest position, which one device's tokens do not
    know); and sequences that `2 x context` equal chunks divide."""
    where = f"mesh.context={context}"
    attention = f"model.attention={config.model.get('attention', 'auto')!r}"
    windows = any(s.attention.window for s in model.specs)
    packed = example is not None and "segment_ids" in example
    if model.implementation == "cudnn" and (windows or packed):
        what = "a sliding window (model.sliding_window)" if windows else "packed rows"
        raise ValueError(
            f"{where}: {attention} runs cuDNN here, whose split attention does not take "
            f"{what} yet; set model.attention='materialized'"
        )
    if model.implementation == "cudnn" and any(s.attention.sinks for s in model.specs):
        raise ValueError(
            f"{where}: {attention} runs cuDNN here, whose split attention takes no sinks "
            "(model.attn_sinks, gpt-oss's) yet; set model.attention='materialized'"
        )
    if any(s.attention.longrope for s in model.specs):
        raise ValueError(
            f"{where}: model.rope_scaling is longrope, whose switch reads a row's largest "
            "position, which a split sequence's devices do not each hold; use mesh.context=1"
        )
    length = None if example is None else example["inputs"].shape[1]
    if length is not None and length % (2 * context):
        raise ValueError(
            f"{where}: data.seq_len={length} tokens, which {2 * context} equal chunks (two a "
            f"device, balanced for causal attention) do not divide; use a multiple of "
            f"{2 * context}"
        )


def _check_tensor(config, model: Llama, tensor: int, context: int, example: Any) -> None:
    """What a tensor group of `tensor` devices needs (`mptrain.parallel.tensor`): no experts,
    heads, key-value heads, MLP units and a vocabulary it divides, and a part of every sequence
    (per context device) it divides by tokens."""
    where = f"mesh.tensor={tensor}"
    spec, keys = model.specs[0], config.model
    s, a = spec.shape, spec.attention
    if any(layer.experts for layer in model.specs):
        raise ValueError(f"{where}: model.num_experts={keys.num_experts}: a mixture of experts "
                         "is split by mesh.expert, not by a tensor axis yet")  # fmt: skip
    kv = s.num_kv_heads
    if kv % tensor and tensor % kv == 0:
        raise ValueError(
            f"{where}: model.num_kv_heads={kv}: each device needs whole key-value heads; "
            f"copying a head to {tensor // kv} devices is not built yet; use a mesh.tensor "
            f"that divides {kv}"
        )
    sizes = {"num_heads": s.num_heads, "num_kv_heads": kv, "d_ff": spec.ffn.d_ff}
    for key, value in {**sizes, "vocab_size": model.vocab_size}.items():
        if value % tensor:
            raise ValueError(
                f"{where}: does not divide model.{key}={value}; each device of the group holds "
                f"an equal part of it"
            )
    if a.latent is not None or a.sinks:
        what = f"kv_lora_rank={keys.kv_lora_rank} (latent attention)" if a.latent else "attn_sinks"
        raise ValueError(
            f"{where}: model.{what} is not split over a tensor axis yet; use mesh.fsdp"
        )
    if a.bias == "all" or a.qk_norm == "width":
        key = "attn_bias='all'" if a.bias == "all" else "qk_norm_width=True"
        raise ValueError(
            f"{where}: model.{key} is not split over a tensor axis yet (the out projection's "
            "bias, a norm across every head); use mesh.fsdp"
        )
    length = None if example is None else example["inputs"].shape[-1]
    if length is not None and (length // context) % tensor:
        raise ValueError(
            f"{where}: data.seq_len={length}: each device's part of a sequence "
            f"({length // context} tokens) does not divide into {tensor} equal parts between "
            f"the blocks; use a multiple of {context * tensor}"
        )
