"""Rewards for GRPO (`mptrain.data.rewards`, issue 71): TRL's signature, the built-ins against
TRL's own examples, and every way a reward can be wrong as one line naming it."""

import numpy as np
import pytest

from mptrain.data import rewards

TRL_THINK = [  # TRL's docstring example of think_format_reward, and its tests' edge cases
    ("<think>\nThis is my reasoning.\n</think>\nThis is my answer.", 1.0),
    ("<think>\nThis is my reasoning.\nThis is my answer.", 0.0),
    ("<think>a</think><think>b</think>", 0.0),  # a second <think>
    ("Before <think>a</think>", 0.0),
    ("<think></think>", 1.0),
]


def _load(*specs, weights=None, length=100, cache=20):
    return rewards.load(list(specs), weights, length, cache)


def test_think_format_is_trls_pattern_on_plain_and_conversational_completions():
    texts, want = zip(*TRL_THINK, strict=True)
    assert rewards.think_format_reward(list(texts)) == list(want)
    chats = [[{"role": "assistant", "content": t}] for t in texts]
    assert rewards.think_format_reward(chats) == list(want)


def test_soft_overlong_is_trls_on_its_example_and_at_its_edges():
    (reward,) = _load("soft_overlong_punishment_reward", length=100, cache=20)
    lengths = [80, 90, 100, 101, 1]  # TRL's docstring: 90 of 100 with a cache of 20 -> -0.5
    got = reward.function(completion_ids=[[1] * n for n in lengths])
    assert got == [0.0, -0.5, -1.0, -1.0, 0.0] and reward.name == "soft_overlong_punishment_reward"


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("so 3 + 4 = 7.\n#### 7", "Natalia sold 48/2 = 24 clips.\n#### 72", 0.0),
        ("She sold 72 clips.", "#### 72", 1.0),  # the last number
        ("#### 1,000", "#### 1000", 1.0),  # commas
        ("the answer is 12.0", "12", 1.0),
        ("#### 5 then 6", "#### 5", 1.0),  # GSM8K's mark before the last number
        ("no number", "no number ", 1.0),  # texts, stripped
        ("-3", "#### -3", 1.0),
        ("anything", None, None),  # no answer: no opinion
    ],
)
def test_answer_match_reads_gsm8k_marks_then_the_last_number(completion, answer, want):
    assert rewards.answer_match_reward([completion], answer=[answer]) == [want]


def test_a_module_function_is_called_with_trls_keywords_and_none_is_nan(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def length(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    return [None if a == 'skip' else float(len(c)) for c, a in zip(completions, answer)]\n"
    )
    funcs = _load(f"{path}:length", "think_format_reward", weights=[0.5, 2.0])
    assert [(r.name, r.weight) for r in funcs] == [("length", 0.5), ("think_format_reward", 2.0)]
    got = rewards.score(
        funcs, ["p", "p"], ["ab", "<think>x</think>y"], [[1, 2], [3]], {"answer": ["a", "skip"]}
    )
    np.testing.assert_array_equal(got, np.array([[2.0, 0.0], [np.nan, 1.0]], np.float32))


@pytest.mark.parametrize(
    "specs, weights, says",
    [
        ([], None, "grpo.reward_funcs=[]: a reward's name"),
        (["nowhere_module:f"], None, "nowhere_module does not import (No module named"),
        (["json:no_such"], None, "json has no function 'no_such'"),
        (["think"], None, "'think': neither a built-in"),
        (["think_format_reward"], [1.0, 2.0], "grpo.reward_weights=[1.0, 2.0]: one number a"),
        (["think_format_reward"], ["x"], "'x' is no finite number"),
        (["think_format_reward", "think_format_reward"], None, "two rewards are named alike"),
        (["soft_overlong_punishment_reward"], None, "grpo.soft_punish_cache=0: the penalty"),
    ],
)
def test_a_reward_that_cannot_load_is_one_line_naming_it(specs, weights, says):
    with pytest.raises(rewards.RewardError) as e:
        rewards.load(specs, weights, 100, 0)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_module_that_fails_on_import_is_named_with_its_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(rewards.RewardError, match=r"broken.py does not import \(no GPU here\)"):
        _load(f"{path}:f")


@pytest.mark.parametrize(
    "body, says",
    [
        ("raise KeyError('answer')", "raised KeyError: 'answer'"),
        ("return [1.0]", "returned 1 values for 2 completions"),
        ("return 1.0", "returned float, not a list of 2 values"),
        ("return ['1', 2.0]", "returned '1' for completion 0: a number or None"),
    ],
)
def test_a_reward_that_fails_on_a_batch_is_one_line_naming_it(tmp_path, body, says):
    (tmp_path / "bad_reward.py").write_text(f"def bad(completions, **kwargs):\n    {body}\n")
    funcs = _load(f"{tmp_path / 'bad_reward.py'}:bad")
    with pytest.raises(rewards.RewardError) as e:
        rewards.score(funcs, ["p", "q"], ["a", "b"], [[1], [2]], {})
    assert str(e.value) == f"grpo.reward_funcs: bad {says}"
