"""SFT data (`data.name="sft"`, issue 44): examples from files or the embedded set, encoded,
packed and cached once; batches a pure function of (seed, i); real tokens counted; bad input
one line naming the file, the line and what is wrong, with nothing written. No compiles."""

import hashlib
import json
import logging
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from helpers import ROOT, load_config

from mptrain import config as config_lib
from mptrain import errors
from mptrain.data import packing, sft, token_cache

PAIRS = [
    {"prompt": f"Q{k}: what is {k} + {k}?\n", "completion": f"A: {2 * k}, of course." * (k % 3 + 1)}
    for k in range(30)
]
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": f"Name {k}?"},
            {"role": "assistant", "content": f"It is {k}."},
            {"role": "user", "content": "And twice that?"},
            {"role": "assistant", "content": f"{2 * k}."},
        ]
    }
    for k in range(10)
]


def _config(tmp_path, **data):
    c = config_lib.base_config()
    c.model.name, c.model.vocab_size, c.batch_size = "llama", 264, 4
    keys = {"name": "sft", "prefetch": None, "cache_dir": str(tmp_path / "cache"), "seq_len": 64}
    c.data = ml_collections.ConfigDict(keys | data)
    return c


def _write(path, examples):
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return str(path)


@pytest.fixture(autouse=True)
def _fresh():
    token_cache._OPENED.clear()  # each test a new process, as far as the cache goes
    yield
    token_cache._OPENED.clear()


def test_rows_hold_each_example_once_with_its_own_positions_and_loss(tmp_path):
    files = [_write(tmp_path / "pairs.jsonl", PAIRS), _write(tmp_path / "chats.jsonl", CHATS)]
    config = _config(tmp_path, files=files, eval_fraction=0.1, seq_len=256)
    train, evaluation = sft.create_sources(config)
    rows = np.concatenate([train.rows, evaluation.rows])
    inputs, targets, segments, positions = (rows[:, k] for k in range(4))
    examples = sft.encoded(sft.settings(config))
    assert sum(len(np.unique(s[s > 0])) for s in segments) == len(examples) == 40
    for row in range(len(rows)):  # positions count from 0 in each segment; padding is all 0
        for seg in np.unique(segments[row]):
            at = segments[row] == seg
            want = np.arange(at.sum()) if seg else np.zeros(at.sum())
            np.testing.assert_array_equal(positions[row][at], want)
        pad = segments[row] == 0
        assert (inputs[row][pad] == 0).all() and (targets[row][pad] == -1).all()
    # every example's ids and loss are in some segment as encoded
    found = sorted(
        (tuple(inputs[r][segments[r] == s]), tuple(targets[r][segments[r] == s]))
        for r in range(len(rows))
        for s in np.unique(segments[r][segments[r] > 0])
    )
    want = sorted(
        (tuple(ids[:-1]), tuple(np.where(loss[1:], ids[1:], -1))) for ids, loss in examples
    )
    assert found == want
    assert len(evaluation.rows) and train.num_batches == -(-len(train.rows) // 4)


def test_the_embedded_set_packs_to_at_least_85_percent_real_tokens_at_512(tmp_path):
    config = _config(tmp_path, seq_len=512)
    s = sft.settings(config)
    _, record = sft.rows_of(s)
    stats = record["sft"]["train"]
    rate = stats["real_tokens"] / (stats["rows"] * 512)
    assert stats["examples"] > 4000 and rate >= 0.85, stats
    assert stats["truncated"] == stats["dropped"] == 0  # every pair fits a row
    unpacked = sft.settings(_config(tmp_path, seq_len=512, packing=False))
    rows_unpacked, record_unpacked = sft.rows_of(unpacked)
    assert record_unpacked["sft"]["train"]["real_tokens"] == stats["real_tokens"]
    examples = stats["examples"] + record["sft"]["eval"]["examples"]
    assert len(rows_unpacked) == examples  # one a row
    print(f"embedded set: {stats['examples']} examples, real-token rate {rate:.1%} packed")


def test_the_rows_are_the_same_bytes_from_the_same_file_on_any_machine(tmp_path):
    """First-fit decreasing and the byte tokenizer are pure Python and Rust with no hashing of
    their own: the rows of a fixed file hash the same everywhere (a pinned digest)."""
    path = _write(tmp_path / "pairs.jsonl", PAIRS + CHATS)
    s = sft.settings(_config(tmp_path, files=path, eval_fraction=0.1, seq_len=256))
    rows, _ = sft.build(s)
    again, _ = sft.build(s)
    np.testing.assert_array_equal(rows, again)
    digest = hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()[:16]
    assert (rows.shape, digest) == ((12, 4, 256), "6539dcb4b925ae49"), (rows.shape, digest)


def test_batch_i_is_a_pure_function_of_seed_and_i_and_each_epoch_sees_every_row(tmp_path):
    rows = np.arange(10 * 4 * 8, dtype=np.int32).reshape(10, 4, 8)
    rows[:, 2] = 1
    one, two = packing.PackedSource(rows, 4, seed=3), packing.PackedSource(rows, 4, seed=3)
    for i in (0, 7, 2, 12):  # any order, any object
        for key, value in one.get_batch(i).items():
            np.testing.assert_array_equal(value, two.get_batch(i)[key])
    seen = np.concatenate([one.indices(i) for i in range(5)])  # 20 rows: two epochs
    assert sorted(seen[:10]) == sorted(seen[10:]) == list(range(10))
    assert list(seen[:10]) != list(seen[10:])  # a new order each epoch
    assert list(packing.PackedSource(rows, 4, seed=4).indices(0)) != list(one.indices(0))
    evaluation = packing.PackedSource(rows, 4, random=False)
    assert [list(evaluation.indices(i)) for i in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]
    assert one.get_batch(1, rows=slice(2, 4))["inputs"].shape == (2, 8)  # a process's rows


def test_real_tokens_count_segments_not_padding(tmp_path):
    rows = np.zeros((6, 4, 8), np.int32)
    for r in range(6):
        rows[r, 2, : r + 1] = 1  # row r holds r + 1 real tokens
    source = packing.PackedSource(rows, 2, seed=0)
    want = sum(rows[source.indices(i), 2].astype(bool).sum() for i in range(5))
    assert source.real_tokens(0, 5) == want
    assert source.real_tokens(0, 3) == 21  # one epoch: every row once


def test_long_examples_are_cut_or_left_out_counted_and_said(tmp_path, caplog):
    long = {"prompt": "x" * 200, "completion": "y"}  # all prompt once cut to the row
    path = _write(tmp_path / "pairs.jsonl", [long, *PAIRS])
    caplog.set_level(logging.INFO)
    config = _config(tmp_path, files=path, eval_fraction=0.1, seq_len=128)
    cut = sft.create_sources(config)[0]
    assert "sft train: 1 examples longer than data.seq_len=128 were cut to it" in caplog.text
    first = cut.rows[:, 2] > 0
    whole = [r for r in range(len(cut.rows)) if (cut.rows[r, 0][first[r]] == ord("x")).all()]
    assert len(whole) == 1 and (cut.rows[whole[0], 1] == -1).all()  # it carries no loss
    caplog.clear()
    token_cache._OPENED.clear()
    config.data.too_long = "drop"
    dropped = sft.create_sources(config)
    assert "1 examples longer than data.seq_len=128 were left out" in caplog.text
    assert not any((row == ord("x")).all() for row in dropped[0].rows[:, 0])


@pytest.mark.parametrize("form", ["pairs", "chats"])
def test_a_run_where_no_token_carries_the_loss_is_refused(tmp_path, form):
    examples = [{"prompt": "x" * 100, "completion": "y"}] * 20 if form == "pairs" else CHATS * 2
    path = _write(tmp_path / "data.jsonl", examples)  # each cut to its prompt or its headers
    seq_len = 64 if form == "pairs" else 30
    with pytest.raises(errors.ConfigError) as e:
        sft.create_sources(_config(tmp_path, files=path, eval_fraction=0.1, seq_len=seq_len))
    assert str(e.value).startswith(
        f"config.data.seq_len={seq_len}: no train token carries the loss; every train example "
        "was cut to data.seq_len before its answer began"
    )


def test_the_rows_are_built_once_and_reused(tmp_path, caplog):
    path = _write(tmp_path / "pairs.jsonl", PAIRS)
    config = _config(tmp_path, files=path, eval_fraction=0.1)
    caplog.set_level(logging.INFO)
    first = sft.create_sources(config)[0].rows
    token_cache._OPENED.clear()
    second = sft.create_sources(config)[0].rows
    np.testing.assert_array_equal(first, second)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert lines[0].startswith("data: packed 30 examples of 1 files in ")
    assert any(line.startswith("data: reusing the packed SFT rows: ") for line in lines)
    # a changed setting is another cache file
    token_cache._OPENED.clear()
    sft.create_sources(_config(tmp_path, files=path, eval_fraction=0.1, train_on_prompt=True))
    assert len(list((tmp_path / "cache").glob("sft-*.npy"))) == 2


BAD = [
    ("not json", "{nope\n", "line 2: not JSON"),
    ("no role", {"messages": [{"content": "hi"}]}, "line 2: message 0 has no 'role'"),
    (
        "unknown role",
        {"messages": [{"role": "robot", "content": "hi"}]},
        "line 2: message 0: role 'robot' is not one of",
    ),
    (
        "no assistant",
        {"messages": [{"role": "user", "content": "hi"}]},
        "line 2: no assistant turn",
    ),
    ("neither", {"text": "hi"}, "line 2: neither 'messages' nor 'prompt' and 'completion'"),
    ("not a string", {"prompt": "a", "completion": 3}, "line 2: 'prompt' and 'completion' must"),
    ("empty", {"prompt": "", "completion": ""}, "line 2: an empty example: nothing to learn"),
    (
        "both forms",
        {**CHATS[0], "prompt": "a", "completion": "b"},
        "line 2: both 'messages' and 'prompt'/'completion': a line is a conversation or a pair",
    ),
    (
        "an image",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "line 2: message 0: a content part of type 'image_url'",
    ),
    (
        "unread tool calls",
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "0"}]}]},
        "line 2: message 0 has 'tool_calls', and the chat template (the built-in 'llama3')",
    ),
]


@pytest.mark.parametrize(("case", "line", "says"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_example_is_one_line_naming_file_line_and_field_and_nothing_is_written(
    tmp_path, case, line, says
):
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps(PAIRS[0]) + "\n" + (line if isinstance(line, str) else json.dumps(line) + "\n")
    )
    with pytest.raises(errors.ConfigError) as e:
        sft.create_sources(_config(tmp_path, files=str(path)))
    message = str(e.value)
    assert message.startswith(f"config.data.files: {path} {says}"), message
    assert "\n" not in message
    assert not list((tmp_path / "cache").glob("sft-*"))  # nothing cached, no lock left


def test_an_empty_file_and_a_template_that_fails_are_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(errors.ConfigError, match=f"config.data.files: {empty} holds no example"):
        sft.create_sources(_config(tmp_path, files=str(empty)))
    chats = _write(tmp_path / "chats.jsonl", CHATS)
    broken = "{% for m in messages %}{{ m['content'] | nosuchfilter }}{% endfor %}"
    with pytest.raises(errors.ConfigError) as e:
        sft.create_sources(_config(tmp_path, files=chats, chat_template=broken))
    assert "config." in str(e.value) and "nosuchfilter" in str(e.value)
    refusing = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(errors.ConfigError) as e:
        sft.create_sources(_config(tmp_path, files=chats, chat_template=refusing))
    assert str(e.value).startswith(f"config.data.files: {chats} line 1: the chat template")
    assert "only user turns, please" in str(e.value)
    assert not list((tmp_path / "cache").glob("sft-*.npy"))


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("too_long", "wrap", "data.too_long='wrap'"),
        ("chat_template", "llama9", "data.chat_template='llama9': not a template mptrain has"),
        ("packing", "yes", "data.packing='yes': must be True or False"),
        ("files", str(ROOT / "README.md"), "is not one of the files it reads"),
        ("max_segments", 65, "data.seq_len=64 with data.max_segments=65: a row of 64 tokens"),
        ("template_max_chars", 0, "data.template_max_chars=0"),
        ("template_max_seconds", -1.0, "data.template_max_seconds=-1.0"),
    ],
)
def test_bad_settings_name_the_key(tmp_path, key, value, says):
    with pytest.raises(ValueError, match=None) as e:
        sft.settings(_config(tmp_path, **{key: value}))
    assert says in str(e.value)


def test_the_command_line_exits_2_with_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps(PAIRS[0]) + "\n" + json.dumps({"messages": [{"content": "x"}]}) + "\n"
    )
    workdir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mptrain.main",
            f"--config={ROOT / 'configs' / 'llama3.py'}:sft_tiny",
            f"--workdir={workdir}",
            f"--config.data.files={path}",
            f"--config.data.cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"{path} line 2: message 0 has no 'role'" in last, done.stderr[-2000:]
    assert not workdir.exists() and not (tmp_path / "cache").exists()


def test_the_trainers_step_reads_the_rows_positions_and_segment_ids(tmp_path):
    """The Trainer hands a batch's `positions` and `segment_ids` to the model: in the traced
    loss of `configs/llama3.py:sft_tiny` (traced, not compiled), both inputs are read."""
    import jax

    from mptrain.train import trainer as trainer_lib

    config = load_config("llama3", "sft_tiny", **{"data.cache_dir": str(tmp_path / "cache")})
    config.data.seq_len, config.data.max_segments = 32, 8
    batch = config_lib.validate(config).example  # the data's example: sft.check_config's
    batch = {k: jax.ShapeDtypeStruct((2, 32), v.dtype) for k, v in batch.items()}
    trainer = trainer_lib.Trainer(config, tmp_path / "run")
    variables = jax.eval_shape(trainer.init_variables, jax.random.key(0), batch)

    def loss(params, batch):
        return trainer.loss_fn(params, {}, batch, jax.random.key(0))[0]

    jaxpr = jax.make_jaxpr(loss)(variables["params"], batch).jaxpr
    n = len(jax.tree.leaves(variables["params"]))
    inputs = dict(zip(sorted(batch), jaxpr.invars[n:], strict=True))  # a dict's leaves: sorted
    read = {v for eqn in _equations(jaxpr) for v in eqn.invars if not hasattr(v, "val")}
    assert inputs["positions"] in read and inputs["segment_ids"] in read


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in eqn.params.values():
            inner = getattr(sub, "jaxpr", None)
            if inner is not None:
                yield from _equations(getattr(inner, "jaxpr", inner))


def test_the_runs_end_of_text_token_ends_its_answers_too(tmp_path):
    """`data.eos_token` (what the run's pairs end with) is among the tokens that stop
    `mptrain.generate` and the run's samples, besides the tokenizer's usual ones."""
    from helpers import make_tokenizer

    from mptrain.data import codec

    folder = tmp_path / "tok"
    folder.mkdir()
    make_tokenizer(folder, ["some words to train on"] * 5, specials=("<|im_end|>",))
    config = _config(tmp_path, tokenizer=str(folder), eos_token="<|im_end|>")
    end = sft.tokenizer_of(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    assert end in codec.of_run(config).stop_ids


def test_eval_fraction_0_packs_every_example_for_training_and_no_eval_source(tmp_path):
    files = [_write(tmp_path / "pairs.jsonl", PAIRS), _write(tmp_path / "chats.jsonl", CHATS)]
    config = _config(tmp_path, files=files, eval_fraction=0.0, seq_len=256)
    train, evaluation = sft.create_sources(config)
    segments = train.rows[:, 2]
    assert evaluation is None and sum(len(np.unique(s[s > 0])) for s in segments) == 40
    with pytest.raises(
        errors.ConfigError, match=r"holds out 0; .* \(0: no eval, all train; or data.eval_files"
    ):
        sft.create_sources(_config(tmp_path, files=files, eval_fraction=0.01, seq_len=256))


def test_eval_files_are_the_eval_side_whole_and_none_of_them_trains(tmp_path):
    """Issue 70: a small set trains whole, its eval examples in files of their own
    (`data.eval_files`, as TRL's eval_dataset); `data.eval_fraction` is not read then."""
    train_file = _write(tmp_path / "train.jsonl", PAIRS)
    eval_file = _write(tmp_path / "eval.jsonl", CHATS)
    config = _config(tmp_path, files=train_file, eval_files=eval_file, eval_fraction=0.5)
    config.data.seq_len = 256
    train, evaluation = sft.create_sources(config)
    examples = lambda source: sum(len(np.unique(s[s > 0])) for s in source.rows[:, 2])
    assert (examples(train), examples(evaluation)) == (30, 10)
    assert not (train.rows[:, 0] == sft.BYTE_VOCAB - 3).any()  # no chat's header in training
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 3}\n')
    with pytest.raises(errors.ConfigError, match=rf"^config.data.eval_files: {bad} line 1: "):
        sft.create_sources(_config(tmp_path, files=train_file, eval_files=str(bad)))
    with pytest.raises(ValueError, match=rf"{eval_file} is one of data.files too"):
        sft.settings(_config(tmp_path, files=str(tmp_path / "*.jsonl"), eval_files=eval_file))
    with pytest.raises(ValueError, match=r"^data.eval_files='nowhere\*': matches no file"):
        sft.settings(_config(tmp_path, eval_files="nowhere*"))
