"""Helpers the tests import (`from helpers import ...`): configs, CLI runs in and out of
process, multi-process jobs, byte comparisons of trees, the record read back, programs read for
their dtypes, a GPU where there is none, and the tiny HF Llama fine-tune.
"""

import importlib.util
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.extend import core as jex

import mptrain
from mptrain import config as config_lib
from mptrain import main as main_lib
from mptrain.models import attention

ROOT = Path(__file__).resolve().parents[1]
TINY = f"--config={ROOT / 'configs' / 'default.py'}:tiny"


def needs_devices(count: int):
    """Marks a test that builds a mesh of `count` devices: skipped, with a reason naming both
    counts, where JAX has fewer (one GPU, say)."""
    have = jax.device_count()
    reason = f"needs {count} devices; JAX has {have} {jax.default_backend()} device(s)"
    return pytest.mark.skipif(have < count, reason=reason)


needs_tfds = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow_datasets") is None,
    reason="needs the extra mptrain[tfds] (TensorFlow Datasets), not installed here",
)


# What JAX's CUDA plugin writes to stderr from C++ whenever a process loads it on a machine
# without a GPU driver (the extra mptrain[plan] installs it): not mptrain's output.
_PLUGIN_CHATTER = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|I0000 00:00:\S+ +\d+ cudart_stub\.cc:)"
)


def stderr_lines(text: str) -> list[str]:
    """The non-blank lines of a process's stderr, less the CUDA plugin's start-up chatter."""
    return [line for line in text.splitlines() if line.strip() and not _PLUGIN_CHATTER.match(line)]


# The flags of this process's XLA_FLAGS that the processes it starts keep: how the Makefile's
# test targets compile (TEST_XLA_FLAGS), not what they are given to run on.
_KEPT_FLAGS = ("--xla_backend_optimization_level=",)


def fake_cpu_env(devices: int) -> dict[str, str]:
    """The environment of a process with `devices` fake CPU devices. With more than one, the
    process runs on the CPU even where there is an accelerator: such tests are about meshes and
    processes, and one GPU cannot be eight devices. Its $NPROC is its own start-up's
    (`runtime.set_cpu_threads`), not this process's."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(_KEPT_FLAGS)]
    flags = " ".join([f"--xla_force_host_platform_device_count={devices}", *kept])
    env = dict(os.environ, XLA_FLAGS=flags)
    env.pop("NPROC", None)
    if devices > 1:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def load_config(name: str, arg: str | None = "tiny", **overrides):
    """`configs/<name>.py:get_config(arg)` with dotted-key overrides, like --config.a.b=v."""
    config = runpy.run_path(str(ROOT / "configs" / f"{name}.py"))["get_config"](arg)
    return config_lib.override(config, overrides)


def tiny_config(**overrides):
    """The tiny default with a constant schedule, so its horizon is not `num_train_steps`
    (a 4-step run resumed to 8 then trains exactly as an 8-step run)."""
    return load_config("default", **{"optimizer.schedule": "constant", **overrides})


def normal(seed: int, shape, dtype=np.float32, scale: float = 1.0) -> jax.Array:
    """Standard-normal test data times `scale`, drawn by numpy and cast there to `dtype`: an
    eager `jax.random.normal` compiles a program of its own for each shape and dtype, and the
    suite once spent 35 of its large compiles on such draws."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * np.float32(scale)
    return jnp.asarray(x.astype(dtype))


def integers(seed: int, shape, high: int, low: int = 0) -> jax.Array:
    """int32 test data in `[low, high)`, drawn by numpy (see `normal`)."""
    return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape).astype(np.int32))


def assert_trees_bytes_equal(a, b):
    """The same leaf paths, and every leaf bit-identical in dtype, shape and bytes."""
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        name = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


def plain_orbax_state(workdir, step):
    """The `state` item read back with plain orbax (no mptrain): nested dicts of numpy arrays."""
    path = (Path(workdir) / "checkpoints" / str(step) / "state").resolve()
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(state))
    return state


def event_series(workdir, tag: str) -> dict[int, np.ndarray]:
    """`{step: value}` of `tag` in a workdir's event files, read by TensorBoard's own reader
    (`EventAccumulator`); a scalar is a 0-d array."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    found = {}
    for path in sorted(Path(workdir).glob("events.out.tfevents.*")):
        events = event_accumulator.EventAccumulator(str(path), size_guidance={"tensors": 0})
        events.Reload()
        if tag in events.Tags()["tensors"]:
            for event in events.Tensors(tag):
                found[event.step] = tensor_util.make_ndarray(event.tensor_proto)
    return found


def event_tags(workdir) -> set[str]:
    """Every tag in a workdir's event files."""
    from tensorboard.backend.event_processing import event_accumulator

    tags = set()
    for path in Path(workdir).glob("events.out.tfevents.*"):
        events = event_accumulator.EventAccumulator(str(path), size_guidance={"tensors": 0})
        events.Reload()
        tags |= set(events.Tags()["tensors"]) | set(events.Tags()["scalars"])
    return tags


def run_cli(workdir, *overrides, capsys=None, config=TINY):
    """`python -m mptrain.main` in-process: (exit code, stderr)."""
    argv = ["mptrain", config, f"--workdir={workdir}", *overrides]
    try:
        code = main_lib.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err if capsys else ""
    return code, err


def run_cli_process(
    *args, devices: int = 1, timeout: int = 300, module: str = "mptrain.main", tests=False
):
    """`python -m mptrain.main ARGS` (or another `module`) in a fresh process from the
    repository root (so that `examples` is importable; with `tests`, `tests/train/` too), with
    `devices` fake CPU devices."""
    env = fake_cpu_env(devices)
    if tests:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "tests" / "train"), env.get("PYTHONPATH", "")]
        )
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def start_processes(workdir, *overrides, processes=2, devices=2, config=TINY):
    """Starts one job of `processes` CLI processes on localhost, `devices` fake CPU devices
    each, coordinated by `jax.distributed` (gloo collectives); `tests/train/` is importable, so
    `--config.trainer=multihost_helpers:...` works. Returns the `Popen`s (stderr piped)."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = fake_cpu_env(devices)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "train"), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "mptrain.main", config, f"--workdir={workdir}", *overrides]
    command += [
        f"--config.distributed.coordinator_address=localhost:{port}",
        f"--config.distributed.num_processes={processes}",
    ]
    return [
        subprocess.Popen(
            [*command, f"--config.distributed.process_id={i}"],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]


def wait_for_processes(procs, timeout=300):
    """`[(exit code, stderr)]` of the processes, once all have ended."""
    errs = [proc.communicate(timeout=timeout)[1] for proc in procs]  # drains the pipes
    return [(proc.returncode, err) for proc, err in zip(procs, errs, strict=True)]


class TraceCountingTrainer(mptrain.Trainer):
    """Counts how often the train step is traced; each trace is a compilation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_step_traces = 0

    def make_train_step(self):
        train_step = super().make_train_step()

        def counted(*args):
            self.train_step_traces += 1  # runs only while tracing
            return train_step(*args)

        return counted


_DOT = re.compile(r"stablehlo\.(dot_general|convolution)\b.*:\s*\((tensor<[^)]*)\)\s*->\s*(\S+)")
_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*([a-z]+[0-9]*)>")


def matmul_dtypes(lowered_text: str) -> list[tuple[tuple[str, ...], str]]:
    """(operand dtypes, result dtype) of every dot_general/convolution in a lowered program."""
    found = []
    for line in lowered_text.splitlines():
        match = _DOT.search(line)
        if match:
            operands = tuple(_TYPE.findall(match.group(2)))
            (result,) = _TYPE.findall(match.group(3))
            found.append((operands, result))
    return found


# ----------------------------------------------------------------- what XLA:GPU may compile

_TRIPS = {  # the two ways out of a dtype that a compiler may find a way back from
    jex.primitives.convert_element_type_p: "convert",
    jex.primitives.bitcast_convert_type_p: "bitcast",
}
_CALLS = (jex.primitives.jit_p, jex.primitives.closed_call_p)


def drop_round_trips(fn):
    """`fn` as a compiler allowed excess precision may compile it: a float round trip through a
    narrower type (fp32 -> bf16 -> fp32) becomes the fp32 value it started from, which XLA:GPU
    does by default, and a pair of bitcasts that undo each other goes too, as every backend's
    simplifier does. Rewrites the traced program; jit the result to compile it."""

    def run(jaxpr, consts, args):
        # Every value travels as (value, came_from): came_from is (trip, (value, came_from)) of
        # the value a narrowing convert or a bitcast made this one from, else None.
        env = dict(zip(jaxpr.constvars, [(c, None) for c in consts], strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        read = lambda v: (v.val, None) if isinstance(v, jex.Literal) else env[v]
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            trip = _TRIPS.get(eqn.primitive)
            came_from = ins[0][1] if trip else None
            if eqn.primitive in _CALLS:
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                outs = run(inner.jaxpr, inner.consts, ins)
            elif (
                came_from
                and came_from[0] == trip
                and (came_from[1][0].dtype == eqn.outvars[0].aval.dtype)
            ):
                outs = [came_from[1]]  # the way back: the value from before the way out
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                outs = eqn.primitive.bind(*[x for x, _ in ins], **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
                narrowed = trip == "convert" and _narrower(outs[0].dtype, ins[0][0].dtype)
                made = (trip, ins[0]) if narrowed or trip == "bitcast" else None
                outs = [(x, made) for x in outs]
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def rewritten(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = run(closed.jaxpr, closed.consts, [(x, None) for x in jax.tree.leaves(args)])
        return jax.tree.unflatten(jax.tree.structure(shapes), [x for x, _ in outs])

    return rewritten


def _narrower(a, b) -> bool:
    floats = jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)
    return floats and jnp.finfo(a).bits < jnp.finfo(b).bits


COMPILERS = {"jit": lambda f: f, "jit-dropping-round-trips": drop_round_trips}


# ----------------------------------------------------------------- a GPU where there is none

CPU = attention.Backend("cpu")
H100 = attention.Backend("gpu", (9, 0), cudnn=True)
A100 = attention.Backend("gpu", (8, 0), cudnn=True)
V100 = attention.Backend("gpu", (7, 0), cudnn=True)
H100_WITHOUT_CUDNN = attention.Backend("gpu", (9, 0), cudnn=False)
TPU = attention.Backend("tpu")
BACKEND_NAMES = {CPU: "cpu", H100: "h100", A100: "a100", V100: "v100", TPU: "tpu"}
BACKEND_NAMES[H100_WITHOUT_CUDNN] = "h100-without-cudnn"


def pretend_gpu(monkeypatch, backend=H100):
    """Makes the attention choice (host-side) see `backend` as this machine."""
    monkeypatch.setattr(attention, "local_backend", lambda: backend)


def cudnn_as_xla(monkeypatch):
    """Runs the models' own `jax.nn.dot_product_attention(..., implementation="cudnn")` call
    with implementation="xla" instead: the same arguments under jax's reference semantics of
    cuDNN's kernel, on any backend. Returns the list of implementations the models asked for."""
    asked, original = [], jax.nn.dot_product_attention

    def reference(*args, implementation=None, **kwargs):
        asked.append(implementation)
        return original(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", reference)
    return asked


def checkpoint_steps_on_disk(workdir) -> list[int]:
    """The steps of `<workdir>/checkpoints/<step>` folders, read without orbax (opening a
    Checkpointer would delete the leftovers of an interrupted save that a test looks for)."""
    folder = Path(workdir) / "checkpoints"
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if folder.is_dir() else []


# ---- fine-tuning an HF Llama folder (init_from, export, tokenized text) ---------------------
FIXTURE = ROOT / "tests" / "hf" / "fixture"  # a tiny random Llama made by transformers
STEPS = 20  # the fine-tune runs' length
EOT = "<|endoftext|>"


def make_tokenizer(folder: Path, texts: list[str], vocab_size: int = 290, specials=()) -> Path:
    """A byte-level BPE `tokenizer.json` (with its `tokenizer_config.json`) trained on `texts`:
    every text encodes, and the vocabulary fits the fixture's 300. `specials`: more special
    tokens (a chat template's markers), each one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT}) + "\n")
    return folder / "tokenizer.json"


def make_text(folder: Path) -> str:
    """A few documents of this repository's prose, as a user's folder of notes; their glob."""
    folder.mkdir(parents=True, exist_ok=True)
    for page in ("README.md", "docs/precision.md", "docs/loss-scaling.md"):
        (folder / Path(page).name).write_text((ROOT / page).read_text())
    return str(folder / "*.md")


def overrides(text: str, cache: Path, steps: int = STEPS, more: dict | None = None) -> list:
    """The `--config.` flags of the runs here: short and small, the text and its cache."""
    keys = {
        "num_train_steps": steps,
        "batch_size": 2,
        "data.seq_len": 32,
        "data.files": text,
        "data.cache_dir": str(cache),
        "checkpoint_every_steps": 10,
        "eval_every_steps": steps,
        "log_every_steps": 10,
        "eval_steps": 1,
    } | (more or {})
    return [f"--config.{key}={value}" for key, value in keys.items()]


def hf_flag(folder) -> str:
    return f"--config={ROOT / 'configs' / 'llama3.py'}:hf={folder}"


def hub_cache(
    cache: Path, repo: str, folder: Path, names: tuple[str, ...] = (), kind: str = "model"
) -> Path:
    """`folder`'s files (those `names`, or all, in its sub-folders too) as `huggingface_hub`
    caches a download of the `kind` repository `repo` in `cache` (its HF_HUB_CACHE): each file
    a blob named by its sha256, the snapshot of a commit links to them, `refs/main` names the
    commit. Returns the snapshot."""
    import hashlib

    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for file in sorted(folder.rglob("*")):
        if file.is_file() and (not names or file.name in names):
            blob = hashlib.sha256(file.read_bytes()).hexdigest()
            (root / "blobs" / blob).write_bytes(file.read_bytes())
            link = snapshot / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            depth = len(file.relative_to(folder).parts) + 1  # up to the repository's folder
            link.symlink_to(Path(*[".."] * depth, "blobs", blob))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snapshot


def offline_hub(monkeypatch, cache: Path) -> None:
    """This process's `huggingface_hub` reads the cache `cache` and downloads nothing (as
    HF_HUB_CACHE and HF_HUB_OFFLINE=1 would have set it at its import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# ---- the small Llama the model tests share (one init program, one forward program) ----------

LLAMA_SCALING = (4.0, 1.0, 4.0, 32)  # original context 32: positions 32..47 lie past it


def llama_config(**overrides):
    """`config.model` of the model tests' Llama: 2 layers of width 64, 4 query heads over 1 kv
    head of 16, Llama 3's RoPE scaling over an original context of 32, materialised attention."""
    import ml_collections

    return ml_collections.ConfigDict(
        {
            "name": "llama", "vocab_size": 64, "d_model": 64, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 1, "head_dim": 16, "d_ff": 96, "max_len": 64,
            "rope_theta": 10_000.0, "rope_scaling": LLAMA_SCALING, "norm_eps": 1e-5,
            "tie_embeddings": False, "attention": "materialized", "scan_layers": True,
            "remat": "none", **overrides,
        }
    )  # fmt: skip


TIMINGS = ("step_time", "steps_per_sec", "_per_s", "goodput", "tflops", "mfu")


def history_without_timings(workdir) -> list[dict]:
    """The rows of a run's history.jsonl without the keys that time the run: what two runs
    that trained the same must share."""
    rows = [json.loads(x) for x in (Path(workdir) / "history.jsonl").read_text().splitlines() if x]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMINGS)} for r in rows]


def step0(config, workdir):
    """The state a run of `config` in `workdir` starts from (as `Trainer.setup` makes it,
    without compiling the step), and its trainer."""
    from mptrain.train import checkpoint, init_from
    from mptrain.train import trainer as trainer_lib

    trainer = trainer_lib.Trainer(config, workdir)
    train, _ = trainer.build_datasets()
    pretrained = init_from.read(trainer, train)
    state = trainer.init_state(train.get_batch(0))
    with checkpoint.Checkpointer(Path(workdir) / "checkpoints") as checkpointer:
        state, step, _ = init_from.resume(checkpointer, state, trainer.policy, config, pretrained)
    assert step is None
    return state, trainer


def packed_and_alone(model, params, tokens, weights):
    """Three examples of a third of `tokens` (`[1, 3n]`) packed into one row (positions from 0
    in each, their segment ids) and the same three as rows of their own: `[(logits, grads)]`
    of each, the grads of the logits' sum against `weights`, as `[1, 3n, V]` logits both;
    one compiled program."""
    n = tokens.shape[1] // 3
    segment_ids = jnp.asarray([np.repeat(np.arange(1, 4), n)])
    positions = jnp.asarray([np.tile(np.arange(n), 3)])

    def packed(p):
        out = model.apply({"params": p}, tokens, positions=positions, segment_ids=segment_ids)
        return out, jnp.sum(out * weights)

    def alone(p):  # the three examples as a batch of three rows of their own
        out = model.apply({"params": p}, tokens.reshape(3, n)).reshape(1, 3 * n, -1)
        return out, jnp.sum(out * weights)

    def both(p):
        return [(f(p)[0], jax.grad(lambda q, f=f: f(q)[1])(p)) for f in (packed, alone)]

    return jax.jit(both)(params)


def kill_9_and_resume(
    command, straight: Path, crashed: Path, at_step: int, devices: int = 1
) -> bytes:
    """Runs `command(straight)` (a CLI command line for that workdir) to its end on `devices`
    fake CPU devices; starts `command(crashed)`, kills it with SIGKILL once its checkpoint
    `at_step` is down, and runs it again to its end, which must resume. Returns that run's
    stderr."""
    env = fake_cpu_env(devices)
    done = subprocess.run(command(straight), cwd=ROOT, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(command(crashed), cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (crashed / "checkpoints" / str(at_step)).exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before its kill: give it more steps"
    again = subprocess.run(command(crashed), cwd=ROOT, env=env, capture_output=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert b"resuming from step" in again.stderr
    return again.stderr
