"""GRPO's prompts (`mptrain.data.grpo`, issue 71): plain and conversational prompts tokenized
as TRL tokenizes them, the other fields kept for the rewards, batches of prompts a pure
function of `(seed, i)`, and every bad input one line naming it."""

import json

import ml_collections
import numpy as np
import pytest

from mptrain import config as config_lib
from mptrain import errors
from mptrain.data import chat, grpo, sft, token_cache
from mptrain.models import grpo_loss

ROWS = [{"prompt": f"Q: {k} + {k} =", "answer": str(2 * k), "level": k % 3} for k in range(12)]
CHATS = [
    {"prompt": [{"role": "user", "content": f"What is {k} + 1?"}], "answer": str(k + 1)}
    for k in range(4)
]


def _config(tmp_path, batch_size=8, grpo_keys=None, **data):
    c = config_lib.base_config()
    c.model.name, c.model.vocab_size, c.batch_size = "llama", 264, batch_size
    keys = {"name": "grpo", "prefetch": None, "cache_dir": str(tmp_path / "cache"), "seq_len": 64}
    c.data = ml_collections.ConfigDict(keys | data)
    c.grpo = ml_collections.ConfigDict({"num_generations": 4, "max_completion_length": 16})
    c.grpo.update(grpo_keys or {})
    return c


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(autouse=True)
def _fresh():
    token_cache._OPENED.clear()
    yield
    token_cache._OPENED.clear()


def test_prompts_are_tokenized_as_trl_does_and_keep_their_columns(tmp_path):
    files = [_write(tmp_path / "a.jsonl", ROWS), _write(tmp_path / "b.jsonl", CHATS)]
    train, held_out = grpo.create_sources(_config(tmp_path, files=files))
    assert held_out is None and len(train.rows) == 16  # TRL's default: no eval
    tokenizer = sft.tokenizer_of(sft.BYTES)
    plain = tokenizer.encode(ROWS[3]["prompt"], add_special_tokens=True).ids  # its BOS
    rendered = chat.render(
        sft.settings(_config(tmp_path)).template, CHATS[1]["prompt"], True,
        bos_token=sft.BYTE_SPECIALS[1], eos_token=sft.BYTE_SPECIALS[0],
    )  # fmt: skip
    conversational = tokenizer.encode(rendered, add_special_tokens=False).ids
    for row, want in ((3, plain), (13, conversational)):
        n = train.rows[row, 0]
        assert train.rows[row, 1 : 1 + n].tolist() == want and not train.rows[row, 1 + n :].any()
    assert (
        train.columns[3] == {"answer": "6", "level": 0} and train.prompts[13] == CHATS[1]["prompt"]
    )
    batch = train.get_batch(5)  # 8 completions of 4 generations: 2 prompts a batch
    assert batch["prompt_ids"].shape == (2, train.rows.shape[1] - 1)
    again = grpo.create_sources(_config(tmp_path, files=files))[0].get_batch(5)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)  # from (seed, i) alone


def test_eval_prompts_come_from_their_own_files(tmp_path):
    train_file, eval_file = _write(tmp_path / "t.jsonl", ROWS), _write(tmp_path / "e.jsonl", CHATS)
    config = _config(tmp_path, files=train_file, eval_files=eval_file)
    train, held_out = grpo.create_sources(config)
    assert (len(train.rows), len(held_out.rows)) == (12, 4)
    assert held_out.columns == [{"answer": c["answer"]} for c in CHATS]


@pytest.mark.parametrize(
    "rows, keys, says",
    [
        (
            [{"question": "x"}],
            {},
            "line 1: no 'prompt' (a text, or a list of messages) among ['question']",
        ),
        ([{"prompt": ""}], {}, "line 1: no 'prompt'"),
        ([{"prompt": "x" * 60}], {}, "line 1: the prompt's 60 tokens leave no room for its"),
        (ROWS[:3], {"eval_fraction": 0.1}, "of 3 prompts it holds out 0"),
        (ROWS, {"seq_len": 16}, "data.seq_len=16 with grpo.max_completion_length=16"),
        (ROWS, {"prompt_field": 3}, "data.prompt_field=3: must be a field's name"),
    ],
)
def test_a_bad_prompt_or_setting_is_one_line_naming_it(tmp_path, rows, keys, says):
    files = None if rows is None else _write(tmp_path / "p.jsonl", rows)
    with pytest.raises(errors.ConfigError) as e:
        grpo.create_sources(_config(tmp_path, files=files, **keys))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "batch_size, keys, says",
    [
        (8, {"num_generations": 1}, "grpo.num_generations=1: must be an integer >= 2"),
        (6, {}, "batch_size=6 with grpo.num_generations=4: the batch counts completions"),
        (8, {"loss_type": "ppo"}, "grpo.loss_type='ppo': not supported; valid values: grpo"),
        (8, {"top_p": 0.0}, "grpo.top_p=0.0: must be in (0, 1]"),
        (8, {"epsilon": 1.5}, "grpo.epsilon=1.5: must be > 0 and < 1"),
    ],
)
def test_a_bad_grpo_setting_is_one_line_naming_it(batch_size, keys, says):
    with pytest.raises(ValueError, match=rf"^{__import__('re').escape(says)}"):
        grpo_loss.settings({"num_generations": 4, **keys}, batch_size)


def test_epsilon_high_defaults_to_epsilon_as_trls():
    assert grpo_loss.settings({"epsilon": 0.3}, 8)["epsilon_high"] == 0.3
    assert grpo_loss.settings({"epsilon": 0.2, "epsilon_high": 0.28}, 8)["epsilon_high"] == 0.28
