"""GRPO's figures: the sampler/trainer mismatch in each precision, mptrain against TRL's
`GRPOTrainer` in steps a second, and `grpo_tiny`'s learning curves (docs/rl.md quotes them).

  python scripts/bench_grpo.py --part=mismatch --out=/tmp/grpo    # about 1 minute
  python scripts/bench_grpo.py --part=speed --trl_python=/tmp/trlvenv/bin/python --out=/tmp/grpo
  python scripts/bench_grpo.py --part=learn --out=/tmp/grpo       # 10 runs: about 10 minutes
  python scripts/bench_grpo.py --part=lora --out=/tmp/grpo        # 6 runs: about 3 minutes

* `mismatch`: the repository's tiny HF folder (`tests/hf/fixture`, its byte tokenizer
  `tests/train/dpo_fixture`), 16 completions of 8 tokens (4 prompts, G 4) sampled at step 0, in
  fp32, bf16-mixed and fp16-mixed. Each sampled token's log-probability is held against the
  trainer's three ways: inside the update (the step's own `sampling/*` metrics: the same
  shapes and program), a forward pass of the whole batch alone, and a forward pass of each
  completion on its own (batch 1: another shape, as a separate scoring pass at other shapes
  does it). Per way: the mean and max |difference| and the share of tokens whose ratio leaves
  [0.9, 1.1].
* `speed`: the same folder and settings in fp32 (TRL's defaults otherwise, `temperature` 1),
  60 steps a run, mptrain and TRL alternating (`--runs` each, TRL run by `--trl_python`, a venv
  with torch, transformers and trl 1.16); steady-state steps a second from each step's end
  (steps 11 to 50: compiles and start-up excluded), and mptrain's time in sampling and in the
  update.
* `learn`: `configs/llama3.py:grpo_tiny`, 200 steps, seeds 0 and 1, fp16-mixed (as shipped),
  bf16-mixed and fp32, and LoRA (rank 8 on every projection and the head, `LORA_TARGETS`) in
  fp16-mixed and bf16-mixed: the mean reward of steps 1-20 and 181-200.

* `lora`: why adapters on `grpo_tiny` do not raise its reward. A full fine-tune trains a base
  (40 and 50 steps), then rank-8 adapters train 200 steps from each base's checkpoint (learning
  rates 3e-3 and 1e-2). Beside each run, the base's ceiling: the largest share of probability
  its frozen head (times the final norm's scale) can put on the ten digits, over every hidden
  state the final norm can give (norm sqrt(d_model)), found by gradient ascent. The digits
  reward cannot exceed it, and only the head and the norm, which adapters leave frozen, move it.

Prints a table and writes `<out>/grpo_<part>.json`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER, TOKENIZER = ROOT / "tests" / "hf" / "fixture", ROOT / "tests" / "train" / "dpo_fixture"
PROMPTS = [f"Q: {a} + {b} =" for a in range(8) for b in range(8)]  # 64, one length in bytes
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
STEADY = (10, 50)  # the steps whose ends time the steady state
# `learn`'s adapters: every projection and the head, whose frozen kernel otherwise caps the
# digits reward (`lora`), at ten times the full fine-tune's learning rate
LORA_TARGETS, LORA_LR = "head|attn|mlp", "1e-2"


def _prompts(folder: Path) -> str:
    path = folder / "prompts.jsonl"
    answer = lambda p: str(sum(int(x) for x in p[3:-2].split(" + ")))
    rows = [{"prompt": p, "answer": answer(p)} for p in PROMPTS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(workdir: Path, precision: str, steps: int):
    import runpy

    config = runpy.run_path(str(ROOT / "configs" / "hf.py"))["get_config"](f"grpo={FOLDER}")
    config.data.files, config.data.tokenizer = _prompts(workdir), str(TOKENIZER)
    config.data.cache_dir = str(workdir / "cache")
    config.data.seq_len = 32
    config.precision, config.batch_size, config.num_train_steps = precision, 16, steps
    config.log_every_steps, config.checkpoint_every_steps = 10, steps
    config.grpo.num_generations, config.grpo.max_completion_length = 4, 8
    config.grpo.reward_funcs = ("answer_match_reward",)
    return config


def _trainer(config, workdir: Path, hook=None):
    from mptrain import config as config_lib
    from mptrain.train import grpo

    class Timed(grpo.GRPOTrainer):
        def build_hooks(self, run):
            return [*super().build_hooks(run), *([hook] if hook else [])]

    return Timed(config, workdir, resolved=config_lib.validate(config))


def mismatch(out: Path, precisions=PRECISIONS) -> dict:
    import jax
    import numpy as np

    from mptrain.train import init_from

    found = {}
    for precision in precisions:
        workdir = Path(tempfile.mkdtemp(dir=out))
        trainer = _trainer(_config(workdir, precision, 1), workdir)
        sources = trainer.build_datasets()
        run = trainer.setup(*sources, init_from.read(trainer, sources[0]))
        with run:
            state = run.state
            batch, _ = trainer.sampler(state, 0)
            score = jax.jit(functools.partial(_score, trainer.policy, trainer.model))
            whole = np.asarray(score(state.model_params, batch))
            rows = jax.tree.map(np.asarray, batch)
            one = lambda r, rows=rows: jax.tree.map(lambda x: x[r : r + 1], rows)
            alone = [np.asarray(score(state.model_params, one(r))) for r in range(16)]
            run.state, metrics, _ = run.train_step(state, batch, run.totals)
            metrics = jax.device_get(metrics)
        mask, sampled = rows["targets"] >= 0, rows["sampling_logps"]
        figures = lambda logps, m=mask, s=sampled: _figures(logps[m] - s[m])
        alone = np.concatenate(alone)
        step = {
            "mean": float(metrics["sampling/sampling_logp_difference/mean"]),
            "max": float(metrics["sampling/sampling_logp_difference/max"]),
            "outside": float(metrics["sampling/frac_ratio_outside_0.9_1.1"]),
        }
        found[precision] = {"update": step, "batch": figures(whole), "alone": figures(alone)}
        print(precision, found[precision], flush=True)
    print(f"\n{'precision':<12}{'scored in':<22}{'mean |d|':>11}{'max |d|':>11}{'outside':>9}")
    for precision, ways in found.items():
        for way, label in (("update", "the update"), ("batch", "the batch, alone"),
                           ("alone", "each row alone")):  # fmt: skip
            f = ways[way]
            print(f"{precision:<12}{label:<22}{f['mean']:11.2e}{f['max']:11.2e}{f['outside']:9.2%}")
    return found


def _score(policy, model, params, batch):
    """The trainer's log-probabilities of a batch's completion tokens, a forward pass alone."""
    from mptrain.models import dpo_loss

    with policy.matmuls():
        out = model.apply({"params": policy.cast_params(params)}, batch["inputs"],
                          targets=batch["targets"])  # fmt: skip
        return dpo_loss.token_logps(out, batch["targets"])


def _figures(d) -> dict:
    import numpy as np

    ratio = np.exp(d)
    outside = float(np.mean((ratio < 0.9) | (ratio > 1.1)))
    return {"mean": float(np.mean(np.abs(d))), "max": float(np.max(np.abs(d))), "outside": outside}


TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

folder, tokenizer_dir, out, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
torch.manual_seed(0)
tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
stamps = []

class Stamp(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        stamps.append(time.perf_counter())

def reward(completions, **kwargs):
    return [float(len(c)) for c in completions]

args = GRPOConfig(
    output_dir=out, per_device_train_batch_size=16, num_generations=4, max_completion_length=8,
    max_steps=60, logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
    fp16=False, seed=0, dataloader_num_workers=0,
)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                      train_dataset=Dataset.from_dict({"prompt": prompts}),
                      processing_class=tokenizer, callbacks=[Stamp()])
trainer.train()
print(json.dumps({"stamps": stamps}))
"""


def speed(out: Path, trl_python: str | None, runs: int) -> dict:
    import jax

    from mptrain.train import init_from

    found = {"mptrain": [], "trl": []}
    for k in range(runs):
        sides = ["mptrain", "trl"] if k % 2 == 0 else ["trl", "mptrain"]
        for side in sides:
            if side == "trl" and not trl_python:
                continue
            if side == "trl":
                argv = [trl_python, "-c", TRL_SCRIPT, str(FOLDER), str(TOKENIZER),
                        tempfile.mkdtemp(dir=out), json.dumps(PROMPTS)]  # fmt: skip
                done = subprocess.run(argv, capture_output=True, text=True, check=False)
                if done.returncode:
                    raise SystemExit(f"TRL's run failed: {done.stderr[-3000:]}")
                stamps = json.loads(done.stdout.strip().splitlines()[-1])["stamps"]
                found["trl"].append({"steps_per_s": _steady(stamps)})
            else:
                workdir = Path(tempfile.mkdtemp(dir=out))
                stamps = []
                stamp = lambda step, stamps=stamps: stamps.append(time.perf_counter())
                trainer = _trainer(_config(workdir, "fp32", 60), workdir, stamp)
                sources = trainer.build_datasets()
                run = trainer.setup(*sources, init_from.read(trainer, sources[0]))
                from mptrain import runtime

                with runtime.PreemptionFlag() as flag, run:
                    clock = run.clock
                    before = dict(clock.spent)
                    trainer.train(run, flag)
                    jax.block_until_ready(run.state)
                generation = clock.spent.get("generation", 0.0) - before.get("generation", 0.0)
                per_step, generation_ms = 1e3 / _steady(stamps), 1e3 * generation / 60
                found["mptrain"].append({
                    "steps_per_s": _steady(stamps),
                    "generation_ms": generation_ms,  # sampling and rewards, a step on average
                    "update_ms": per_step - generation_ms,  # the rest of a steady step
                })  # fmt: skip
            print(side, found[side][-1], flush=True)
    summary = {
        side: statistics.median(r["steps_per_s"] for r in rows)
        for side, rows in found.items()
        if rows
    }
    print(f"\n{'':<10}{'steps/s (median)':>18}  runs")
    for side, rows in found.items():
        if rows:
            print(f"{side:<10}{summary[side]:18.1f}  {[round(r['steps_per_s'], 1) for r in rows]}")
    return {"runs": found, "median_steps_per_s": summary}


def _steady(stamps: list[float]) -> float:
    first, last = STEADY
    return (last - first) / (stamps[last - 1] - stamps[first - 1])


def learn(out: Path) -> dict:
    found = {}
    cases = [(p, s, None) for p in ("fp16-mixed", "bf16-mixed", "fp32") for s in (0, 1)]
    cases += [(p, s, 8) for p in ("fp16-mixed", "bf16-mixed") for s in (0, 1)]
    for precision, seed, rank in cases:
        name = f"{precision} seed {seed}" + (f" lora {rank} +head" if rank else "")
        workdir = Path(tempfile.mkdtemp(dir=out))
        argv = [sys.executable, "-m", "mptrain.main",
                f"--config={ROOT / 'configs' / 'llama3.py'}:grpo_tiny", f"--workdir={workdir}",
                f"--config.precision={precision}", f"--config.seed={seed}",
                "--config.log_every_steps=1", "--config.num_train_steps=200"]  # fmt: skip
        if rank:
            argv += [f"--config.lora.rank={rank}", f"--config.lora.targets={LORA_TARGETS}"]
            argv += [f"--config.optimizer.learning_rate={LORA_LR}"]
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT)
        if done.returncode:
            found[name] = {"exit": done.returncode, "error": done.stderr[-500:]}
            print(f"{name:<28}exit {done.returncode}", flush=True)
            continue
        rows = [json.loads(x) for x in (workdir / "history.jsonl").read_text().splitlines()]
        rewards = [r["reward"] for r in rows]
        found[name] = {
            "first_20": statistics.mean(rewards[:20]),
            "last_20": statistics.mean(rewards[-20:]),
            "curve": rewards,
            "seconds": time.perf_counter() - start,
        }
        f = found[name]
        print(f"{name:<28}{f['first_20']:8.3f}{f['last_20']:8.3f}{f['seconds']:8.0f} s", flush=True)
    return found


def _tiny_run(workdir: Path, *flags: str) -> list[dict]:
    argv = [sys.executable, "-m", "mptrain.main",
            f"--config={ROOT / 'configs' / 'llama3.py'}:grpo_tiny", f"--workdir={workdir}",
            "--config.log_every_steps=1", *flags]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return [json.loads(x) for x in (workdir / "history.jsonl").read_text().splitlines()]


def digit_ceiling(head, scale, steps: int = 2000, lr: float = 0.3) -> float:
    """The largest total probability `softmax(h @ (scale * head))` puts on the digits '0'-'9'
    (byte ids) over hidden states `h` of norm sqrt(d) (an RMS norm's output before its scale):
    projected gradient ascent on the sphere, from a fixed start."""
    import numpy as np

    weights = np.asarray(head, np.float64) * np.asarray(scale, np.float64)[:, None]
    digits, width = [ord(c) for c in "0123456789"], weights.shape[0]
    u = np.random.default_rng(0).normal(size=width)
    u /= np.linalg.norm(u)
    for _ in range(steps):
        z = (u * np.sqrt(width)) @ weights
        p = np.exp(z - z.max())
        p /= p.sum()
        share = p[digits].sum()
        g = -p
        g[digits] += p[digits] / share  # d log(share) / d z
        u += lr * (weights @ g) * np.sqrt(width)
        u /= np.linalg.norm(u)
    return float(share)


def lora(out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import plain_orbax_state

    found, base = {}, Path(tempfile.mkdtemp(dir=out))
    rows = _tiny_run(base, "--config.num_train_steps=50", "--config.checkpoint_every_steps=10")
    for step in (40, 50):
        params = plain_orbax_state(base, step)["params"]
        ceiling = digit_ceiling(params["head"]["kernel"], params["final_norm"]["scale"])
        for lr in ("3e-3", "1e-2"):
            curve = _tiny_run(Path(tempfile.mkdtemp(dir=out)), "--config.lora.rank=8",
                              f"--config.optimizer.learning_rate={lr}",
                              f"--config.init_from={base / 'checkpoints' / str(step)}")  # fmt: skip
            digits = [r["rewards/digits_reward/mean"] for r in curve]
            name = f"base step {step}, lr {lr}"
            found[name] = {
                "base_reward": rows[step - 1]["reward"],
                "ceiling": ceiling,
                "digits_first_20": statistics.mean(digits[:20]),
                "digits_last_20": statistics.mean(digits[-20:]),
                "entropy_last": curve[-1]["entropy"],
            }
            f = found[name]
            first, last = f["digits_first_20"], f["digits_last_20"]
            line = f"ceiling {ceiling:.3f}  digits {first:.3f} -> {last:.3f}"
            print(f"{name:<26}{line}  entropy {f['entropy_last']:.2f}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("mismatch", "speed", "learn", "lora"), required=True)
    parser.add_argument("--out", default="/tmp/grpo")
    parser.add_argument("--trl_python", default=None)
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.part == "mismatch":
        result = mismatch(out)
    elif args.part == "speed":
        result = speed(out, args.trl_python, args.runs)
    elif args.part == "lora":
        result = lora(out)
    else:
        result = learn(out)
    (out / f"grpo_{args.part}.json").write_text(json.dumps(result, indent=1))
    print(f"written {out / f'grpo_{args.part}.json'}")


if __name__ == "__main__":
    main()
