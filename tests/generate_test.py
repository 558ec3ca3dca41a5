"""`python -m mptrain.generate` (issue 45): the command on a HF folder and on a run's workdir,
and its bad inputs: one line, exit 2, before anything compiles."""

import json
import shutil

import numpy as np
import pytest
from helpers import ROOT, fake_cpu_env

from mptrain import generate
from mptrain.data import chat, sft, tokenize
from mptrain.models.decoder import decode

FIXTURE = ROOT / "tests" / "hf" / "fixture"


def _with_tokenizer(fixture, out):
    """A copy of a HF fixture with a tokenizer: mptrain's byte-level one (261 tokens of the
    fixture's 300) and a chat template in Llama 3's layout."""
    out.mkdir()
    for name in ("config.json", "model.safetensors", "generate.npz"):
        shutil.copy(fixture / name, out / name)
    tokenize.byte_level(sft.BYTE_SPECIALS).save(str(out / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config["chat_template"] = chat.BUILTIN["llama3"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The untied fixture (Llama 3's RoPE scaling), with a tokenizer."""
    return _with_tokenizer(FIXTURE, tmp_path_factory.mktemp("hf") / "llama")


def _transformers_tokens(folder, precision):
    """mptrain's greedy tokens for the prompts of the fixture's generate.npz (made by
    transformers' `generate`: tests/hf/make_fixture.py), in one batch, and transformers'."""
    expected = np.load(folder / "generate.npz")
    speaker = generate.load(hf_folder=str(folder), precision=precision)
    run = decode.make_decoder(speaker.model, expected["tokens"].shape[1])
    greedy, none = decode.Sampling().values(), decode.stops([])
    got = run(speaker.params, expected["prompts"], expected["lengths"], greedy, 0, none)
    return np.asarray(got), expected["tokens"]


def test_greedy_decoding_is_transformers_generate_token_for_token(folder):
    """fp32, the untied fixture (grouped queries, Llama 3's RoPE scaling past its original
    context of 16), prompts of 5, 12 and 9 tokens batched together, 32 new tokens each:
    mptrain's tokens are transformers' (each prompt generated alone there)."""
    got, want = _transformers_tokens(folder, "fp32")
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # the tied fixture's and bf16's decoders: two more programs
def test_the_tied_fixture_too_and_bf16_reports_where_it_first_parts(folder, tmp_path):
    tied = _with_tokenizer(FIXTURE / "tied", tmp_path / "tied")
    got, want = _transformers_tokens(tied, "fp32")
    np.testing.assert_array_equal(got, want)
    got, want = _transformers_tokens(folder, "bf16-mixed")
    parted = [
        int(np.argmax(g != w)) if (g != w).any() else None for g, w in zip(got, want, strict=True)
    ]
    print(
        f"bf16-mixed against transformers' fp32 greedy: first differing token per prompt {parted}"
    )
    assert all(p is None or p > 0 for p in parted), parted  # the first token agrees


def _run(capsys, *argv):
    code = generate.main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--workdir={tmp}/none", "--prompt=x"], "--workdir={tmp}/none: not an mptrain run"),
        (["--workdir={tmp}", "--prompt=x"], "--workdir={tmp}: not an mptrain run"),
        (["--workdir={tmp}/bad", "--prompt=x"], "config.json is unusable"),
        (
            ["--hf={tmp}/gpt2", "--prompt=x"],
            "mptrain.hf reads model_type 'llama', 'mistral', 'qwen2', 'qwen3'",
        ),
        (["--hf={tmp}", "--prompt=x"], "not a HuggingFace folder"),
        (["--workdir={tmp}", "--hf={tmp}", "--prompt=x"], "give --workdir=RUN or --hf=FOLDER"),
        (["--hf={tmp}"], "no prompt: give --prompt=TEXT or --prompts=FILE.jsonl"),
        (["--hf={tmp}", "--prompt=x", "--temperature=-1"], "--temperature=-1.0: must be 0"),
        (["--hf={tmp}", "--prompt=x", "--max_new_tokens=0"], "--max_new_tokens=0: must be 1"),
        (["--hf={tmp}", "--prompts={tmp}/p.jsonl"], "p.jsonl line 2: no a string 'prompt'"),
        (["--hf={tmp}", "--prompt=x", "--cache_dtype=int8"], "--cache_dtype='int8'"),
        (["--hf={tmp}", "--prompt=x", "--seed=3000000000"], "--seed=3000000000: from 0 to"),
        (["--workdir={tmp}/new", "--prompt=x"], "--workdir={tmp}/new: holds no checkpoint"),
        (  # refused before the model is read: this folder holds none
            ["--hf={tmp}", "--prompt=x", "--out={tmp}/p.jsonl/a.jsonl"],
            "--out={tmp}/p.jsonl/a.jsonl: {tmp}/p.jsonl is a file, not a folder",
        ),
        (["--hf={tmp}", "--prompt=x", "--out={tmp}"], "--out={tmp}: is a folder"),
        (["--hf={tmp}", "--prompt=x", "--template_max_seconds=0"], "--template_max_seconds=0.0: "),
        (["--hf={tmp}", "--prompt=x", "--template_max_chars=0"], "--template_max_chars=0: must"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    (tmp_path / "bad" / "checkpoints").mkdir(parents=True)
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "new").mkdir()  # a run that stopped before its first save
    (tmp_path / "new" / "config.json").write_text("{}")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    code, out, err = _run(capsys, *(a.format(tmp=tmp_path) for a in args))
    assert code == 2 and not out, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert says.format(tmp=tmp_path) in err, err


def test_a_template_that_runs_on_names_the_flag_that_bounds_it(tmp_path, capsys):
    """Sweep 2026-12-06, X11c: it stopped at "data.template_max_seconds=2", a setting generate
    has no flag for."""
    looping = _with_tokenizer(FIXTURE, tmp_path / "looping")
    config = json.loads((looping / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    )
    (looping / "tokenizer_config.json").write_text(json.dumps(config))
    argv = [f"--hf={looping}", "--chat", "--prompt=x", "--template_max_seconds=0.25"]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and not out, err
    assert err.strip().endswith("ran past --template_max_seconds=0.25"), err


def test_a_prompt_past_the_models_context_is_refused(folder, capsys):
    code, _, err = _run(capsys, f"--hf={folder}", "--prompt=" + "x" * 40, "--max_new_tokens=30")
    assert code == 2 and "prompt 0 has 40 tokens: with --max_new_tokens=30" in err, err
    assert "past the model's context of 64" in err


def test_the_command_answers_from_a_folder_in_one_batch(folder, capsys, tmp_path):
    """Greedy, fp32, three prompts of 5, 12 and 9 bytes in one batch: each completion is the
    one the decoder gives for its tokens (the byte tokenizer: a text's bytes are its ids), and
    `--out` writes them as jsonl."""
    prompts = ["hello", "a longer one", "mid-sized"]
    out = tmp_path / "answers.jsonl"
    argv = [f"--hf={folder}", *(f"--prompt={p}" for p in prompts), "--max_new_tokens=32"]
    code, printed, err = _run(capsys, *argv, "--precision=fp32", f"--out={out}")
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    speaker = generate.load(hf_folder=str(folder), precision="fp32")
    ids, lengths = decode.pad_prompts([list(p.encode()) for p in prompts], 64, 32)
    run = decode.make_decoder(speaker.model, 32)
    want = run(speaker.params, ids, lengths, decode.Sampling().values(), 0, decode.stops([]))
    stops = speaker.codec.stop_ids
    assert [r["tokens"] for r in rows] == decode.strip(np.asarray(want), stops)
    assert f"[0] hello\n{rows[0]['completion']}\n" in printed
    assert f"3 answers from {folder}" in err


@pytest.mark.slow  # a training subprocess and the decoder's program
def test_answering_from_a_live_runs_workdir_leaves_the_run_alone(tmp_path, capsys):
    """While a run trains (a subprocess, checkpoints every 5 steps), the command answers from
    its newest complete checkpoint; the run takes no notice and ends as it would have."""
    import subprocess
    import sys
    import time

    workdir = tmp_path / "run"
    command = [
        sys.executable, "-m", "mptrain.main", f"--config={ROOT / 'configs' / 'llama3.py'}:tiny",
        f"--workdir={workdir}", "--config.num_train_steps=60", "--config.checkpoint_every_steps=5",
        "--config.eval_every_steps=60", "--config.eval_steps=1",
    ]  # fmt: skip
    env = fake_cpu_env(1)
    run = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (workdir / "checkpoints" / "10").exists():
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    code, out, err = _run(capsys, f"--workdir={workdir}", "--prompt=def ", "--max_new_tokens=8")
    assert code == 0, err
    step = int(err.split(" step ")[-1].split()[0])
    assert step >= 10 and "[0] def " in out, (out, err)
    assert run.poll() is None  # still training
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    assert "mptrain: done in" in stderr
