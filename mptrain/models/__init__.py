"""Models whose numerically sensitive parts run in fp32 ("fp32 islands"), and their registry.

Each module here with a `create_model(model_config, compute_dtype)` is a model `config.model.name`
can name: the one decoder (`decoder/`, "llama", every HuggingFace family), the byte-level
`transformer_lm` (the default run's, and the yardstick's), and the classifiers `cnn`, `mlp` and
`resnet`; their shared parts are `layers`, `attention`, `remat`, `lora`, `lm_loss`, `dpo_loss`,
`segments` and `splash`. Each declares `CONFIG_KEYS`: the keys it reads under
`config.model`, with their defaults (`name` is the base config's), and `RECORD`: what it can do
(`mptrain.models.record.Record`), which every other module asks (`record_of`) instead of
comparing names. Its `create_model` rejects a bad value with a `ConfigError` naming the key,
before any parameter exists.
"""

import contextlib
import logging as std_logging
import math
import re
from typing import Any

from mptrain import errors, registry
from mptrain.models import record as record_lib


def modules() -> dict[str, Any]:
    """The models of the zoo: `{name: module}` of the modules here with a `create_model`, by
    the name their `RECORD` gives (`config.model.name`)."""
    found = registry.modules(__name__, __path__, "create_model")
    return {module.RECORD.name: module for module in found.values()}


def import_model(name: Any):
    """`mptrain.models.<name>`; a `ValueError` naming `model.name` and the valid names if none."""
    return registry.lookup("model.name", name, modules(), "model in mptrain.models")


def record_of(config: Any) -> record_lib.Record | None:
    """The `Record` of the zoo's model `config.model.name` names (a whole config or its model
    section); None where it names none (a Trainer's own model)."""
    section = config.get("model", config) if hasattr(config, "get") else config
    name = section.get("name") if hasattr(section, "get") else None
    try:
        return import_model(name).RECORD
    except ValueError:
        return None


def records() -> list[record_lib.Record]:
    """Every model's `Record`, by name."""
    return [modules()[name].RECORD for name in sorted(modules())]


def able(what: str) -> str:
    """The zoo's models whose record says `what` (a `Record` field), for messages."""
    has = lambda r: getattr(r, what) not in (None, False)  # fp8's defaults may be empty
    return " and ".join(r.name for r in records() if has(r)) or "none of the zoo"


def loss_unit(config) -> str:
    """The unit of the Trainer's built-in loss under `config`, a mean cross-entropy in nats per
    target (`layers.cross_entropy`): "nats/byte" for a language model (`Record.language_model`)
    on the byte-level text of `data.name="text"` (`data.tokenizer="bytes"`), whose targets are
    bytes; "nats/token" for one on tokenized text, token files or SFT rows (`data.name="sft"`:
    per token that carries the loss); else "nats" (the classifiers: per image). A Trainer
    subclass with its own `loss_fn` names its own unit."""
    record = record_of(config)
    data = str(config.data.name).strip().lower()
    if not (record and record.language_model) or data not in ("text", "tokens", "sft"):
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
    dtype, with what its `Record` says it takes. `devices`: what the step is compiled for
    (None: this process's own), by which a language model chooses (`attention.backend_of`
    them) and learns whether the devices have pinned host memory. `loss`: `config.loss`, for
    a language model's own loss. fp8 matmuls where the policy has them, which only a model
    whose record has fp8 takes (others: a `ValueError` naming the precision). `lora`:
    `config.lora`; with a rank set, the model gets adapters (`lora.spec`; a model whose record
    has adapters, and not with fp8)."""
    import functools

    from mptrain.models import attention
    from mptrain.models import lora as lora_lib

    module = import_model(config_model.name)
    record = module.RECORD
    devices = None if devices is None else list(devices)  # read more than once
    extra = {}
    if record.language_model:
        extra["host_memory"] = has_host_memory(devices)
        if devices is not None:
            extra["backend"] = attention.backend_of(devices)
        if loss is not None:
            extra["loss"] = loss
    if (lora or {}).get("rank") is not None:
        if not record.adapters or policy.fp8:
            why = "fp8 matmuls do not take adapters yet" if policy.fp8 else "no adapters"
            raise ValueError(
                f"lora.rank={lora.get('rank')}: model.name={config_model.name!r} under "
                f"precision={str(policy)!r}: {why}; LoRA adapts {able('adapters')}"
            )
        build = functools.partial(module.create_model, config_model, policy.compute_dtype)
        with _quiet():
            extra["lora"] = lora_lib.spec(lora, lambda spec: build(**extra, lora=spec))
    if not policy.fp8:
        return module.create_model(config_model, policy.compute_dtype, **extra)
    if record.fp8 is None:
        raise ValueError(
            f"precision={str(policy)!r}: model.name={config_model.name!r} has no fp8 matmuls; "
            f"fp8 runs the projections of {able('fp8')}"
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


def check_config(
    config, policy: Any, example: Any = None, devices: Any = None, local: bool = True
) -> Any:
    """What `config.validate` calls: the model of `config.model` built as the Trainer runs it
    (returned: the run takes it, `config.Resolved`), then, given `example` (one example of the
    data: arrays or `jax.ShapeDtypeStruct`s), its variables initialised abstractly
    (`jax.eval_shape`: shapes only, a fraction of a second), so that a model that cannot take
    the data's batches fails here too, as a `ValueError` naming the model key
    (`model.max_len=32: ...`) or else the two names. `devices`: what the run compiles for
    (`create`'s), None for this process's; `local`: the run is here, whose devices' memory
    must hold the model's fp32 params."""
    import jax

    module = import_model(config.model.name)
    model = create(config.model, policy, devices, config.get("loss"), config.get("lora"))
    check_mesh(config, module.RECORD, model, example)
    if example is None:
        return model

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
    if local:  # a run here (a plan for other devices reports their memory itself)
        _check_fits(config, variables)
    return model


def check_mesh(config, record: record_lib.Record, model: Any, example: Any = None) -> None:
    """The mesh of `config` against what `record` says the model splits over: an axis it does
    not take is a `ValueError` naming it, and its record's `check_mesh` says what the others
    need of its settings and the data (`example`: one example's shapes, or None)."""
    split = {axis: config.mesh.get(axis, 1) for axis in record_lib.MESH_AXES}
    split = {axis: size for axis, size in split.items() if size != 1}
    for axis, size in split.items():
        if axis not in record.mesh:
            takes = " and ".join(r.name for r in records() if axis in r.mesh) or "no model"
            raise ValueError(
                f"mesh.{axis}={size}: model.name={config.model.name!r} "
                f"{record_lib.NOT_SPLIT[axis]}; {takes} does"
            )
    if split and record.check_mesh is not None:
        record.check_mesh(config, model, example)


def mesh_refusal(config, policy: Any, devices: Any = None, example: Any = None) -> str | None:
    """Why the model of `config` cannot take its mesh (`check_mesh`'s message), or None where
    it can: what `mptrain.plan`'s search asks of a layout before it compiles one. A model that
    is not the zoo's (no record) takes data and fsdp alone."""
    if record_of(config) is None:
        split = [f"mesh.{a}" for a in record_lib.MESH_AXES if config.mesh.get(a, 1) != 1]
        return (
            f"{', '.join(split)}: model.name={config.model.name!r} has no record" if split else None
        )
    module = import_model(config.model.name)
    try:
        with _quiet():
            model = create(config.model, policy, devices, config.get("loss"))
        check_mesh(config, module.RECORD, model, example)
    except ValueError as e:
        return errors.first_line(e)
    return None


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
