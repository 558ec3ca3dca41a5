"""Models whose numerically sensitive parts run in fp32 ("fp32 islands").

Each module here with a `create_model(model_config, compute_dtype)` is a model `config.model.name`
can name (`layers` holds their shared parts). It declares `CONFIG_KEYS`: the keys it reads under
`config.model`, with their defaults (`name` is the base config's), and its `create_model` rejects a
bad value with a `ConfigError` naming the key, before any parameter exists.
"""

import contextlib
import logging as std_logging
import math
import re
from typing import Any

from mptrain import errors, registry


def modules() -> dict[str, Any]:
    """The models of the zoo: `{name: module}` of the modules here with a `create_model`."""
    return registry.modules(__name__, __path__, "create_model")


def import_model(name: Any):
    """`mptrain.models.<name>`; a `ValueError` naming `model.name` and the valid names if none."""
    return registry.lookup("model.name", name, modules(), "model in mptrain.models")


def loss_unit(config) -> str:
    """The unit of the Trainer's built-in loss under `config`, a mean cross-entropy in nats per
    target (`layers.cross_entropy`): "nats/byte" for the language models on the byte-level text of
    `data.name="text"` (`data.tokenizer="bytes"`), whose targets are bytes; "nats/token" for them
    on tokenized text, token files or SFT rows (`data.name="sft"`: per token that carries the
    loss); else "nats" (the classifiers `cnn`, `mlp` and `resnet`: per image). A Trainer
    subclass with its own `loss_fn` names its own unit."""
    model, data = (str(name).strip().lower() for name in (config.model.name, config.data.name))
    if model not in ("transformer_lm", "llama") or data not in ("text", "tokens", "sft"):
        return "nats"
    bytes_ = data == "text" and errors.setting(config.data, "tokenizer", "bytes") == "bytes"
    return "nats/byte" if bytes_ else "nats/token"


class _BelowWarnings(std_logging.Filter):
    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING


@contextlib.contextmanager
def _quiet():
    """Holds back INFO lines (the attention choice): the Trainer logs them when it builds."""
    from absl import logging

    logger, below = logging.get_absl_logger(), _BelowWarnings()
    logger.addFilter(below)
    try:
        yield
    finally:
        logger.removeFilter(below)


def create(config_model: Any, policy: Any, devices: Any = None, loss: Any = None, lora: Any = None):
    """`mptrain.models.<name>.create_model` as the Trainer calls it: in the policy's compute
    dtype, and with fp8 matmuls where the policy has them (`fp8=` its `fp8.Recipe`, which only
    a model whose `create_model` takes `fp8` supports; others are a `ValueError` naming the
    precision). `devices`: what the step is compiled for (None: this process's own); the
    models whose `create_model` takes a `backend` choose by it (`attention.backend_of` them),
    those that take `host_memory` learn whether the devices have pinned host memory. `loss`:
    `config.loss`, for the models that compute their own loss (`create_model` takes `loss`).
    `lora`: `config.lora`; with a rank set, the model gets adapters (`lora.spec`; only a model
    whose `create_model` takes `lora` can, and not with fp8)."""
    import functools
    import inspect

    from mptrain.models import attention
    from mptrain.models import lora as lora_lib

    module = import_model(config_model.name)
    takes = inspect.signature(module.create_model).parameters
    devices = None if devices is None else list(devices)  # read more than once
    extra = {}
    if devices is not None and "backend" in takes:
        extra["backend"] = attention.backend_of(devices)
    if "host_memory" in takes:
        extra["host_memory"] = has_host_memory(devices)
    if loss is not None and "loss" in takes:
        extra["loss"] = loss
    if (lora or {}).get("rank") is not None:
        if "lora" not in takes or policy.fp8:
            why = "fp8 matmuls do not take adapters yet" if policy.fp8 else "no adapters"
            raise ValueError(
                f"lora.rank={lora.get('rank')}: model.name={config_model.name!r} under "
                f"precision={str(policy)!r}: {why}; LoRA adapts llama and transformer_lm"
            )
        build = functools.partial(module.create_model, config_model, policy.compute_dtype)
        with _quiet():
            extra["lora"] = lora_lib.spec(lora, lambda spec: build(**extra, lora=spec))
    if not policy.fp8:
        return module.create_model(config_model, policy.compute_dtype, **extra)
    if "fp8" not in takes:
        raise ValueError(
            f"precision={str(policy)!r}: model.name={config_model.name!r} has no fp8 matmuls; "
            "fp8 runs the projections of llama and transformer_lm"
        )
    return module.create_model(config_model, policy.compute_dtype, fp8=policy.fp8, **extra)


def has_host_memory(devices: Any = None) -> bool:
    """Whether `devices` (None: this process's) have pinned host memory, where activations
    saved for the backward pass can be offloaded."""
    import jax

    device = next(iter(devices)) if devices is not None else jax.local_devices()[0]
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception:
        kinds = set()
    if not kinds:  # a compile-only device (`mptrain.plan`'s) lists none: GPUs and TPUs have it
        return device.platform in ("gpu", "tpu")
    return "pinned_host" in kinds


def check_config(config, policy: Any, example: Any = None, devices: Any = None) -> None:
    """What `config.validate` calls: the model of `config.model` built as the Trainer builds it,
    then, given `example` (one example of the data: arrays or `jax.ShapeDtypeStruct`s), its
    variables initialised abstractly (`jax.eval_shape`: shapes only, a fraction of a second),
    so that a model that cannot take the data's batches fails here too, as a `ValueError`
    naming the model key (`model.max_len=32: ...`) or else the two names. `devices`: what the
    run compiles for (`create`'s), None for this process's."""
    import jax

    module = import_model(config.model.name)
    with _quiet():
        model = create(config.model, policy, devices, config.get("loss"), config.get("lora"))
    context, expert = config.mesh.get("context", 1), config.mesh.get("expert", 1)
    if context != 1:
        _check_context(config, model, context, example)
    if (tensor := config.mesh.get("tensor", 1)) != 1:
        _check_tensor(config, model, tensor, context, example)
    if expert != 1:  # each device holds an equal part of every expert layer's experts
        experts = {getattr(s, "experts", 0) for s in (model.shape, *model.layer_shapes)} - {0}
        if config.model.name != "llama" or not experts:
            raise ValueError(
                f"mesh.expert={expert}: model.num_experts="
                f"{config.model.get('num_experts')}: no experts to split over devices"
            )
        if max(experts) % expert:
            raise ValueError(
                f"mesh.expert={expert}: does not divide model.num_experts={max(experts)}; "
                "each device holds an equal part of every layer's experts"
            )
    if example is None:
        return

    def init(inputs):
        rng = jax.random.key(0)
        return model.init({"params": rng, "dropout": rng}, inputs, train=False)

    try:
        rows = example["inputs"]  # token ids [B, k, L]: groups of k sequences (DPO's pairs)
        if len(rows.shape) == 3 and rows.dtype.kind == "i":
            rows = jax.ShapeDtypeStruct((math.prod(rows.shape[:-1]), rows.shape[-1]), rows.dtype)
        variables = jax.eval_shape(init, rows)
    except (ValueError, TypeError) as e:
        message = errors.first_line(e)
        if re.match(r"^[a-z_]+=", message) and message.split("=")[0] in module.CONFIG_KEYS:
            raise ValueError(f"model.{message}") from None
        inputs = example["inputs"]
        raise ValueError(
            f"model.name={config.model.name!r}: cannot take the batches of data.name="
            f"{config.data.name!r} (inputs {inputs.dtype}{list(inputs.shape)}): {message}"
        ) from None
    if devices is None:  # a run here (a plan for other devices reports their memory itself)
        _check_fits(config, variables)


def _check_context(config, model, context: int, example: Any) -> None:
    """What a sequence split over `mesh.context` devices needs (`recipe.layout`): the Llama
    decoder (it takes positions and masks by them); the materialised attention, the TPU's
    splash kernel (`splash.split_attention`), or cuDNN's (`models.context_attention`) on rows of
    one sequence each without a sliding window; no
    longrope (a row's switch reads its largest position, which one device's tokens do not
    know); and sequences that `2 x context` equal chunks divide."""
    where = f"mesh.context={context}"
    if config.model.name != "llama":
        raise ValueError(
            f"{where}: model.name={config.model.name!r} does not take a split sequence; the "
            "Llama decoder (model.name='llama') does"
        )
    attention = f"model.attention={config.model.get('attention', 'auto')!r}"
    windows = any(s.window for s in (model.shape, *model.layer_shapes))
    packed = example is not None and "segment_ids" in example
    if model.implementation == "cudnn" and (windows or packed):
        what = "a sliding window (model.sliding_window)" if windows else "packed rows"
        raise ValueError(
            f"{where}: {attention} runs cuDNN here, whose split attention does not take "
            f"{what} yet; set model.attention='materialized'"
        )
    if any(s.longrope for s in (model.shape, *model.layer_shapes)):
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


def _check_tensor(config, model, tensor: int, context: int, example: Any) -> None:
    """What a tensor group of `tensor` devices needs (`mptrain.recipe.tensor`): the Llama
    decoder without experts, whose heads, key-value heads, MLP units and vocabulary it divides,
    and a part of every sequence (per context device) it divides by tokens."""
    where = f"mesh.tensor={tensor}"
    if config.model.name != "llama":
        raise ValueError(
            f"{where}: model.name={config.model.name!r} does not split its layers over a tensor "
            "axis; the Llama decoder (model.name='llama') does"
        )
    s, keys = model.shape, config.model
    if any(shape.experts for shape in (s, *model.layer_shapes)):
        raise ValueError(f"{where}: model.num_experts={keys.num_experts}: a mixture of experts "
                         "is split by mesh.expert, not by a tensor axis yet")  # fmt: skip
    kv = s.num_kv_heads
    if kv % tensor and tensor % kv == 0:
        raise ValueError(
            f"{where}: model.num_kv_heads={kv}: each device needs whole key-value heads; "
            f"copying a head to {tensor // kv} devices is not built yet; use a mesh.tensor "
            f"that divides {kv}"
        )
    sizes = {"num_heads": s.num_heads, "num_kv_heads": kv, "d_ff": s.d_ff}
    for key, value in {**sizes, "vocab_size": model.vocab_size}.items():
        if value % tensor:
            raise ValueError(
                f"{where}: does not divide model.{key}={value}; each device of the group holds "
                f"an equal part of it"
            )
    if s.attn_bias == "all" or s.qk_norm_width:
        key = "attn_bias='all'" if s.attn_bias == "all" else "qk_norm_width=True"
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


def _check_fits(config, variables) -> None:
    """The model's fp32 master params alone must fit the memory of the devices here."""
    import math

    import jax

    from mptrain import runtime

    count = sum(math.prod(x.shape) for x in jax.tree.leaves(variables.get("params", {})))
    need, have = 4 * count, runtime.device_memory()
    if need > have:
        raise ValueError(
            f"model.name={config.model.name!r}: its {count:,} params take "
            f"{errors.bytes_text(need)} as fp32 master weights alone, more than the "
            f"{errors.bytes_text(have)} of memory of the devices here; python -m mptrain.plan "
            "tells what a config needs on an accelerator"
        )
