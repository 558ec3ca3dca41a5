"""DPO (`data.name="dpo"`, `mptrain.train.dpo`) against TRL's `DPOTrainer` 1.16 on the same pairs.

The figures of `tests/train/dpo_fixture/reference.npz` are TRL's own, made by
`tests/train/make_dpo_fixture.py` in a venv of its own, on `tests/hf/fixture`'s tiny Llama in fp32:
the pairs' tokens, the step-0 model's sequence log-probabilities, each loss and its gradient,
and two steps of SGD. Here the same model and pairs go through mptrain.
"""

import json
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXTURE, ROOT, event_series, history_without_timings, load_config, run_cli

from mptrain import errors
from mptrain.data import dpo as dpo_data
from mptrain.data import sft
from mptrain.models import dpo_loss
from mptrain.train import dpo

PAIRS = ROOT / "tests" / "train" / "dpo_fixture"
REF = np.load(PAIRS / "reference.npz")
SEQ_LEN = 32  # the longest sequence of the fixture's pairs is 32 tokens
LOSSES = {  # the fixture's name: (dpo.loss, label_smoothing, sft_weight)
    "sigmoid": ("sigmoid", 0.0, 0.0),
    "robust": ("robust", 0.1, 0.0),
    "hinge": ("hinge", 0.0, 0.0),
    "ipo": ("ipo", 0.0, 0.0),
    "sigmoid_sft": ("sigmoid", 0.0, 0.5),
}


def pairs_config(tmp_path: Path, name: str = "pairs", **overrides):
    """`configs/llama3.py:dpo=<the fixture>` on the fixture's 4 pairs, fp32, TRL's run: plain
    SGD at 0.5, no clip, all 4 pairs a step. The file holds them twice: the second copy is the
    held-out half."""
    files = tmp_path / f"{name}.jsonl"
    files.write_text((PAIRS / f"{name}.jsonl").read_text() * 2)
    keys = {
        "data.files": str(files), "data.tokenizer": str(PAIRS), "data.seq_len": SEQ_LEN,
        "data.eval_fraction": 0.5, "data.cache_dir": str(tmp_path / "cache"),
        "precision": "fp32", "batch_size": 4, "mesh.data": 1, "num_train_steps": 2,
        "log_every_steps": 1, "eval_every_steps": 2, "eval_steps": 1,
        "checkpoint_every_steps": 2, "optimizer.name": "sgd", "optimizer.momentum": 0.0,
        "optimizer.learning_rate": 0.5, "optimizer.schedule": "constant",
        "optimizer.warmup_steps": 0, "optimizer.grad_clip_norm": 0.0,
    }  # fmt: skip
    return load_config("llama3", f"dpo={FIXTURE}", **{**keys, **overrides})


@pytest.mark.parametrize("name", ["pairs", "chats"])
def test_the_pairs_tokenize_and_mask_as_trls(tmp_path, name):
    """Plain text (the end-of-text token's text appended) and conversations (the chat template,
    the prompt with its generation prompt): TRL's ids, and the completion from the same token."""
    s = dpo_data.settings(pairs_config(tmp_path, name))
    tokenizer = sft.tokenizer_of(s.base.tokenizer)
    lines = (PAIRS / f"{name}.jsonl").read_text().splitlines()
    for i, line in enumerate(lines):
        chosen, rejected, start = dpo_data.encode(json.loads(line), s, tokenizer)
        want = REF[f"{name}_ids"][i]
        np.testing.assert_array_equal(chosen, want[0][want[0] >= 0])
        np.testing.assert_array_equal(rejected, want[1][want[1] >= 0])
        assert start == REF[f"{name}_start"][i]
    rows, _ = dpo_data.build(s)  # targets: -1 on the prompt and the padding
    assert rows.shape == (8, 2, 2, SEQ_LEN)
    row = rows[0, :, 0]
    start, ids = REF[f"{name}_start"][0], REF[f"{name}_ids"][0, 0]
    n = int((ids >= 0).sum())
    np.testing.assert_array_equal(row[1, : start - 1], -1)
    np.testing.assert_array_equal(row[1, start - 1 : n - 1], ids[start:n])
    np.testing.assert_array_equal(row[1, n - 1 :], -1)


def test_an_implicit_prompt_is_the_turns_both_conversations_begin_with(tmp_path):
    s = dpo_data.settings(pairs_config(tmp_path, "chats"))
    tokenizer = sft.tokenizer_of(s.base.tokenizer)
    explicit = json.loads((PAIRS / "chats.jsonl").read_text().splitlines()[2])
    implicit = {k: explicit["prompt"] + explicit[k] for k in ("chosen", "rejected")}
    got = dpo_data.encode(implicit, s, tokenizer)
    for a, b in zip(dpo_data.encode(explicit, s, tokenizer), got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_each_loss_and_its_gradient_in_the_log_probs_equal_trls():
    """On TRL's step-0 sums and a drawn reference: each loss's value and its gradient with
    respect to the policy's chosen and rejected sums, to 1e-6 (fp32); with the sft term, TRL's
    value (the chosen tokens' mean NLL is the chosen sums over their tokens)."""
    for name in ("pairs", "chats"):
        logps, ref = REF[f"{name}_logps"], REF[f"{name}_ref"]
        ids, start = REF[f"{name}_ids"], REF[f"{name}_start"]
        tokens = (ids >= 0).sum(-1) - start[:, None]

        @jax.jit
        def losses(logps, ref, tokens):
            out = {}
            for key, (loss, smoothing, _) in LOSSES.items():
                s = dpo_loss.settings({"loss": loss, "label_smoothing": smoothing}, False)
                mean = lambda x, s=s: jnp.mean(dpo_loss.pair_losses(x, ref, tokens, s))
                out[key] = jax.value_and_grad(mean)(logps)
            return out

        for key, (value, grad) in losses(logps, ref, tokens).items():
            want = REF[f"{name}_loss_{key}"]
            if key == "sigmoid_sft":  # TRL's adds 0.5 x the chosen tokens' mean NLL, whose
                # gradient the fixture's (taken through the reference's sums) does not hold
                value = value + 0.5 * -logps[:, 0].sum() / tokens[:, 0].sum()
            np.testing.assert_allclose(value, want, rtol=1e-6, err_msg=f"{name} {key}")
            np.testing.assert_allclose(grad, REF[f"{name}_grad_{key}"], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "name, reference",
    [
        ("pairs", "copy"),
        ("chats", "copy"),
        # the reference computed ahead, each pair's sums to TRL's: make test-slow
        pytest.param("pairs", "precomputed", marks=pytest.mark.slow),
    ],
)
def test_fp32_matches_trl_step_0_and_two_sgd_steps(tmp_path, name, reference):
    """Step 1's loss is ln 2 to 1e-7 with every reward and the accuracy 0, its mean sums
    TRL's step-0 sums' to 1e-5; the two steps' loss, margins and gradient norm are TRL's.
    Copied reference: on 8 devices, data parallel (each pair twice in a batch of 8: the 4's
    means), each token's log-probability from the head chunked 8 positions at a time
    (`lm_loss.token_loss`, as at a real vocabulary). Precomputed: on one device, from the
    whole logits; each pair's sums are TRL's to 1e-5, in the workdir and the cache."""
    copy = {"mesh.data": -1, "batch_size": 8, "loss.chunk_tokens": 8}
    mesh = copy if reference == "copy" else {}
    config = pairs_config(tmp_path, name, **{"dpo.reference": reference}, **mesh)
    dpo.DPOTrainer(config, tmp_path / "run").train_and_evaluate()
    rows = {r["step"]: r for r in history_without_timings(tmp_path / "run") if "loss" in r}
    assert abs(rows[1]["loss"] - math.log(2)) < 1e-7, rows[1]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert rows[1][key] == 0.0, (key, rows[1])
    want = REF[f"{name}_logps"]
    np.testing.assert_allclose(rows[1]["logps/chosen"], want[:, 0].mean(), rtol=1e-5)
    np.testing.assert_allclose(rows[1]["logps/rejected"], want[:, 1].mean(), rtol=1e-5)
    norms = {step: float(x) for step, x in event_series(tmp_path / "run", "grad_norm").items()}
    for step, (loss, margins, accuracy, norm) in enumerate(REF[f"{name}_history"], 1):
        got = rows[step]
        np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
        np.testing.assert_allclose(got["rewards/margins"], margins, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got["rewards/accuracies"], accuracy)
        np.testing.assert_allclose(norms[step], norm, rtol=1e-5)
    if reference == "precomputed":
        saved = json.loads((tmp_path / "run" / dpo.WORKDIR_FILE).read_text())
        logps = np.asarray(saved["logps"], np.float32)
        np.testing.assert_allclose(logps[:4], want, rtol=1e-5)
        np.testing.assert_array_equal(logps[4:], logps[:4])  # the held-out copy
        cached = sorted((tmp_path / "cache").glob("dpo-*-ref-*.npy"))
        assert len(cached) == 1 and np.array_equal(np.load(cached[0]).reshape(-1, 2), logps)


@pytest.mark.parametrize(
    "line, says",
    [
        ({"prompt": "a", "chosen": "b"}, "no 'rejected'"),
        ({"prompt": "a", "chosen": "b", "rejected": "b"}, "'chosen' equals 'rejected'"),
        # sweep 2026-12-06, D11b: the eos the pair ends with anyway
        (
            {"prompt": "a", "chosen": "b<|end_of_text|>", "rejected": "b"},
            "'chosen' and 'rejected' are other texts of the same tokens",
        ),
        ({"prompt": "a", "chosen": " ", "rejected": "c"}, "an empty completion"),
        ({"prompt": "x" * 40, "chosen": "b", "rejected": "c"}, "fill data.seq_len=32"),
        # sweep 2026-12-06, D06: it named a 'prompt' field the line does not have
        (
            {
                "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "rejected": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "c"},
                ],
            },
            "and 'chosen' and 'rejected' differ from their first turn",
        ),
    ],
)
def test_a_bad_pair_is_one_line_naming_file_and_line(tmp_path, capsys, line, says):
    files = tmp_path / "bad.jsonl"
    good = (PAIRS / "pairs.jsonl").read_text()
    files.write_text(good + json.dumps(line) + "\n" + good)
    config = pairs_config(tmp_path, **{"data.files": str(files)})
    with pytest.raises(errors.ConfigError) as e:
        dpo_data.build(dpo_data.settings(config))
    message = str(e.value)
    assert message.startswith(f"config.data.files: {files} line 5: ") and says in message
    assert "\n" not in message


@pytest.mark.parametrize("reference", ["copy", pytest.param("precomputed", marks=pytest.mark.slow)])
def test_eval_fraction_0_trains_on_every_pair_and_never_evaluates(tmp_path, reference):
    """Sweep 2026-12-06: 4 pairs were refused ("of 4 pairs it holds out 0; each side needs at
    least one") and data.eval_fraction=0 too ("must be > 0"); TRL trains without an eval split.
    Here the fixture's pairs twice, all 8 trained on (the `copy` case's step, compiled once)."""
    copy = {"mesh.data": -1, "batch_size": 8, "loss.chunk_tokens": 8}
    keys = {"data.eval_fraction": 0.0, "dpo.reference": reference}
    config = pairs_config(tmp_path, **keys, **(copy if reference == "copy" else {}))
    train, held_out = dpo_data.create_sources(config)
    assert len(train.rows) == 8 and held_out is None
    trainer = dpo.DPOTrainer(config, tmp_path / "run")
    trainer.train_and_evaluate()
    rows = history_without_timings(tmp_path / "run")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and trainer.last_eval is None
    assert not any(key.startswith("eval_") for r in rows for key in r)
    if reference == "precomputed":
        saved = json.loads((tmp_path / "run" / dpo.WORKDIR_FILE).read_text())
        assert np.asarray(saved["logps"]).shape == (8, 2)


def test_eval_files_hold_the_eval_pairs_and_every_pair_of_files_trains(tmp_path):
    """Issue 70: the eval pairs in files of their own (`data.eval_files`, TRL's eval_dataset);
    every pair of `data.files` trains and `data.eval_fraction` is not read."""
    keys = {"data.eval_files": str(PAIRS / "chats.jsonl"), "data.eval_fraction": 0.5}
    train, held_out = dpo_data.create_sources(pairs_config(tmp_path, **keys))
    alone = dpo_data.build(dpo_data.settings(pairs_config(tmp_path, "chats")))[0]
    assert len(train.rows) == 8 and np.array_equal(held_out.rows, alone[:4])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(errors.ConfigError, match=rf"^config.data.eval_files: {bad} line 1: "):
        dpo_data.create_sources(pairs_config(tmp_path, **{"data.eval_files": str(bad)}))


def test_a_bad_pair_of_the_embedded_set_names_the_set_not_a_file(tmp_path):
    """Sweep 2026-12-06 (seen beside F01): with no data.files it read "config.data.files:
    _collections_abc.py line 220: the prompt's 69 tokens fill data.seq_len=64"."""
    config = pairs_config(tmp_path, **{"data.files": None, "data.seq_len": 8})
    with pytest.raises(errors.ConfigError) as e:
        dpo_data.build(dpo_data.settings(config))
    first = "config.data.files unset, the embedded set: the standard library's "
    assert str(e.value).startswith(first) and "fill data.seq_len=8" in str(e.value)


def test_a_bad_pair_from_the_command_line_is_exit_2_and_one_line(tmp_path, capsys):
    files = tmp_path / "bad.jsonl"
    files.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    flags = [f"--config.data.{k}={v}" for k, v in (("files", files), ("tokenizer", PAIRS))]
    flags.append(f"--config.data.cache_dir={tmp_path / 'cache'}")
    code, err = run_cli(
        tmp_path / "run",
        *flags,
        capsys=capsys,
        config=f"--config={ROOT / 'configs' / 'llama3.py'}:dpo={FIXTURE}",
    )
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("mptrain: error")]
    says = "no 'rejected': a pair needs 'prompt', 'chosen' and 'rejected'"
    assert lines == [f"mptrain: error: config.data.files: {files} line 1: {says}"], err[-2000:]


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("dpo.loss", "kto", "dpo.loss='kto'"),
        ("dpo.beta", 0.0, "dpo.beta=0.0"),
        ("dpo.reference", "adapters", "lora.rank is None"),
        ("mesh.context", 2, "mesh.context=2: a DPO run does not split"),
        ("trainer", "mptrain.train.trainer:Trainer", "data.name='dpo' trains with"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_key(tmp_path, key, value, says):
    from mptrain import config as config_lib

    config = pairs_config(tmp_path, **{key: value})
    with pytest.raises(errors.ConfigError) as e:
        config_lib.validate(config)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_dpo_runs_prompts_are_read_with_the_tokenizer_and_template_of_its_pairs(tmp_path):
    """Sweep 2026-12-06, X20: `python -m mptrain.generate --workdir` of a DPO run reads prompts
    as the run read its pairs (it once said the run had no tokenizer, as SFT's answer)."""
    from mptrain.data import codec

    config = pairs_config(tmp_path, "chats")
    found, pairs = codec.of_run(config), dpo_data.settings(config).base
    assert found.template == pairs.template and found.tokens == pairs.tokens
    assert pairs.eos_id in found.stop_ids
    text = found.prompt([{"role": "user", "content": "Capital of France?"}])
    tokenizer = sft.tokenizer_of(pairs.tokenizer)
    assert found.encode(text, False) == tokenizer.encode(text, add_special_tokens=False).ids


def test_pairs_all_dropped_as_too_long_name_the_length_not_the_eval_split(tmp_path):
    """Sweep 2026-12-06, D14: every pair longer than the row under `data.too_long='drop'` once
    read "data.eval_fraction=0.34: of 0 pairs it holds out 0"."""
    config = pairs_config(tmp_path, **{"data.too_long": "drop", "data.seq_len": 4})
    with pytest.raises(errors.ConfigError) as e:
        dpo_data.build(dpo_data.settings(config))
    message = str(e.value)
    assert "data.too_long='drop'" in message and "data.seq_len=4" in message, message
    assert "eval_fraction" not in message and "\n" not in message


@pytest.mark.parametrize(
    "damage, says",
    [
        ("gone", "is gone"),
        ("cut", "is damaged (Expecting"),
        ("half", "it holds sums of shape [3, 2], the run's 6 pairs take [6, 2]"),
        ("one value", "its sums do not match their CRC-32"),
    ],
)
def test_the_workdirs_reference_is_checked_before_a_resume_trusts_it(tmp_path, damage, says):
    """Sweep 2026-12-06, D33, D34b, D34c: `dpo_reference.json` cut mid-number (once a 50-line
    traceback), holding half the pairs (an IndexError), or with one value changed (trusted, and
    the run went on onto another reference): one line naming the file."""
    kept = tmp_path / dpo.WORKDIR_FILE
    logps = -np.arange(1, 13, dtype=np.float32).reshape(6, 2) * 1.37
    dpo._keep(kept, "a model", logps)
    np.testing.assert_array_equal(dpo._kept(kept, 6), logps)
    saved, text = json.loads(kept.read_text()), kept.read_text()
    if damage == "gone":
        kept.unlink()
    elif damage == "cut":
        kept.write_text(text[: text.index("]") - 3])
    elif damage == "half":
        kept.write_text(json.dumps({**saved, "logps": saved["logps"][:3]}))
    else:
        saved["logps"][2][1] += 1.0
        kept.write_text(json.dumps(saved))
    with pytest.raises(errors.ConfigError) as e:
        dpo._kept(kept, 6)
    message = str(e.value)
    assert message.startswith(f"dpo.reference='precomputed': {kept} ") and says in message
    assert message.endswith("start a new --workdir") and "\n" not in message


def test_label_smoothing_under_a_loss_without_it_is_warned_about(tmp_path):
    """Sweep 2026-12-06, D24: dpo.label_smoothing=0.2 with dpo.loss='hinge' was taken silently."""
    from mptrain import unused

    said = lambda loss: unused.settings(
        pairs_config(tmp_path, **{"dpo.loss": loss, "dpo.label_smoothing": 0.2})
    )
    want = "dpo.label_smoothing=0.2: no effect, dpo.loss='hinge' has no label smoothing"
    assert [line for line in said("hinge") if line.startswith(want)], said("hinge")
    assert not [line for line in said("robust") if "label_smoothing" in line]


def test_a_resume_with_another_reference_is_refused_naming_dpo_reference():
    """Sweep 2026-12-06, D36/D37: precomputed <-> copy was refused with ~900 characters about
    model_state['dpo_reference'] tensors that never named dpo.reference."""
    from mptrain.train import checkpoint_meta

    saved = {"model": {"name": "llama"}, "dpo": {"reference": "precomputed"}}
    meta = {"step": 2, "config": saved, "policy": "fp32"}
    asked = {"model": {"name": "llama"}, "dpo": {"reference": "copy"}, "num_train_steps": 4}
    with pytest.raises(errors.ConfigError, match=r"^config\.dpo\.reference='copy': .* "):
        checkpoint_meta.check_resumable(meta, "fp32", asked, "in runs/x")
    same = {**asked, "dpo": {"reference": "precomputed", "beta": 0.2}}
    checkpoint_meta.check_resumable(meta, "fp32", same, "in runs/x")  # beta: said, taken


def test_a_key_changed_at_a_resume_is_one_warning(caplog):
    """Sweep 2026-12-06, D35: a dpo.beta changed between a run and its resume was logged at
    INFO, twice (the early check before the state is built, then the resume's)."""
    from mptrain.train import checkpoint_meta

    saved = {"model": {"name": "llama"}, "dpo": {"beta": 0.1}}
    meta = {"step": 2, "config": saved, "policy": "fp32"}
    asked = {"model": {"name": "llama"}, "dpo": {"beta": 0.2}, "num_train_steps": 4}
    with caplog.at_level(logging.INFO):
        checkpoint_meta.check_resumable(meta, "fp32", asked, "in runs/x", tell=False)  # early
        checkpoint_meta.check_resumable(meta, "fp32", asked, "in runs/x")  # the resume's
    said = [r for r in caplog.records if "config.dpo.beta changed" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert (
        said[0]
        .getMessage()
        .endswith(
            "config.dpo.beta changed since the checkpoint: 0.1 -> 0.2; the run goes on with 0.2"
        )
    )


def test_pairs_whose_completions_hold_user_turns_are_counted_in_a_warning(tmp_path, caplog):
    """Sweep 2026-12-06, D07/D08/D13: conversations parting at a user turn trained the user's
    question as completion without a word (TRL does the same)."""
    turn = lambda role, text: {"role": role, "content": text}
    files = tmp_path / "parted.jsonl"
    good = (PAIRS / "chats.jsonl").read_text()
    parted = {
        "chosen": [turn("system", "Be brief."), turn("user", "a?"), turn("assistant", "b")],
        "rejected": [turn("system", "Be brief."), turn("user", "x?"), turn("assistant", "c")],
    }
    files.write_text(good + json.dumps(parted) + "\n" + good)
    config = pairs_config(tmp_path, **{"data.files": str(files)})
    with caplog.at_level(logging.WARNING):
        dpo_data.create_sources(config)
    assert "data: dpo: 1 pairs' completions hold turns other than the assistant's" in caplog.text
