"""`config.init_from`: a run's step-0 params from an HF Llama folder or an mptrain run, params
only; each bad input one line with exit 2 and no workdir; a workdir's own checkpoints win.

The runs are `configs/llama3.py:hf=DIR` on copies of `tests/hf/fixture` (a tiny random Llama
made by transformers: GQA, Llama 3 rope scaling), fine-tuned on text tokenized by a
`tokenizer.json` trained here with `tokenizers`.
"""

import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from helpers import (
    FIXTURE,
    ROOT,
    STEPS,
    assert_trees_bytes_equal,
    checkpoint_steps_on_disk,
    fake_cpu_env,
    hf_flag,
    history_without_timings,
    hub_cache,
    load_config,
    make_text,
    make_tokenizer,
    needs_devices,
    offline_hub,
    overrides,
    plain_orbax_state,
    run_cli,
    step0,
)

from mptrain import hf
from mptrain.parallel import sharding


@pytest.fixture(scope="module")
def finetune(tmp_path_factory):
    """A fine-tune of a copy of the fixture (with a tokenizer of its own) on a folder of text,
    `STEPS` steps, checkpoints at 10 and 20; the namespace of what it used."""
    base = tmp_path_factory.mktemp("finetune")
    folder = Path(shutil.copytree(FIXTURE, base / "llama"))
    text = make_text(base / "notes")
    make_tokenizer(folder, [p.read_text() for p in sorted((base / "notes").iterdir())])
    workdir, cache = base / "run", base / "cache"
    code, _ = run_cli(workdir, *overrides(text, cache), config=hf_flag(folder))
    assert code == 0
    return dict(folder=folder, text=text, cache=cache, workdir=workdir)


def test_a_hub_id_from_the_cache_offline_trains_as_its_folder_by_path(
    finetune, tmp_path, monkeypatch
):
    """`configs/hf.py:ORG/NAME` with the fixture's folder laid out as a Hub cache and
    HF_HUB_OFFLINE=1: the config, weights and tokenizer come from the snapshot, and the run's
    history is the same as the fine-tune of the folder by its path (the same program)."""
    offline_hub(monkeypatch, tmp_path / "hub")
    hub_cache(tmp_path / "hub", "mptrain-tests/tiny", finetune["folder"])
    workdir = tmp_path / "run"
    flags = overrides(finetune["text"], finetune["cache"])
    code, _ = run_cli(
        workdir, *flags, config=f"--config={ROOT / 'configs' / 'hf.py'}:mptrain-tests/tiny"
    )
    assert code == 0
    assert history_without_timings(workdir) == history_without_timings(finetune["workdir"])
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["init_from"] == saved["data"]["tokenizer"] == "mptrain-tests/tiny"


def hf_config(folder, **keys):
    keys = {"data.seq_len": 32, "batch_size": 2, "data.max_bytes": 100_000} | keys
    return load_config("llama3", f"hf={folder}", **keys)


def fixture_params():
    return hf.load(FIXTURE)[1]


# ---- what step 0 holds -------------------------------------------------------------------------


def test_step_0_holds_the_hf_folders_params_and_a_fresh_optimizer(tmp_path):
    config = hf_config(FIXTURE)
    state, trainer = step0(config, tmp_path / "run")
    assert_trees_bytes_equal(jax.device_get(state.params), fixture_params())
    fresh = trainer.init_state()  # the model's own init: params differ, the rest is the same
    assert_trees_bytes_equal(jax.device_get(state.opt_state), jax.device_get(fresh.opt_state))
    assert int(state.step) == 0 and int(state.skipped_steps) == 0
    assert float(state.loss_scale.loss_scale) == float(fresh.loss_scale.loss_scale)


def test_bf16_weights_become_fp32_masters_exactly_and_stay_bf16_under_bf16_pure(tmp_path):
    folder = tmp_path / "bf16"
    model, params = hf.load(FIXTURE)
    hf.save(folder, model, params, dtype="bfloat16")
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params)

    state, _ = step0(hf_config(folder), tmp_path / "mixed")
    widened = jax.tree.map(lambda x: x.astype(np.float32), rounded)
    assert_trees_bytes_equal(jax.device_get(state.params), widened)

    state, _ = step0(hf_config(folder, precision="bf16-pure"), tmp_path / "pure")
    assert_trees_bytes_equal(jax.device_get(state.params), rounded)


def test_a_workdir_or_one_of_its_checkpoints_gives_its_params(finetune, tmp_path):
    trained = plain_orbax_state(finetune["workdir"], STEPS)
    at_10 = plain_orbax_state(finetune["workdir"], 10)
    for source, want in [
        (finetune["workdir"], trained),
        (finetune["workdir"] / "checkpoints" / "10", at_10),
    ]:
        config = hf_config(FIXTURE, init_from=str(source))
        state, _ = step0(config, tmp_path / source.name)
        assert_trees_bytes_equal(jax.device_get(state.params), want["params"])
        assert int(state.step) == 0  # the source's step and optimizer state stay behind
    assert int(trained["step"]) == STEPS


@needs_devices(2)
def test_params_are_made_in_the_states_fsdp_shardings(finetune, tmp_path):
    for source, want in [(FIXTURE, fixture_params()), (finetune["workdir"], None)]:
        config = hf_config(FIXTURE, init_from=str(source), **{"mesh.data": 1, "mesh.fsdp": 2})
        state, trainer = step0(config, tmp_path / source.name)
        wanted = sharding.state_shardings(trainer.mesh, state.params, state.axes)
        split = 0
        for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(wanted), strict=True):
            assert x.sharding == s
            split += "fsdp" in s.spec
        assert split >= 5  # most params are split, each device holding half
        want = want or plain_orbax_state(finetune["workdir"], STEPS)["params"]
        assert_trees_bytes_equal(jax.device_get(state.params), want)


# ---- bad input: one line, exit 2, no workdir ----------------------------------------------------


def error_line(err: str) -> str:
    """The one line of `err` that is not an INFO or WARNING log line."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("I", "W"))]
    assert len(lines) == 1, "\n".join(lines)[-3000:]
    return lines[0]


def _broken_copy(tmp_path, edit) -> Path:
    folder = Path(shutil.copytree(FIXTURE, tmp_path / "broken"))
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _cases(tmp_path, finetune):
    """`(flags, texts the line names)` for each bad input."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_steps" / "checkpoints").mkdir(parents=True)
    narrower = _broken_copy(tmp_path, lambda c: c.update(intermediate_size=32))
    gpt2 = _broken_copy(tmp_path / "gpt2", lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    nan = Path(shutil.copytree(FIXTURE, tmp_path / "nan"))  # issue 42, sweep case A35
    tensors = safetensors.numpy.load_file(nan / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = np.nan
    safetensors.numpy.save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    run = finetune["workdir"]
    fixture = hf_flag(FIXTURE)
    return [
        ([fixture, f"--config.init_from={tmp_path}/gone"], [f"{tmp_path}/gone", "no such"]),
        (
            [fixture, f"--config.init_from={tmp_path}/empty"],
            ["empty", "a HuggingFace folder of a decoder mptrain reads"],
        ),
        ([fixture, f"--config.init_from={tmp_path}/no_steps"], ["no finished checkpoint"]),
        ([fixture, "--config.model.d_ff=32"], ["config.model.d_ff=32", "d_ff=64"]),
        ([hf_flag(narrower)], ["tensor", "mlp", "[2, 32, 48]"]),
        ([fixture, f"--config.init_from={gpt2}"], ["GPT2LMHeadModel"]),
        ([fixture, f"--config.init_from={nan}"], [f"{nan}", "non-finite", "mlp"]),
        (
            [fixture, f"--config.init_from={run}", "--config.model.rope_theta=10000.0"],
            ["config.model.rope_theta=10000.0", "500000.0", f"{run}/checkpoints/{STEPS}"],
        ),
        (
            [fixture, f"--config.init_from={run}", "--config.model.scan_layers=False"],
            ["laid out otherwise", "--config.model.scan_layers=True", "layers_0"],
        ),
    ]


def test_each_bad_input_is_one_line_exit_2_and_no_workdir(finetune, tmp_path, capsys):
    text, cache = finetune["text"], finetune["cache"]
    for i, (flags, named) in enumerate(_cases(tmp_path, finetune)):
        workdir = tmp_path / f"run{i}"
        code, err = run_cli(
            workdir, *flags[1:], *overrides(text, cache), config=flags[0], capsys=capsys
        )
        line = error_line(err)
        assert code == 2, line
        assert line.startswith("mptrain: error: ") and all(n in line for n in named), (line, named)
        assert not workdir.exists(), line


# ---- resuming ----------------------------------------------------------------------------------


def test_a_workdir_with_its_own_checkpoint_resumes_without_reading_init_from(
    finetune, tmp_path, capsys, caplog
):
    # Killed after the checkpoint of step 10 (what a kill leaves: no checkpoint 20), and the
    # folder init_from names is gone since: the run resumes from its own checkpoint, never
    # looks there, and ends with the bytes of the uninterrupted run.
    workdir = Path(shutil.copytree(finetune["workdir"], tmp_path / "run"))
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))
    flags = [f"--config.init_from={tmp_path}/gone", f"--config.data.tokenizer={finetune['folder']}"]
    flags += overrides(finetune["text"], finetune["cache"])
    with caplog.at_level(logging.INFO):
        code, err = run_cli(workdir, *flags, config=hf_flag(FIXTURE), capsys=capsys)
    assert code == 0, err[-3000:]
    assert "mptrain: resuming from step 10; init_from not read" in caplog.messages
    assert_trees_bytes_equal(
        plain_orbax_state(finetune["workdir"], STEPS), plain_orbax_state(workdir, STEPS)
    )


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_matches_an_uninterrupted_run(finetune, tmp_path):
    # The acceptance 3 as a user meets it: `python -m mptrain.main` killed with
    # SIGKILL at random moments (a checkpoint every 2 steps), run again until it finishes.
    more = {"checkpoint_every_steps": 2, "log_every_steps": 2, "batch_size": 8}
    flags = overrides(finetune["text"], finetune["cache"], more=more | {"data.seq_len": 64})
    command = lambda workdir: [
        sys.executable, "-m", "mptrain.main", hf_flag(finetune["folder"]), f"--workdir={workdir}",
        *flags,
    ]  # fmt: skip
    env = fake_cpu_env(1)
    rng, crashed, kills, trials = random.Random(0), tmp_path / "crashed", [], 4
    events = lambda: len(list(crashed.glob("events.out.tfevents.*")))  # one a process
    while len(kills) < trials:
        before = events()
        proc = subprocess.Popen(command(crashed), cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while events() == before and proc.poll() is None:  # until its writer is up: training
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        if proc.poll() is not None:
            assert proc.returncode == 0
            break  # finished before this kill
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills.append(max(checkpoint_steps_on_disk(crashed), default=0))
    assert kills, "no kill landed before the run finished"
    final = subprocess.run(command(crashed), cwd=ROOT, env=env, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-3000:]
    straight = tmp_path / "straight"
    done = subprocess.run(command(straight), cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mptrain: initialised from" in done.stderr
    assert_trees_bytes_equal(plain_orbax_state(straight, STEPS), plain_orbax_state(crashed, STEPS))
    print(f"killed with checkpoints of steps {kills} on disk")
