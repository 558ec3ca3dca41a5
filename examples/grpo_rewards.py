"""A shaping reward for `configs/llama3.py:grpo_tiny`: the tiny Llama starts from its own init,
where an exact answer (`answer_match_reward`) is too rare for GRPO to learn from (a group whose
rewards are all 0 has no advantage), so a denser reward leads it to answers in digits first.

Written as any reward is (TRL's signature, `mptrain.data.rewards`): the run names it
`grpo.reward_funcs=["answer_match_reward", "examples/grpo_rewards.py:digits_reward"]`.
"""


def digits_reward(completions: list, **kwargs) -> list[float]:
    """The share of each completion's characters that are digits (0.0 for an empty one)."""
    texts = [c if isinstance(c, str) else str(c[0].get("content") or "") for c in completions]
    return [sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]
