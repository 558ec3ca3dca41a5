"""The GPU check: one command that measures mptrain on the accelerator it is for, part by part.

A GPU is lent to this project now and then, for about 15 minutes in all, so the measurement is
prepared here and run there in one call. Each part runs in a process of its own under its own
time limit, and writes one JSON line per result to `<out>/gpu_check.jsonl` as it finishes, so a
run cut short still returns what it measured; a table of them ends the run, and
`<out>/gpu_check.json` holds them all. The parts that check numbers go first, then the ones
that time; parts past `--budget` are lines saying so.

  k      the fused attention kernels against the materialised path (scripts/gpu_kernels.py):
         cuDNN's split-sequence attention over a context axis of 2 and 4, gpt-oss's sinks
         through cuDNN, cuDNN's packed layout; outputs and gradients, bf16 and fp32
  m      a mixture of experts' grouped matmul (one Qwen3-30B-A3B expert layer's gate, 16,384
         token copies over 128 experts) by JAX's Mosaic GPU kernels against XLA's ragged_dot
         and against fp32: the forward and both gradients' differences, and the ms of each
  p      packed SFT rows: logits by cuDNN's packed layout against the materialised path's and
         each example's alone; real tokens/s packed against unpacked at a 1B's widths
  r      the RL mismatch table: GRPO rollouts in fp32, bf16 and fp16 against the trainer's
         log-probabilities (scripts/bench_grpo.py --part=mismatch)
  a      configs/lm_gpt2s.py, bf16-mixed against fp32, the Trainer's own loop, blocks of steps
         alternated in one process (median ms a step over the timed blocks)
  torch  the PyTorch peer on the same shape (AMP bf16 + torch.compile + flash attention;
         `torch_peer.py` of the carried folder, where torch sees a GPU)
  d      fp8-mixed against bf16-mixed on the scanned 1B
  b      configs/llama3.py:1b at its docstring's batch: tokens/s and MFU as the run's record
         writes them, peak device memory against the plan's figure (`--plans`) and against the
         device's own compile of the same step; a few steps traced for part e
  e      `mptrain.profile` on part b's trace: the kernel table
  s      the KV-cache sampler on the 1B: ms a token against the decode plan's floor
  l      LoRA on the 8B (`8b_lora`) in a 24 GB card's share of the GPU: peak against the plan
  c      the 8B full fine-tune that `--fit` found for one H100 (docs/make-it-fit.md), random
         init: peak memory against the plan's, tokens/s, MFU
  f      the loop's own cost where steps are short (scripts/bench.py, tiny and default LM):
         the Trainer's loop, its compiled step in a bare loop, and the same model written by
         hand in flax + optax, alternated
  a2     part a's bf16-mixed step with `config.deterministic=False` (XLA's fastest kernels)

    python scripts/gpu_check.py --dry-run                 # here: every part at tiny sizes
    python scripts/gpu_check.py --dry-run --together      # the same in one process (faster)
    python scripts/gpu_check.py --make-plans=h100         # here: the plans the parts read
    bash .gpu/run.sh python3 scripts/gpu_check.py --out=$OUT --budget=480   # on the GPU

`--dry-run` runs every part on this CPU at test sizes (tests/gpu_check_test.py runs it), so the
script cannot rot between the rare times a GPU is here. `--make-plans=TARGET` writes the plans
(`python -m mptrain.plan --json`) that parts b, c, l and s hold their figures against into
`--plans` (`.gpu/plans`, which travels with `.gpu`), for the kind `device`'s status names. The
parent process never imports JAX (it would take 75% of the GPU's memory from the parts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("k", "m", "p", "r", "a", "torch", "d", "b", "e", "s", "l", "c", "f", "a2")
# Seconds each part may take on the GPU, and here with --dry-run.
# On an H200 (2026-11-27) the parts took a 106 s, torch 64, b 39, e 1, c 54, f 41, a2 39; d ran
# past 121 s (two compiles of the unscanned 1B; it is scanned now). k, m, p, r, s and l have not
# run on a GPU: their limits are guesses from their compiles here.
LIMITS = {"k": 60, "m": 60, "p": 120, "r": 60, "a": 160, "torch": 100, "d": 150, "b": 90}
LIMITS |= {"e": 40, "s": 60, "l": 120, "c": 150, "f": 80, "a2": 60}
DRY_LIMITS = dict.fromkeys(ORDER, 120)
# The plans the parts read (`--make-plans`): file name -> `python -m mptrain.plan` arguments.
PLANS = {
    "llama3_1b": ["--config=configs/llama3.py:1b"],
    "llama3_8b_fit": ["--config=configs/llama3.py:8b"],  # and FIT_8B's overrides
    "llama3_8b_lora": ["--config=configs/llama3.py:8b_lora"],
    "llama3_1b_decode": ["--config=configs/llama3.py:1b", "--decode", "--batch=1",
                         "--context=384"],  # part s: 128 prompt tokens and 256 new ones
}  # fmt: skip
PLANS_DRY = {  # --dry-run's: the tiny Llama the dry parts b and s run, so that reading is tested
    "llama3_1b": ["--config=configs/llama3.py:tiny"],
    "llama3_1b_decode": ["--config=configs/llama3.py:tiny", "--decode", "--batch=1",
                         "--context=32"],
}  # fmt: skip
# Part l's share of the GPU: an RTX 4090's memory (mptrain/targets/rtx4090.toml) times the
# share configs/llama3.py:8b_lora takes of it (memory_fraction)
RTX4090_BYTES, LORA_SHARE = 25_757_220_864, 0.85
# The 8B's overrides that `python -m mptrain.plan --config=configs/llama3.py:8b --target=h100
# --devices=1 --fit --config.batch_size=8 --config.data.seq_len=4096` prints.
FIT_8B = {
    "batch_size": 8,
    "data.seq_len": 4096,
    "mesh.data": -1,
    "mesh.fsdp": 1,
    "optimizer.mu_dtype": "q8",
    "optimizer.nu_dtype": "q8",
    "precision": "bf16-pure",
    "param_rounding": "stochastic",
    "model.remat": "full",
}
GIB = 2**30


# ---------------------------------------------------------------------------- the parts' side


def _emit(out: Path, record: dict) -> None:
    """One result: a line of `<out>/gpu_check.jsonl`, written at once, and printed."""
    line = json.dumps(record, default=float)
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(line + "\n")
    print("RESULT " + line, flush=True)


def _config(spec: str, **overrides):
    from mptrain import config as config_lib

    path, _, arg = spec.partition(":")
    config = runpy.run_path(str(ROOT / path))["get_config"](arg or None)
    return config_lib.override(config, overrides)


def _interleaved(*args):
    """scripts/bench_overhead.py's blocks of two Trainers' own loops, alternated."""
    return runpy.run_path(str(ROOT / "scripts/bench_overhead.py"))["interleaved"](*args)


def _device() -> dict:
    import jax

    d = jax.devices()[0]
    return {"device": d.device_kind, "platform": d.platform, "jax": jax.__version__}


def _memory() -> dict:
    """The first device's peak and current bytes in use, GiB (None where the backend keeps no
    statistics, as XLA:CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    peak, now = stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")
    return {
        "peak_gib": peak / GIB if peak else None,
        "in_use_gib": now / GIB if now else None,
        "limit_gib": stats["bytes_limit"] / GIB if stats.get("bytes_limit") else None,
    }


def _compiled_gib(compiled) -> float:
    """The plan's total (`plan.step.device_bytes`) from the device's own compile of the step."""
    from mptrain.plan import step as plan_step

    return plan_step.device_bytes(compiled.memory_analysis()) / GIB


def _train(config, workdir: str, steps: int, log_every: int, trace=None) -> dict:
    """The Trainer's own set-up and loop for `steps` steps, with no evaluation or checkpoint
    (they are at step 10**9); `trace=(first, count)` traces those steps with config.profile.
    Returns the record's last speed row, the memory and the compiled step's own figure."""
    import jax

    from mptrain import runtime
    from mptrain.train import trainer as trainer_lib

    config = config.copy_and_resolve_references()
    config.num_train_steps = config.eval_every_steps = config.checkpoint_every_steps = 10**9
    config.log_every_steps, config.eval_steps = log_every, 1
    if trace:
        config.profile.start_step, config.profile.num_steps = trace
    trainer = trainer_lib.Trainer(config, workdir)
    started = time.monotonic()
    with runtime.PreemptionFlag() as flag, trainer.setup(*trainer.build_datasets()) as run:
        setup_s = time.monotonic() - started
        config.num_train_steps = steps
        trainer.train(run, flag)
        jax.block_until_ready(run.state)
        compiled = _compiled_gib(run.train_step)
    rows = [json.loads(line) for line in Path(workdir, "history.jsonl").read_text().splitlines()]
    speed = [r for r in rows if r.get("tokens_per_s") is not None]
    last = speed[-1] if speed else {}
    keep = ("step", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "loss")
    return {
        "setup_s": setup_s,
        **{k: last.get(k) for k in keep},
        **_memory(),
        "compiled_gib": compiled,
    }


def _plan_gib(plans: Path, name: str) -> dict:
    """The carried plan's figure (`python -m mptrain.plan --json`), if there is one."""
    path = plans / f"{name}.json"
    if not plans.name or not path.exists():
        return {"plan_gib": None}
    plan = json.loads(path.read_text())
    return {
        "plan_gib": plan["memory"]["total"] / GIB,
        "plan_target": plan["target"],
        "plan_jax": plan.get("jax_version"),
        "plan_floor_ms": 1e3 * plan["floor"]["floor_s"] if plan.get("floor") else None,
    }


def _versus(result: dict) -> dict:
    """Measured peak over the plan's and over the device's own compile (1.0: as planned)."""
    peak = result.get("peak_gib")
    out = {}
    if peak and result.get("plan_gib"):
        out["peak_over_plan"] = peak / result["plan_gib"]
    if peak and result.get("compiled_gib"):
        out["peak_over_compiled"] = peak / result["compiled_gib"]
    return out


def part_a(args, out: Path) -> None:
    spec = "configs/lm_gpt2s.py:tiny" if args.dry_run else "configs/lm_gpt2s.py"
    bf16 = _config(spec, precision="bf16-mixed")
    fp32 = _config(spec, precision="fp32")
    # blocks of 20 steps, as the PyTorch peer's: each block ends with a log step's read and write
    blocks, block_steps = (2, 2) if args.dry_run else (4, 20)
    rows = _interleaved(bf16, fp32, blocks, block_steps)  # "mptrain" = bf16, "hand" = fp32
    bf16_ms = statistics.median(r["mptrain_ms"] for r in rows)
    fp32_ms = statistics.median(r["hand_ms"] for r in rows)
    tokens = bf16.batch_size * bf16.data.seq_len
    _emit(
        out,
        {
            "part": "a",
            "case": f"{spec} bf16-mixed vs fp32 (matmul_precision auto: highest)",
            **_device(),
            "bf16_ms": bf16_ms,
            "fp32_ms": fp32_ms,
            "fp32_over_bf16": fp32_ms / bf16_ms,
            "bf16_tokens_per_s": 1e3 * tokens / bf16_ms,
            "blocks": rows,
            "steps": f"{block_steps}..{block_steps * (blocks + 1)} of each, alternated",
        },
    )


def part_a2(args, out: Path) -> None:
    """bf16-mixed gpt2s with XLA's nondeterministic (atomic) kernels: what determinism costs."""
    spec = "configs/lm_gpt2s.py:tiny" if args.dry_run else "configs/lm_gpt2s.py"
    config = _config(spec, precision="bf16-mixed", deterministic=False)
    steps, log_every = (6, 3) if args.dry_run else (40, 10)
    with tempfile.TemporaryDirectory(prefix="gpu_check_a2_") as workdir:
        result = _train(config, workdir, steps, log_every)
    ms = 1e3 * result["step_time_s"] if result.get("step_time_s") else None
    _emit(
        out,
        {
            "part": "a2",
            "case": f"{spec} bf16-mixed deterministic=False",
            **_device(),
            "bf16_ms": ms,
            **result,
        },
    )


def part_torch(args, out: Path) -> None:
    script = next(
        (
            p
            for p in (ROOT / ".gpu/torch_peer.py", ROOT.parent / "shared/gpu/torch_peer.py")
            if p.exists()
        ),
        None,
    )
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if script is None or not cuda or args.dry_run:
        why = "no torch_peer.py" if script is None else "torch sees no CUDA GPU"
        _emit(out, {"part": "torch", "skipped": "dry run" if args.dry_run else why})
        return
    env = dict(os.environ, MPTRAIN_LOGS=str(out))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    for line in proc.stdout:  # the peer prints one JSON line a mode as it finishes
        print(line, end="", flush=True)
        mode, _, rest = line.partition(" ")
        if mode in ("bf16-autocast", "fp32-tf32") and rest.startswith("{"):
            row = json.loads(rest)
            _emit(
                out,
                {
                    "part": "torch",
                    "case": f"gpt2s torch {mode}",
                    "torch": torch.__version__,
                    "ms": row["ms"],
                    "compile_s": row["compile_s"],
                    "peak_gib": row["peak_gib"],
                    "blocks": row["blocks"],
                },
            )
    proc.wait()


def part_b(args, out: Path) -> None:
    spec = "configs/llama3.py:tiny" if args.dry_run else "configs/llama3.py:1b"
    config = _config(spec)
    steps, log_every, trace = (8, 4, (6, 2)) if args.dry_run else (14, 5, (12, 2))
    workdir = Path(args.workdirs, "b")
    shutil.rmtree(workdir, ignore_errors=True)
    result = _train(config, str(workdir), steps, log_every, trace)
    for trace_file in sorted(workdir.glob("plugins/profile/*/*.trace.json.gz"))[-1:]:
        if not args.dry_run:  # back with the results, for a reading of the kernels later
            shutil.copy(trace_file, out / "trace_b.trace.json.gz")
    result |= _plan_gib(Path(args.plans), "llama3_1b")
    _emit(
        out,
        {
            "part": "b",
            "case": f"{spec} batch {config.batch_size} x {config.data.seq_len}",
            **_device(),
            **result,
            **_versus(result),
        },
    )


def part_e(args, out: Path) -> None:
    from mptrain.record import profile

    found = profile.table(Path(args.workdirs, "b"), top=12)
    text = profile.render(found)
    print(text, flush=True)
    _emit(out, {"part": "e", "case": "mptrain.profile of part b's trace", "table": text})


def _against_plan(args, out: Path, part: str, case: str, config, plan: str) -> None:
    """A few steps of `config` by the Trainer's own loop, in the share of the GPU's memory the
    parent set: tokens/s, MFU, peak memory against the carried plan `plan`'s."""
    steps, log_every = (4, 2) if args.dry_run else (6, 3)
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{part}_") as workdir:
        result = _train(config, workdir, steps, log_every)
    result |= _plan_gib(Path(args.plans), plan)
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset (0.75)")
    record = {"part": part, "case": case, **_device(), "mem_fraction": fraction, **result}
    _emit(out, {**record, **_versus(result)})


def part_c(args, out: Path) -> None:
    spec = "configs/llama3.py:tiny" if args.dry_run else "configs/llama3.py:8b"
    config = _config(spec, **FIT_8B)
    if args.dry_run:
        config.batch_size, config.data.seq_len = 4, 128
    _against_plan(args, out, "c", f"{spec} with --fit's overrides for one H100", config,
                  "llama3_8b_fit")  # fmt: skip


def part_f(args, out: Path) -> None:
    """scripts/bench.py's three sides, alternated: the Trainer's loop, its compiled step in a
    bare Python loop, and the hand-written flax + optax step. loop/bare is the loop's own cost,
    bare/hand the step's (the skip check, the log totals)."""
    bench = runpy.run_path(str(ROOT / "scripts/bench.py"))
    for size in ("tiny",) if args.dry_run else ("tiny", "full"):
        path = out / f"bench_{size}.json"
        blocks, steps = ("2", "3") if args.dry_run else ("20", "40" if size == "tiny" else "20")
        bench["main"]([f"--size={size}", "--models=lm", "--cases=bf16-mixed", f"--out={path}",
                       f"--blocks={blocks}", f"--block_steps={steps}"])  # fmt: skip
        row = json.loads(path.read_text())["rows"][0]
        path.unlink()
        keep = ("loop_ms", "bare_ms", "hand_ms", "loop_over_hand", "bare_over_hand")
        _emit(out, {"part": "f", "case": f"configs/default.py ({size}) bf16-mixed: loop, bare, "
                    "hand", **_device(), **{k: row[k] for k in keep},
                    "loop_over_bare": 1 / row["loop_steps_per_s_over_bare"]})  # fmt: skip


def part_d(args, out: Path) -> None:
    """fp8-mixed (current scaling) against bf16-mixed on the scanned 1B, blocks alternated."""
    spec = "configs/llama3.py:tiny" if args.dry_run else "configs/llama3.py:1b"
    common = {"batch_size": 8 if args.dry_run else 4}  # dry: part b's batch, so its program
    fp8 = _config(spec, precision="fp8-mixed", **{"fp8.scaling": "current"}, **common)
    bf16 = _config(spec, precision="bf16-mixed", **common)
    blocks, block_steps = (2, 2) if args.dry_run else (4, 4)
    rows = _interleaved(fp8, bf16, blocks, block_steps)  # "mptrain" = fp8, "hand" = bf16
    fp8_ms = statistics.median(r["mptrain_ms"] for r in rows)
    bf16_ms = statistics.median(r["hand_ms"] for r in rows)
    _emit(
        out,
        {
            "part": "d",
            "case": f"{spec} scanned, batch {bf16.batch_size}: fp8-mixed "
            "(current scaling) vs bf16-mixed",
            **_device(),
            "fp8_ms": fp8_ms,
            "bf16_ms": bf16_ms,
            "bf16_over_fp8": bf16_ms / fp8_ms,
            "blocks": rows,
        },
    )


@functools.cache
def _kernels() -> dict:
    """scripts/gpu_kernels.py's functions: its cases, and `error` (the largest difference over
    the reference's largest value), which every part that compares numbers reads."""
    return runpy.run_path(str(ROOT / "scripts/gpu_kernels.py"))


def part_k(args, out: Path) -> None:
    """scripts/gpu_kernels.py: cuDNN's split-sequence attention, sinks and packed layout against
    the materialised path (with --dry-run, the stand-ins the CPU tests run)."""
    for row in _kernels()["check"](stand_ins=args.dry_run, small=args.dry_run):
        _emit(out, {"part": "k", **row, **_device()})


def part_m(args, out: Path) -> None:
    """The Mosaic kernels' custom VJP (`decoder.grouped`) against `jax.lax.ragged_dot` on the
    same bf16 operands, and both against ragged_dot's fp32 on the same values (bf16's own
    error); with --dry-run, at test sizes, with the kernels' XLA stand-ins."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mptrain.models.decoder import grouped

    rows, width, hidden, experts = (256, 128, 128, 8) if args.dry_run else (16384, 2048, 768, 128)
    kernel = "reference" if args.dry_run else "mosaic_gpu"
    sms = getattr(jax.devices()[0], "core_count", 0) or 0
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(rows, np.ones(experts) / experts), jnp.int32)
    x = jnp.asarray(rng.normal(size=(rows, width)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(experts, width, hidden)) / width**0.5, jnp.bfloat16)
    probe = jnp.asarray(rng.normal(size=(rows, hidden)), jnp.float32)

    def step(name):
        loss = lambda x, w: jnp.sum(
            grouped.matmul(x, w, sizes, name, sms).astype(jnp.float32) * probe
        )
        return jax.jit(jax.value_and_grad(loss, (0, 1)))

    runs = {name: step(name) for name in (kernel, "xla")}
    results = {name: jax.block_until_ready(run(x, w)) for name, run in runs.items()}
    exact = runs["xla"](x.astype(jnp.float32), w.astype(jnp.float32))
    times = {name: [] for name in runs}
    for _ in range(3 if args.dry_run else 10):
        for name, run in runs.items():
            started = time.perf_counter()
            jax.block_until_ready(run(x, w))
            times[name].append(1e3 * (time.perf_counter() - started))
    leaves = lambda r: jax.tree.leaves(r)
    error = _kernels()["error"]
    errors = lambda got, want: dict(
        zip(("loss", "dx", "dw"), map(error, leaves(got), leaves(want)), strict=True)
    )
    bf16_vs_fp32 = errors(results[kernel], exact)
    band = errors(results["xla"], exact)
    _emit(
        out,
        {
            "part": "m",
            "case": f"grouped matmul {rows} x {width} by {experts} x [{width}, {hidden}]: "
            f"{kernel} vs xla ragged_dot, forward and gradients",
            **_device(),
            "errors": errors(results[kernel], results["xla"]),
            "errors_vs_fp32": bf16_vs_fp32,
            "band": band,  # XLA's bf16 against its fp32: what bf16 costs either way
            "within": max(bf16_vs_fp32.values()) <= max(2 * max(band.values()), 1e-2),
            "kernel_ms": statistics.median(times[kernel]),
            "xla_ms": statistics.median(times["xla"]),
        },
    )


def _logits(config, batch: dict, params=None):
    """The model of `config` on `batch` (its params: `params`, or a fresh init): fp32 logits,
    the matmuls and params in the config's precision, as the step computes them."""
    import jax
    import jax.numpy as jnp

    from mptrain import config as config_lib
    from mptrain import models

    policy = config_lib.policy_of(config)
    model = models.create(config.model, policy)
    if params is None:
        params = jax.jit(model.init)(jax.random.key(0), batch["inputs"])["params"]

    @jax.jit
    def run(params, batch):
        inputs = batch.pop("inputs")
        with policy.matmuls():
            out = model.apply({"params": policy.cast_params(params)}, inputs, **batch)
        return out.astype(jnp.float32)

    return run(params, dict(batch)), params


def part_p(args, out: Path) -> None:
    """Packed SFT rows: `configs/llama3.py:sft_tiny`'s Llama on two packed rows, its logits by
    cuDNN's packed layout (bf16-mixed) against the materialised path's in fp32, and the
    materialised path's against each example alone (fp32: the mask's meaning); within: the
    kernel's error at most twice the materialised path's own in bf16-mixed (or 1%), the mask's
    1e-5. Then real tokens a second packed against unpacked (`scripts/bench_sft.py`) at a 1B's
    widths, batch 4 (both sides' states in one process)."""
    import jax.numpy as jnp
    import numpy as np

    from mptrain.models import segments

    length, pieces = 512, [(128, 128, 128), (128, 128, 128, 128)]  # padding last in row 0
    ids = np.zeros((2, length), np.int32)
    positions = np.zeros((2, length), np.int32)
    for r, row in enumerate(pieces):
        ids[r, : sum(row)] = np.repeat(np.arange(1, len(row) + 1), row)
        positions[r, : sum(row)] = np.concatenate([np.arange(n) for n in row])
    tokens = np.random.default_rng(0).integers(0, 260, (2, length)).astype(np.int32)
    batch = {
        "inputs": jnp.asarray(tokens),
        "positions": jnp.asarray(positions),
        "segment_ids": jnp.asarray(ids),
        "segment_lengths": segments.segment_lengths(jnp.asarray(ids), 8),
    }
    spec = "configs/llama3.py:sft_tiny"
    fp32 = _config(spec, precision="fp32", **{"model.attention": "materialized"})
    want, params = _logits(fp32, batch)
    kernel = "materialized" if args.dry_run else "cudnn"
    bf16 = _config(spec, precision="bf16-mixed", **{"model.attention": kernel})
    got, _ = _logits(bf16, batch, params)
    band = got  # the materialised path's own bf16-mixed logits (the dry run's kernel)
    if kernel != "materialized":
        materialised = _config(spec, precision="bf16-mixed", **{"model.attention": "materialized"})
        band, _ = _logits(materialised, batch, params)
    alone = []
    for r, row in enumerate(pieces):
        at = 0
        for n in row:
            one = {"inputs": batch["inputs"][r : r + 1, at : at + n]}
            alone.append((r, at, n, _logits(fp32, one, params)[0][0]))
            at += n
    real = ids > 0
    scale = float(np.max(np.abs(np.asarray(want)[real])))
    error = lambda a, b: _kernels()["error"](np.asarray(a)[real], np.asarray(b)[real])
    apart = (
        max(
            float(np.max(np.abs(np.asarray(want)[r, at : at + n] - np.asarray(x))))
            for r, at, n, x in alone
        )
        / scale
    )
    kernel_error, bf16_error = error(got, want), error(band, want)
    _emit(
        out,
        {
            "part": "p",
            "case": f"{spec} logits on packed rows: {kernel} bf16-mixed vs materialised fp32",
            **_device(),
            "logits_error": kernel_error,
            "band": bf16_error,  # the materialised path's own bf16-mixed error
            "fp32_vs_alone": apart,
            "within": kernel_error <= max(2 * bf16_error, 1e-2) and apart <= 1e-5,
        },
    )
    bench = runpy.run_path(str(ROOT / "scripts/bench_sft.py"))
    path = out / "bench_sft.json"
    if args.dry_run:
        argv = ["--blocks=1", "--block_steps=2", "--seq_len=256", "--set=batch_size=8"]
    else:  # a 1B's widths on rows of 4,096
        widths = {"d_model": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
                  "d_ff": 8192, "max_len": 4096, "remat": "minimal"}  # fmt: skip
        argv = ["--blocks=3", "--block_steps=5", "--seq_len=4096"]
        argv += [f"--set=model.{k}={v}" for k, v in widths.items()]
        argv += ["--set=batch_size=4", "--set=model.attention=cudnn", "--set=precision=bf16-mixed"]
    result = bench["main"]([*argv, f"--out={path}"])
    path.unlink()
    first = result["blocks"][0]
    _emit(
        out,
        {
            "part": "p",
            "case": f"packed vs unpacked SFT rows, {result['batch_size']} x {result['seq_len']}",
            **_device(),
            "overrides": result["overrides"],
            "packed_ms": statistics.median(r["packed_ms"] for r in result["blocks"]),
            "unpacked_ms": statistics.median(r["unpacked_ms"] for r in result["blocks"]),
            "packed_real_share": first["packed_real_share"],
            "unpacked_real_share": first["unpacked_real_share"],
            "real_tokens_ratio": result["median_ratio"],
            "blocks": result["blocks"],
        },
    )


def part_r(args, out: Path) -> None:
    """The RL mismatch table (scripts/bench_grpo.py --part=mismatch): each sampled token's
    log-probability against the trainer's, rollouts in fp32, bf16 and fp16 (with --dry-run,
    bf16 alone)."""
    bench = runpy.run_path(str(ROOT / "scripts/bench_grpo.py"))
    precisions = ("bf16-mixed",) if args.dry_run else bench["PRECISIONS"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_r_") as workdir:
        found = bench["mismatch"](Path(workdir), precisions)
    for precision, ways in found.items():
        _emit(out, {"part": "r", "case": f"GRPO rollouts in {precision} against the trainer",
                    **_device(), "precision": precision, **ways})  # fmt: skip


def part_s(args, out: Path) -> None:
    """The KV-cache sampler (`decoder.decode.make_decoder`) on the 1B, random weights in bf16,
    one row, greedy, no stop token: ms a token (the prompt's prefill included, 1 of 257
    forward passes) against the decode plan's floor (the weights and cache read once)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mptrain import config as config_lib
    from mptrain import models
    from mptrain.models.decoder import decode

    spec = "configs/llama3.py:tiny" if args.dry_run else "configs/llama3.py:1b"
    config = _config(spec)
    prompt_len, new = (16, 16) if args.dry_run else (128, 256)
    policy = config_lib.policy_of(config)
    model = models.create(config.model, policy)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.device_put(policy.cast_params(params))
    prompts = np.random.default_rng(0).integers(0, 256, (1, prompt_len)).astype(np.int32)
    lengths = np.full((1,), prompt_len, np.int32)
    decoder = decode.make_decoder(model, new)
    args_ = (params, prompts, lengths, decode.Sampling().values(), 0, decode.stops([]))
    started = time.perf_counter()
    tokens = jax.block_until_ready(decoder(*args_))
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(3 if args.dry_run else 5):
        started = time.perf_counter()
        jax.block_until_ready(decoder(*args_))
        times.append(1e3 * (time.perf_counter() - started) / new)
    plan = {}
    path = Path(args.plans, "llama3_1b_decode.json") if args.plans else None
    if path and path.exists():
        found = json.loads(path.read_text())
        plan = {"plan_ms_floor": found["ms_floor"], "plan_ms_moved": found["ms_moved"],
                "plan_target": found["target"], "plan_context": found["context"]}  # fmt: skip
    ms = statistics.median(times)
    _emit(
        out,
        {
            "part": "s",
            "case": f"{spec} sampler, batch 1, {prompt_len} prompt + {new} tokens, greedy",
            **_device(),
            "ms_per_token": ms,
            "tokens": int(np.sum(np.asarray(tokens) >= 0)),
            "compile_s": compile_s,
            **plan,
            "over_floor": ms / plan["plan_ms_floor"] if plan else None,
            **_memory(),
        },
    )


def part_l(args, out: Path) -> None:
    """LoRA on the 8B (`configs/llama3.py:8b_lora`: rank 16 on every projection over a bf16
    base, batch 2 x 2,048, remat `full_offloaded`) in a 24 GB card's share of the GPU (the
    parent sets XLA_PYTHON_CLIENT_MEM_FRACTION to an RTX 4090's memory): peak against the
    plan's, tokens/s."""
    spec = "configs/llama3.py:tiny" if args.dry_run else "configs/llama3.py:8b_lora"
    overrides = {"lora.rank": 4, "lora.alpha": 8.0} if args.dry_run else {}
    config = _config(spec, **overrides)
    _against_plan(args, out, "l", f"{spec} in a 24 GB card's share", config, "llama3_8b_lora")


PARTS = {
    "k": part_k,
    "p": part_p,
    "r": part_r,
    "s": part_s,
    "l": part_l,
    "a": part_a,
    "m": part_m,
    "torch": part_torch,
    "b": part_b,
    "e": part_e,
    "c": part_c,
    "f": part_f,
    "a2": part_a2,
    "d": part_d,
}


# ------------------------------------------------------------------------------ the parent


def _table(records: list[dict]) -> str:
    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    lines = [f"{'part':<6} {'case':<62} result"]
    for r in records:
        part, case = r.get("part", "?"), str(r.get("case", ""))[:62]
        if "skipped" in r or "error" in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"ERROR: {r['error']}"
        elif part == "a":
            what = (
                f"bf16 {fmt(r['bf16_ms'], '.2f')} ms, fp32 {fmt(r['fp32_ms'], '.2f')} ms, "
                f"fp32/bf16 {fmt(r['fp32_over_bf16'], '.2f')}x"
            )
        elif part == "torch":
            what = f"{fmt(r['ms'], '.2f')} ms, peak {fmt(r['peak_gib'], '.2f')} GiB"
        elif part in ("b", "c", "a2", "l"):
            what = (
                f"{fmt(r.get('tokens_per_s'), ',.0f')} tok/s, MFU {fmt(r.get('mfu'), '.3f')}, "
                f"peak {fmt(r.get('peak_gib'), '.2f')} GiB (plan {fmt(r.get('plan_gib'), '.2f')}, "
                f"device compile {fmt(r.get('compiled_gib'), '.2f')})"
            )
        elif part == "e":
            what = "kernel table in gpu_check.jsonl"
        elif part == "f":
            what = (
                f"loop {fmt(r['loop_ms'], '.3f')} ms, loop/bare {fmt(r['loop_over_bare'], '.3f')}"
                f", bare/hand {fmt(r['bare_over_hand'], '.3f')}, loop/hand "
                f"{fmt(r['loop_over_hand'], '.3f')}"
            )
        elif part == "k":
            what = f"{r['dtype']}: largest error {max(r['errors'].values()):.1e}"
            what += f" (bf16 band {max(r['band'].values()):.1e})" if "band" in r else ""
            what += f", tolerance {r['tolerance']:.0e}: " + ("ok" if r["within"] else "OUTSIDE")
        elif part == "m":
            errors = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
            what = f"{errors}; {fmt(r['kernel_ms'], '.2f')} ms vs xla {fmt(r['xla_ms'], '.2f')}"
            what += f"; vs fp32 {max(r['errors_vs_fp32'].values()):.1e}"
            what += f" (xla's {max(r['band'].values()):.1e}) " + (
                "ok" if r["within"] else "OUTSIDE"
            )
        elif part == "p" and "logits_error" in r:
            what = (
                f"error {r['logits_error']:.1e} (bf16 band {r['band']:.1e}), fp32 vs alone "
                f"{r['fp32_vs_alone']:.1e}: " + ("ok" if r["within"] else "OUTSIDE")
            )
        elif part == "p":
            what = (
                f"packed {fmt(r['packed_ms'])} ms, unpacked {fmt(r['unpacked_ms'])} ms; real "
                f"tokens/s x{fmt(r['real_tokens_ratio'], '.2f')}"
            )
        elif part == "r":
            what = ", ".join(
                f"{way} mean {r[way]['mean']:.1e} max {r[way]['max']:.1e}"
                for way in ("update", "batch", "alone")
            )
        elif part == "s":
            what = (
                f"{fmt(r['ms_per_token'], '.3f')} ms a token; plan floor "
                f"{fmt(r.get('plan_ms_floor'), '.3f')} ms (x{fmt(r.get('over_floor'), '.2f')})"
            )
        elif part == "d":
            what = (
                f"fp8 {fmt(r['fp8_ms'], '.1f')} ms, bf16 {fmt(r['bf16_ms'], '.1f')} ms, "
                f"bf16/fp8 {fmt(r['bf16_over_fp8'], '.2f')}x"
            )
        else:
            what = json.dumps(r)[:80]
        lines.append(f"{part:<6} {case:<62} {what}")
    return "\n".join(lines)


def _run_parts(args, out: Path, log) -> list[dict]:
    """Each part in a child process of its own under its limit; with `--together` (a dry run's
    speed: one JAX start-up, not one a part) every part in one child, in turn."""
    limits = DRY_LIMITS if args.dry_run else LIMITS
    began = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    parts = args.parts.split(",")
    for batch in [parts] if args.together else [[part] for part in parts]:
        left = args.budget - (time.monotonic() - began)
        if left < 15:
            for part in batch:
                _emit(out, {"part": part, "skipped": f"the budget of {args.budget} s is spent"})
            continue
        limit = min(sum(limits[part] for part in batch), left)
        plans = args.plans or ("" if args.dry_run else str(ROOT / ".gpu/plans"))
        argv = [
            sys.executable,
            __file__,
            f"--part={','.join(batch)}",
            f"--out={out}",
            f"--workdirs={args.workdirs}",
            f"--plans={plans}",
        ]
        argv += ["--dry-run"] if args.dry_run else []
        part_env = dict(env)
        if batch == ["c"] and args.fit_fraction:
            part_env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.fit_fraction)
        if batch == ["l"] and not args.dry_run and _gpu_bytes():
            share = RTX4090_BYTES * LORA_SHARE / _gpu_bytes()
            part_env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{share:.4f}"
        if batch == ["e"]:
            part_env["JAX_PLATFORMS"] = "cpu"  # it reads a trace: no device needed
        name = ",".join(batch)
        print(f"== part {name} (limit {limit:.0f} s)", flush=True)
        log.write(f"== part {name} (limit {limit:.0f} s)\n")
        log.flush()
        start = time.monotonic()
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=part_env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
            code = "timeout"
        seconds = time.monotonic() - start
        log.flush()
        done = {r.get("part") for r in _records(out)}
        for part in batch:
            if code != 0 and part not in done:
                tail = (out / "gpu_check.log").read_text().splitlines()[-15:]
                why = f"timed out after {limit:.0f} s" if code == "timeout" else f"exit {code}"
                _emit(out, {"part": part, "error": why, "log_tail": tail})
                print("\n".join(tail), flush=True)
        print(f"   part {name}: {seconds:.0f} s, exit {code}", flush=True)
    return _records(out)


def _child(args, out: Path) -> int:
    """The parts of `--part` in turn; where there are several (`--together`), one that raises
    is an error line with its traceback's tail and the rest still run."""
    parts = args.part.split(",")
    if len(parts) == 1:
        PARTS[parts[0]](args, out)
        return 0
    for part in parts:
        print(f"== part {part}", flush=True)
        started = time.monotonic()
        try:
            PARTS[part](args, out)
        except Exception:
            tail = traceback.format_exc().splitlines()[-15:]
            _emit(out, {"part": part, "error": tail[-1], "log_tail": tail})
        print(f"   part {part}: {time.monotonic() - started:.0f} s", flush=True)
    return 0


def _gpu_bytes() -> int | None:
    """The first GPU's memory as nvidia-smi reports it (None without one), read without JAX."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        return int(text.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def make_plans(target: str, folder: Path, dry_run: bool = False) -> int:
    """`PLANS` (`PLANS_DRY`) for one device of `target`, as `python -m mptrain.plan --json`
    writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, argv in (PLANS_DRY if dry_run else PLANS).items():
        if name == "llama3_8b_fit":
            argv = [*argv, *(f"--config.{k}={v}" for k, v in FIT_8B.items())]
        path = folder / f"{name}.json"
        cmd = [sys.executable, "-m", "mptrain.plan", *argv, f"--target={target}", "--devices=1",
               f"--json={path}"]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        seconds = time.monotonic() - started
        ok = path.exists() and proc.returncode in (0, 4)  # 4: planned, does not fit
        failed += not ok
        print(f"{name}: {'written' if ok else 'FAILED'} in {seconds:.0f} s: {' '.join(cmd[1:])}")
        if not ok:
            print(proc.stdout[-2000:] + proc.stderr[-2000:])
    return 1 if failed else 0


def _records(out: Path) -> list[dict]:
    path = out / "gpu_check.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="every part at test sizes, on a CPU")
    p.add_argument("--out", default="runs/gpu_check", help="folder for the JSON lines and log")
    p.add_argument("--parts", default=",".join(ORDER), help=f"in order, of {','.join(ORDER)}")
    p.add_argument("--budget", type=float, default=480, help="seconds for all parts together")
    p.add_argument(
        "--plans", default=None, help="the plans' folder (default .gpu/plans; with --dry-run, none)"
    )
    p.add_argument("--workdirs", default=None, help="the parts' run folders (default: a temp)")
    p.add_argument(
        "--fit_fraction",
        type=float,
        default=None,
        help="part c's XLA_PYTHON_CLIENT_MEM_FRACTION (the plan's share of the GPU)",
    )
    p.add_argument(
        "--make-plans",
        default=None,
        metavar="TARGET",
        help="write the parts' plans for one TARGET device into --plans, and stop",
    )
    p.add_argument(
        "--together",
        action="store_true",
        help="with --dry-run: every part in one process (one JAX start-up)",
    )
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_plans:
        return make_plans(args.make_plans, Path(args.plans or ROOT / ".gpu/plans"), args.dry_run)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(args.parts.split(",")) - set(ORDER)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; known: {','.join(ORDER)}")
    if args.together and not args.dry_run:  # on a GPU each part needs the memory to itself
        p.error("--together: with --dry-run only")
    if args.part:  # a child
        return _child(args, out)
    (out / "gpu_check.jsonl").unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        if args.workdirs is None:
            args.workdirs = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_check_"))
        started = time.monotonic()
        log = stack.enter_context((out / "gpu_check.log").open("w"))
        records = _run_parts(args, out, log)
        total = time.monotonic() - started
    text = _table(records)
    print(f"\n{text}\n\n{len(records)} results in {total:.0f} s; {out / 'gpu_check.jsonl'}")
    summary = {
        "seconds": total,
        "dry_run": args.dry_run,
        "results": records,
        "date": time.strftime("%Y-%m-%d"),
    }
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=float))
    failed = [r["part"] for r in records if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
