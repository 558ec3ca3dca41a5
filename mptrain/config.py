"""The base config, every key commented, and `validate(config)` with errors that name the key.

Config files under `configs/` start from `base_config()` and change what they need; `main.py`
loads them locked, so a misspelt `--config.foo=...` override fails instead of being ignored,
and `validate` holds the keys a file sets to the same rule: each is a key of `base_config()`,
or, beside `model.name` and `data.name`, one the named module declares in its `CONFIG_KEYS`
(unless the Trainer class builds that section itself: then its keys are the class's own).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Iterator
from typing import Any

import ml_collections
from ml_collections import config_dict

from mptrain import errors
from mptrain.errors import ConfigError


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, dropout and the data order; batch i is a pure function of (seed, i)
    # "fp32" | "bf16-mixed" | "fp16-mixed" | "bf16-pure" | "fp8-mixed" (llama, transformer_lm)
    # | "params=..,compute=..,output=..[,fp8]"
    c.precision = "bf16-mixed"
    # regex over "/"-joined param paths: matching params reach the model in fp32, the rest in
    # the compute dtype. None: embedding tables and norm scales/biases under 16-bit compute
    # (precision.DEFAULT_KEEP_FP32); "": cast every param
    c.keep_fp32 = config_dict.placeholder(str)
    # precision of float32 matmuls, for the step alone: "auto" (highest under fp32 compute, the
    # reference; default under 16-bit compute) | "default" (JAX's: one bf16 pass on a TPU,
    # TF32 on an Ampere+ GPU) | "high" | "highest" (true float32)
    c.matmul_precision = "auto"
    c.trainer = "mptrain.train.trainer:Trainer"  # "package.module:Class" of the Trainer to run
    c.num_train_steps = 1000  # batches to train on in total (a resumed run counts from 0)
    c.batch_size = 32  # global batch size, over all devices and hosts
    c.log_every_steps = 50  # fetch and write train metrics every this many steps
    c.eval_every_steps = 500  # evaluate every this many steps, and always at the last step
    c.eval_steps = 8  # batches per evaluation
    c.checkpoint_every_steps = 500  # save every this many steps, and always at the last step
    c.max_checkpoints_to_keep = 3  # older checkpoints are deleted
    # write checkpoints in the background (orbax's async save): the step goes on once the state
    # is copied to host memory. None: on for GPUs and TPUs, off for CPUs, whose step shares the
    # memory and cores the write uses (`checkpoint.use_async`); False blocks each save
    c.checkpoint_async = config_dict.placeholder(bool)
    c.max_consecutive_skips = 25  # stop (exit 3) after this many non-finite steps in a row
    # steps per dispatch: k > 1 runs k steps in one compiled call (a scan over k stacked
    # batches), with the same results as k single steps, for steps shorter than the host's
    # dispatch; logging, eval, checkpoints and SIGTERM act between calls, so the step counts
    # and intervals above must be multiples of it
    c.steps_per_call = 1
    # how fp32 updates land on 16-bit params: "auto" (stochastic for bf16 params, else nearest)
    # | "nearest" | "stochastic" (bf16 only) | "kahan"
    c.param_rounding = "auto"
    # True: XLA's deterministic GPU kernels (--xla_gpu_deterministic_ops, set before JAX starts),
    # so runs and resumes repeat bit for bit on a GPU: cuDNN's fused attention backward and any
    # scatter (a gather's gradient) otherwise add with atomics. False trades that for speed.
    c.deterministic = True
    # the share of each GPU's memory the run takes (JAX's XLA_PYTHON_CLIENT_MEM_FRACTION, set
    # before JAX starts; a variable the user set wins), and the plan plans against. None: 0.75
    c.memory_fraction = config_dict.placeholder(float)
    # the params of step 0, read from a HuggingFace Llama folder (config.json, *.safetensors),
    # an mptrain workdir (its newest checkpoint) or one of its checkpoints/<step> folders; the
    # optimizer state, step and loss scale start fresh. None: params from the model's own init.
    # A workdir with checkpoints of its own resumes from them and never reads this again
    c.init_from = config_dict.placeholder(str)

    c.loss_scale = ml_collections.ConfigDict()
    c.loss_scale.kind = "auto"  # "auto" (dynamic for fp16 compute) | "none" | "static" | "dynamic"
    c.loss_scale.init_scale = 2.0**15  # starting (or static) scale
    c.loss_scale.growth_interval = 2000  # finite steps in a row before the scale grows
    c.loss_scale.growth_factor = 2.0  # multiplier on growth, > 1
    c.loss_scale.backoff_factor = 0.5  # multiplier on overflow, in (0, 1)
    c.loss_scale.min_scale = 1.0  # the scale never drops below this
    c.loss_scale.max_scale = 2.0**24  # ... nor grows above this
    c.loss_scale.hysteresis = 1  # overflows tolerated before backing off (1: back off at once)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"  # "adamw" | "sgd"
    c.optimizer.learning_rate = 1e-3  # peak learning rate
    c.optimizer.schedule = "cosine"  # "constant" | "cosine" | "linear" (decay after warmup)
    # linear warmup from 0 over this many applied updates (cut to half a shorter run)
    c.optimizer.warmup_steps = 100
    c.optimizer.weight_decay = 0.0  # decoupled weight decay (AdamW)
    c.optimizer.b1 = 0.9  # Adam first-moment decay
    c.optimizer.b2 = 0.999  # Adam second-moment decay
    c.optimizer.eps = 1e-8  # Adam epsilon
    c.optimizer.momentum = 0.9  # SGD momentum (0 for none)
    c.optimizer.nesterov = False  # SGD: Nesterov momentum
    c.optimizer.grad_clip_norm = 1.0  # clip the global gradient norm to this (0: no clipping)
    c.optimizer.mu_dtype = "float32"  # storage dtype of Adam's first moment
    c.optimizer.nu_dtype = "float32"  # storage dtype of Adam's second moment
    c.optimizer.q8_block_size = 256  # "q8" moments: elements that share one fp32 scale
    c.optimizer.q8_min_size = 4096  # "q8" moments: smaller tensors (biases, norms) stay fp32
    # how moments stored in bf16 are rounded: "stochastic" (unbiased) | "nearest"
    c.optimizer.moment_rounding = "stochastic"
    c.optimizer.accumulation_steps = 1  # >1: average gradients over this many batches

    # The language models' loss: a cross-entropy whose logits are fp32 (targets below 0 are
    # masked; the mean is over the rest). Computed in chunks of sequence positions, the head's
    # matmul and the fp32 log-softmax together, so the fp32 [tokens, vocab] logits never exist.
    c.loss = ml_collections.ConfigDict()
    # positions per chunk; None: one chunk while length x vocab <= 2**24, else chunks of the
    # largest power of two whose logits stay within that, at least 512 positions where their
    # logits stay within 2**26 (`lm_loss.auto_chunk`)
    c.loss.chunk_tokens = config_dict.placeholder(int)
    c.loss.z_loss = 0.0  # coefficient on the mean squared log Z (0: none), as MaxText's z-loss

    # Low-rank adapters over a frozen base (docs/fine-tuning.md#lora); rank None: none
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = config_dict.placeholder(int)  # the adapters' rank, e.g. 16
    c.lora.alpha = 16.0  # the adapters' output is scaled by alpha / rank
    c.lora.dropout = 0.0  # of the adapters' input, while training
    # the projections that get adapters: a regex searched in their kernels' param paths; None:
    # every projection the model makes with an adapter's place (`models.lora.dense`), not the
    # head, which takes one where the regex matches `head/kernel`
    c.lora.targets = config_dict.placeholder(str)
    c.lora.base_dtype = "compute"  # the frozen base: "compute" (its dtype) or "q8" (8 bits)
    c.dpo = ml_collections.ConfigDict()  # DPO on preference pairs (data.name="dpo"): docs/dpo.md
    c.dpo.beta = 0.1  # rewards are beta x the log-ratios to the reference (TRL's default)
    c.dpo.loss = "sigmoid"  # "sigmoid" | "robust" | "hinge" | "ipo" (`models.dpo_loss`)
    c.dpo.label_smoothing = 0.0  # sigmoid, robust: the share of pairs taken to be flipped
    c.dpo.sft_weight = 0.0  # times the chosen completions' mean NLL, added to the loss
    c.dpo.reference = "auto"  # "adapters" | "copy" | "precomputed" | "auto" (docs/dpo.md)
    # GRPO on prompts (data.name="grpo"): docs/rl.md; TRL's keys and defaults (`models.grpo_loss`)
    c.grpo = ml_collections.ConfigDict()
    # module:function or a built-in name, or a tuple of them
    c.grpo.reward_funcs = config_dict.placeholder(object)
    c.grpo.reward_weights = config_dict.placeholder(object)  # one number a reward (None: 1.0 each)
    c.grpo.num_generations = 8  # completions a prompt; batch_size counts completions
    c.grpo.loss_type = "dapo"  # "grpo" | "bnpo" | "dr_grpo" | "dapo"
    c.grpo.beta = 0.0  # the KL term's weight against the reference (0: no reference)
    c.grpo.epsilon = 0.2  # the ratio's clip: [1 - epsilon, 1 + epsilon_high]
    c.grpo.epsilon_high = config_dict.placeholder(float)  # None: epsilon
    c.grpo.num_iterations = 1  # updates a batch of completions
    c.grpo.scale_rewards = "group"  # advantages over the std of: "group" | "batch" | "none"
    c.grpo.importance_sampling_level = "token"  # "token" | "sequence" (GSPO)
    c.grpo.max_completion_length = 512  # tokens a completion, its end token included
    c.grpo.temperature = 1.0  # the sampler's, and the distribution the trainer scores
    c.grpo.top_p = 1.0  # the fewest tokens whose probabilities sum to it (1: every token)
    c.grpo.top_k = 0  # 0: every token
    c.grpo.soft_punish_cache = 0  # soft_overlong_punishment_reward's ramp, in tokens
    # the sampler/trainer mismatch's correction: "sequence_mask" (TRL's with vLLM) |
    # "sequence_truncate" | "token_mask" | "token_truncate" | "none" (measured, not corrected)
    c.grpo.sampling_correction = "sequence_mask"
    # the corrected ratio's bounds (None: none that side)
    c.grpo.sampling_clip_min = config_dict.placeholder(float)
    c.grpo.sampling_clip_max = 3.0  # TRL's default cap
    c.grpo.old_logps = "trainer"  # the ratio's old log-probs: "trainer" | "sampler" (its own)
    c.model = ml_collections.ConfigDict()
    # module under mptrain.models; its own keys sit beside it (the module's CONFIG_KEYS; a
    # Trainer whose build_model is its own reads what it likes here)
    c.model.name = "transformer_lm"

    c.data = ml_collections.ConfigDict()
    # module under mptrain.data; its own keys sit beside it (the module's CONFIG_KEYS; a Trainer
    # whose build_datasets is its own reads what it likes here)
    c.data.name = "text"
    # calls' batches made on the devices ahead by a thread (0: none). None: 2 on an
    # accelerator; 0 on a CPU, whose cores run the step itself (a thread making batches there
    # took 5% of a small step)
    c.data.prefetch = config_dict.placeholder(int)

    c.mesh = ml_collections.ConfigDict()
    # devices along the data-parallel axis; -1: all the others leave (by default, every one)
    c.mesh.data = -1
    c.mesh.fsdp = 1  # devices along the parameter-sharding axis
    c.mesh.expert = 1  # devices that split a mixture's experts (and hold rows, as data does)
    c.mesh.context = 1  # devices that split each sequence, balanced (`parallel.layout`)
    c.mesh.tensor = 1  # devices that split each layer's heads, MLP and vocab (`parallel.tensor`)

    c.fp8 = ml_collections.ConfigDict()  # the fp8 matmuls of precision="fp8-mixed"
    # Unset (None), the next three take the model's defaults (its record's): the Llama's are
    # current scaling, one bf16 block at each end, min_size 1024; other models' delayed, 0, 0.
    c.fp8.scaling = config_dict.placeholder(str)  # "delayed" (history), "current", "mxfp8"
    c.fp8.bf16_layers = config_dict.placeholder(int)  # blocks at each end of the stack kept bf16
    # fp8 only for a matmul whose in and out features exceed it (and are multiples of 16)
    c.fp8.min_size = config_dict.placeholder(int)
    c.fp8.history = 1024  # amaxes kept per tensor for delayed scaling (its scale: their max)
    c.fp8.margin = 0  # the scale leaves 2**margin of headroom below the fp8 format's max
    c.numerics = ml_collections.ConfigDict()
    # record every module call's amax, non-finite and underflow counts, forward and backward, on
    # the device; a skipped step's log line then names the module where it went non-finite
    c.numerics.per_layer = False
    # with per_layer: measure inside every step's own gradient (each table is exactly its step's,
    # even with nondeterministic GPU kernels; about 6-9% step time on the default config) instead
    # of differentiating again, only on log and skipped steps, the only tables read (about 1%)
    c.numerics.every_step = False

    c.profile = ml_collections.ConfigDict()  # traced by jax.profiler: docs/performance.md
    c.profile.start_step = 5  # the first step traced, counted from 1 (>= 3: one warm-up call)
    c.profile.num_steps = 0  # steps traced (0: no trace); results are the same traced or not
    # the record's homes, comma-separated: "tensorboard" (always), "wandb", "mlflow" (loggers.py)
    c.log_to = "tensorboard"
    # What the model says, in the record (a Llama): at each evaluation its greedy answers to
    # these prompts go to TensorBoard (text) and samples.jsonl; training is untouched by them
    c.sample = ml_collections.ConfigDict()
    c.sample.prompts = ()  # strings; empty: no samples
    c.sample.chat = False  # each prompt a user turn through the run's chat template
    c.sample.max_new_tokens = 32  # tokens generated at most for each prompt
    # Several processes (hosts): every process runs the same command with its own process_id.
    # All None: one process, or JAX's auto-detection when a cluster (Slurm, Open MPI, Cloud TPU)
    # reports several.
    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = config_dict.placeholder(str)  # "host:port" of process 0
    c.distributed.num_processes = config_dict.placeholder(int)  # processes in the job
    c.distributed.process_id = config_dict.placeholder(int)  # this process, 0..num_processes-1
    return c


_POSITIVE_INTS = (
    *("num_train_steps", "batch_size", "log_every_steps", "eval_every_steps", "eval_steps"),
    *("checkpoint_every_steps", "max_checkpoints_to_keep", "max_consecutive_skips"),
)


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
    value = config
    for part in key.split("."):
        if part not in value:
            raise ValueError(f"{key}: missing from the config")
        value = value[part]
    return value


def _check_run_keys(config: ml_collections.ConfigDict) -> None:
    """The keys that no object below owns: the run's length, intervals and names."""
    for key in _POSITIVE_INTS:  # steps and counts along them; the batch: `_check_batch`
        high = None if key == "batch_size" else errors.INT32_MAX
        counted = key not in ("eval_steps", "max_checkpoints_to_keep")
        why = errors.INT32_WHY if counted else "more than any run gets through one at a time"
        errors.check_integer(key, _get(config, key), 1, high, why)
    why = "JAX's random keys take 32 bits of it (2**32 would be seed 0 again)"
    errors.check_integer("seed", _get(config, "seed"), 0, 2**32 - 1, why)
    trainer = _get(config, "trainer")
    if not isinstance(trainer, str) or not trainer.strip():
        raise ValueError(f"trainer={trainer!r}: must name a class as 'package.module:Class'")
    init_from = config.get("init_from")  # absent from the config.json of an older run
    if init_from is not None and (not isinstance(init_from, str) or not init_from.strip()):
        raise ValueError(f"init_from={init_from!r}: must be None or the path of a folder")
    k = errors.check_integer("steps_per_call", _get(config, "steps_per_call"), 1)
    for key in ("num_train_steps", "log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
        if config[key] % k:
            raise ValueError(
                f"steps_per_call={k}: {key}={config[key]} is not a multiple of it; logging, eval "
                "and checkpoints act between calls of steps_per_call steps"
            )
    if _get(config, "data.prefetch") is not None:
        why = "batches made further ahead only hold memory: the step takes one call's at a time"
        errors.check_integer("data.prefetch", config.data.prefetch, 0, 64, why)
    if errors.check_integer("profile.num_steps", _get(config, "profile.num_steps"), 0):
        errors.check_integer("profile.start_step", _get(config, "profile.start_step"), 3)
    names = set(str(_get(config, "log_to")).replace(" ", "").split(",")) - {""}
    if bad := names - {"tensorboard", "wandb", "mlflow"}:
        raise ValueError(f"log_to={config.log_to!r}: {', '.join(bad)} not tensorboard|wandb|mlflow")
    for key in ("model.name", "data.name"):
        value = _get(config, key)
        if not isinstance(value, str) or not value.isidentifier():
            raise ValueError(f"{key}={value!r}: must name a module (a Python identifier)")
    _check_sample(config)


def _check_sample(config: ml_collections.ConfigDict) -> None:
    sample = config.get("sample") or {}  # absent from the config.json of an older run
    prompts = sample.get("prompts", ())
    if not isinstance(prompts, list | tuple) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"sample.prompts={prompts!r}: must be a list of strings")
    if not isinstance(sample.get("chat", False), bool):
        raise ValueError(f"sample.chat={sample.get('chat')!r}: must be True or False")
    errors.check_integer("sample.max_new_tokens", sample.get("max_new_tokens", 32), 1)
    from mptrain import models

    run = (config.model.name, config.data.name, str(config.precision))
    decodes = getattr(models.record_of(config), "decodes", False)
    if prompts and (not decodes or run[1] == "tokens" or "fp8" in run[2]):
        raise ValueError(
            f"sample.prompts: {run} cannot answer; samples need a model that decodes "
            f"({models.able('decodes')}), text, no fp8"
        )


def flat_items(section: ml_collections.ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """`(dotted key, value)` of every setting in `section`, sections walked into."""
    for key, value in section.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


_DEFAULT_TRAINER = "mptrain.train.trainer:Trainer"
_HOOKS = {"model": "build_model", "data": "build_datasets"}


def _zoo(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """`{"model": module, "data": module}` for the sections the run builds with mptrain's own
    modules (`mptrain.models.<model.name>`, `mptrain.data.<data.name>`): those whose hook the
    Trainer class named by `config.trainer` inherits from `mptrain.train.trainer.Trainer`. A section
    whose hook the class overrides is the class's own, free-form and unchecked here; so is every
    section when the class cannot be imported (`launch.import_trainer` says why next)."""
    from mptrain import data, models

    own = set(_HOOKS)
    if config.trainer != _DEFAULT_TRAINER:
        module_name, _, class_name = config.trainer.partition(":")
        try:  # the user's module: whatever it raises is import_trainer's to report
            cls = getattr(importlib.import_module(module_name), class_name)
            for section, hook in _HOOKS.items():
                owner = next(k for k in cls.__mro__ if hook in vars(k))
                if f"{owner.__module__}:{owner.__qualname__}" != _DEFAULT_TRAINER:
                    own.discard(section)
        except Exception:
            return {}
    found = {"model": models.import_model(config.model.name)} if "model" in own else {}
    return found | ({"data": data.import_source(config.data.name)} if "data" in own else {})


def _check_keys(config: ml_collections.ConfigDict, zoo: dict[str, Any]) -> None:
    """Every key set is one of `base_config()` or one its model or data module declares
    (`CONFIG_KEYS`). A key another module of the zoo declares passes: a config file's setting
    for the model it names, left over when `model.name` is changed (`unused.settings` warns)."""
    valid = dict(flat_items(base_config()))
    valid |= {f"{s}.{key}": None for s, module in zoo.items() for key in module.CONFIG_KEYS}
    elsewhere = {section: _elsewhere(section) for section in zoo}
    for key, value in flat_items(config):
        section, _, leaf = key.rpartition(".")
        top = key.split(".")[0]
        if key in valid or (top in _HOOKS and top not in zoo) or leaf in elsewhere.get(section, ()):
            continue
        near = [k for k in valid if k.rpartition(".")[0] == section] or list(valid)
        where = (
            f"not a key of {section}.name={config[section].name!r}"
            if section in zoo
            else "not a config key"
        )
        raise ValueError(f"{key}={value!r}: {where}; {errors.did_you_mean(key, near)}")


def _elsewhere(section: str) -> set[str]:
    """The keys that any module of the zoo declares for `section` ("model" or "data")."""
    from mptrain import data, models

    package = {"model": models, "data": data}[section]
    return {key for module in package.modules().values() for key in module.CONFIG_KEYS}


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What `validate` built of a run, which the Trainer runs with (`Trainer(resolved=)`), so
    that nothing is built twice: the precision `policy` (its fp8 recipe included), the `mesh`,
    the loss scale, the optimizer `tx` and its `schedule`, the data's `example` (one example's
    abstract shapes, or None), and the model's `record` and `model` (None where the Trainer
    class builds its own: `config.trainer` overrides `build_model`)."""

    policy: Any
    mesh: Any
    loss_scale: Any
    tx: Any
    schedule: Any
    example: Any = None
    record: Any = None
    model: Any = None


def validate(config: ml_collections.ConfigDict, devices: Any = None) -> Resolved:
    """The run `config` describes, built (`Resolved`); a `ConfigError` naming the first bad key
    and value where it cannot be.

    One validation path: besides the run's own keys and the key set itself (a misspelt key in
    a config file is an error, as it is on the command line), it builds the objects a run is
    made of (precision policy, param rounding, loss scale, optimizer and schedule, the mesh,
    the data's example shapes and the model, initialised abstractly on them) and turns their
    `ValueError`s, which name the key, into `ConfigError`s; the Trainer then runs with what it
    built. The rules live with the objects; nothing here reads a dataset or touches the
    workdir. `devices`: what the run compiles for (default: JAX's own; `mptrain.plan` passes an
    accelerator's), which the mesh takes and the model's choices by backend (attention) follow.
    """
    from mptrain import data, models, optim, runtime
    from mptrain.parallel import layout
    from mptrain.recipe import loss_scale, train_state

    section = ""
    try:
        _check_run_keys(config)
        zoo = _zoo(config)
        _check_keys(config, zoo)
        runtime.distributed_args(config)
        runtime.memory_fraction(config)
        policy = policy_of(config)
        train_state.resolve_param_rounding(_get(config, "param_rounding"), policy)
        section = "loss_scale."
        scaler = loss_scale.create_loss_scale(policy=policy, **_get(config, "loss_scale"))
        section = ""
        tx, schedule = optim.make_optimizer(
            _get(config, "optimizer"), config.num_train_steps, seed=config.seed
        )
        local = devices is None  # the run is here (else compiled for devices that are not)
        mesh = layout.create_mesh(_get(config, "mesh"), config.batch_size, devices)
        split = tuple(mesh.shape.values())[1:]
        lora = config.get("lora") or {}
        if lora.get("base_dtype") == "q8" and lora.get("rank") and math.prod(split) > 1:
            named = ", ".join(f"{k}={v}" for k, v in zip(layout.KEYS[1:], split, strict=True))
            raise ValueError(
                f"lora.base_dtype='q8': an 8-bit base is not split over devices yet ({named}); "
                "use mesh.data alone (data parallel), or lora.base_dtype='compute'"
            )
        example = data.check_config(config) if "data" in zoo else None
        if local:  # a run here builds its batches here; a plan's host does not
            data.check_batch(config, example)
        model = None
        if "model" in zoo:
            model = models.check_config(config, policy, example, mesh.devices.flat, local)
    except ConfigError:  # already says `config.<key>=...`
        raise
    except ValueError as e:
        raise ConfigError(f"config.{section}{e}") from None
    record = zoo["model"].RECORD if "model" in zoo else None
    return Resolved(policy, mesh, scaler, tx, schedule, example, record, model)


def policy_of(config: ml_collections.ConfigDict):
    """The run's `precision.Policy`: `config.precision` and `keep_fp32`, and under fp8-mixed the
    `fp8.*` recipe (`fp8.Recipe`); a `ValueError` naming a bad key."""
    import dataclasses

    from mptrain.recipe import fp8, precision

    policy = precision.get_policy(_get(config, "precision"), _get(config, "keep_fp32"))
    choices = ("auto", *precision.MATMUL_PRECISIONS)
    matmuls = errors.check_choice(
        "matmul_precision", config.get("matmul_precision", "auto"), choices
    )
    policy = dataclasses.replace(policy, matmul_precision=matmuls)
    from mptrain import models

    section = config.get("fp8") or {}  # checked under every precision: a typo is an error
    record, model = models.record_of(config), config.get("model") or {}
    recipe = fp8.from_config(section, record and record.fp8, model.get("num_layers"))
    return dataclasses.replace(policy, fp8=recipe) if policy.fp8 else policy


def to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """A plain, JSON-ready dict of the resolved config."""
    return config_dict.ConfigDict(config).to_dict()


def override(
    config: ml_collections.ConfigDict, values: dict[str, Any]
) -> ml_collections.ConfigDict:
    """Sets dotted keys (`{"optimizer.mu_dtype": "q8"}`), as `--config.a.b=v` does; returns it."""
    for key, value in values.items():
        section = config
        *parents, leaf = key.split(".")
        for parent in parents:
            section = section[parent]
        section[leaf] = value
    return config
