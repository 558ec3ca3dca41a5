"""Supervised fine-tuning examples (issue 44, first part): conversations rendered by a chat
template with jinja2 as HuggingFace renders them, pairs of prompt and completion, and exactly
which tokens carry the loss, against hand-labelled examples."""

import json

import numpy as np
import pytest
from helpers import EOT, make_tokenizer

from mptrain.data import chat

MARKERS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
WORDS = "what is the capital of france paris and germany berlin answer briefly you are terse"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("chat_tokenizer")
    path = make_tokenizer(
        folder, [WORDS * 20, "Q: A: ?\n\n" * 20], vocab_size=120, specials=MARKERS
    )
    return Tokenizer.from_file(str(path))


def _carrying(tokenizer, ids, loss) -> str:
    return tokenizer.decode([int(i) for i in ids[loss]], skip_special_tokens=False)


def test_a_pair_carries_the_loss_on_its_completion_and_end_of_text_only(tokenizer):
    eot = tokenizer.token_to_id(EOT)
    example = {"prompt": "Q: what is the capital of france?\nA:", "completion": " paris"}
    ids, loss = chat.encode(example, tokenizer, None, eot)
    assert ids.dtype == np.int32 and ids[-1] == eot and loss[-1]
    # hand-labelled: " paris" and the end-of-text token, nothing of the prompt
    assert _carrying(tokenizer, ids, loss) == " paris" + EOT
    prompt_tokens = len(tokenizer.encode(example["prompt"], add_special_tokens=False).ids)
    assert not loss[:prompt_tokens].any() and loss[prompt_tokens:].all()
    ids, everything = chat.encode(example, tokenizer, None, eot, train_on_prompt=True)
    assert everything.all()


def test_a_multi_turn_conversation_carries_the_loss_on_the_assistant_turns_only(tokenizer):
    messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "what is the capital of france?"},
        {"role": "assistant", "content": "paris"},
        {"role": "user", "content": "and germany?"},
        {"role": "assistant", "content": "berlin"},
    ]
    template = chat.template_of("llama3")
    ids, loss = chat.encode({"messages": messages}, tokenizer, template, 0, **TOKENS)
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nyou are terse<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nwhat is the capital of france?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nparis<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nand germany?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nberlin<|eot_id|>"
    )
    # hand-labelled: each answer and the end of its turn; no header, system or user token
    eot = tokenizer.token_to_id("<|eot_id|>")
    runs = np.split(ids[loss], np.flatnonzero(ids[loss] == eot)[:-1] + 1)
    assert [tokenizer.decode([int(i) for i in r], skip_special_tokens=False) for r in runs] == [
        "paris<|eot_id|>",
        "berlin<|eot_id|>",
    ]
    assert int(loss.sum()) == sum(
        len(tokenizer.encode(t, add_special_tokens=False).ids)
        for t in ("paris<|eot_id|>", "berlin<|eot_id|>")
    )


def test_the_template_of_a_folder_is_its_tokenizer_config_chat_template(tmp_path):
    config = {"chat_template": chat.BUILTIN["llama3"], **TOKENS}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    read = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert chat.template_of("folder", read) == chat.BUILTIN["llama3"]
    listed = {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default",
              "template": chat.BUILTIN["llama3"]}]}  # fmt: skip
    assert chat.template_of("folder", listed) == chat.BUILTIN["llama3"]
    with pytest.raises(ValueError, match="^data.chat_template='folder': .* no chat_template"):
        chat.template_of("folder", {"eos_token": EOT})
    with pytest.raises(ValueError, match="^data.chat_template='chatml': not a template"):
        chat.template_of("chatml")


def test_a_folder_template_that_is_no_text_is_named_with_its_file(tmp_path):
    """Sweep 2026-12-06, H79: `"chat_template": 42` in a folder's tokenizer_config.json, and
    no `data.chat_template` set, once read "data.chat_template='folder': ... has none"."""
    from mptrain.data import sft

    tokenizer = str(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError) as e:
        sft.folder_template({"chat_template": 42}, tokenizer)
    message = str(e.value)
    assert message.startswith(f"the chat_template of {tmp_path / 'tokenizer_config.json'} is 42")
    assert "not a template's text" in message and "data.chat_template" not in message


@pytest.mark.parametrize(
    "example, says",
    [
        ({"messages": [{"content": "hi"}]}, "message 0 has no 'role'"),
        ({"messages": [{"role": "tolk", "content": "hi"}]}, "role 'tolk' is not one of"),
        ({"messages": [{"role": "user", "content": None}]}, "'content' must be a string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "message 0: a content part of type 'image_url'; a text model reads",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "'tool_calls' must be a list"),
        ({"prompt": "a", "completion": "b", "tools": [{}]}, "a pair has 'tools'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": []}, "non-empty list"),
        ({"prompt": "hi"}, "'prompt' and 'completion' must both be strings"),
        ({"text": "hi"}, "neither 'messages' nor 'prompt' and 'completion'"),
        (["not", "an", "object"], "not a JSON object"),
    ],
)
def test_a_bad_example_says_what_is_wrong(tokenizer, example, says):
    with pytest.raises(ValueError, match=says):
        chat.encode(example, tokenizer, chat.BUILTIN["llama3"], 0, **TOKENS)


def test_a_template_that_refuses_a_conversation_says_so(tokenizer):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    messages = [{"role": "assistant", "content": "hi"}]
    with pytest.raises(
        ValueError, match=r"the chat template \(.*\) does not render it: user first"
    ):
        chat.encode({"messages": messages}, tokenizer, strict + "x", 0)


# A template that renders tool calls and tools (the shape of Qwen 2.5's and Llama 3.1's).
TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}; {% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)
CALL = {"type": "function", "function": {"name": "capital", "arguments": {"of": "france"}}}
TOOLS = [{"type": "function", "function": {"name": "capital", "parameters": {}}}]


def test_tool_calls_and_tools_reach_the_template_and_the_call_carries_the_loss(tokenizer):
    messages = [
        {"role": "user", "content": "what is the capital of france?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "paris", "tool_call_id": "0"},
        {"role": "assistant", "content": "paris"},
    ]
    example = {"messages": messages, "tools": TOOLS}
    ids, loss = chat.encode(example, tokenizer, TOOL_TEMPLATE, 0)
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    assert text == (
        "tools: capital; "
        "<|start_header_id|>user<|end_header_id|>what is the capital of france?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>call capital{"of": "france"}<|eot_id|>'
        "<|start_header_id|>tool<|end_header_id|>paris<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>paris<|eot_id|>"
    )
    # hand-labelled: the call and the answer, each with its end of turn; not the tool's result
    assert (
        _carrying(tokenizer, ids, loss) == 'call capital{"of": "france"}<|eot_id|>paris<|eot_id|>'
    )


def test_tool_calls_or_tools_a_template_never_reads_are_refused_not_dropped(tokenizer):
    call = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
    ]
    llama3 = chat.template_of("llama3")
    with pytest.raises(ValueError, match=r"^message 1 has 'tool_calls', and the chat template"):
        chat.encode({"messages": call}, tokenizer, llama3, 0, **TOKENS)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match="^the line has 'tools', and the chat template"):
        chat.encode({"messages": plain, "tools": TOOLS}, tokenizer, llama3, 0, **TOKENS)


def test_openai_text_parts_read_as_their_text_joined_by_newlines(tokenizer):
    parts = [
        {"type": "text", "text": "what is the capital"},
        {"type": "text", "text": "of france?"},
    ]
    said = [{"role": "user", "content": parts}, {"role": "assistant", "content": [parts[1]]}]
    plain = [
        {"role": "user", "content": "what is the capital\nof france?"},
        {"role": "assistant", "content": "of france?"},
    ]
    template = chat.template_of("llama3")
    got = chat.encode({"messages": said}, tokenizer, template, 0, **TOKENS)
    want = chat.encode({"messages": plain}, tokenizer, template, 0, **TOKENS)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


# TRL's form of a template for assistant-only loss: what the assistant says is wrapped in
# `{% generation %}` blocks, the end of its turn inside them, the header outside.
MARKED = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)


def test_generation_blocks_decide_which_tokens_carry_the_loss(tokenizer):
    messages = [
        {"role": "user", "content": "what is the capital of france?"},
        {"role": "assistant", "content": "paris"},
        {"role": "user", "content": "and germany?"},
        {"role": "assistant", "content": "berlin"},
    ]
    ids, loss = chat.encode({"messages": messages}, tokenizer, MARKED, 0)
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
    assert "\ue000" not in text and text.count("<|start_header_id|>assistant") == 2
    # hand-labelled: the two blocks, their ends of turn in, the headers out
    assert _carrying(tokenizer, ids, loss) == "paris<|eot_id|>berlin<|eot_id|>"
    # a prompt to answer renders without the blocks' marks
    prompt = chat.render(MARKED, messages[:1], add_generation_prompt=True)
    assert prompt == (
        "<|start_header_id|>user<|end_header_id|>what is the capital of france?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>"
    )
    with pytest.raises(ValueError, match="has generation blocks, and none marks a turn"):
        chat.encode(
            {"messages": messages}, tokenizer, MARKED.replace("'assistant' %}", "'x' %}", 1), 0
        )


def test_a_conversation_with_no_template_names_the_folder_s_and_the_key(tokenizer):
    """Sweep 2026-12-06, H73: a folder without tokenizer_config.json read "a conversation, and
    data.chat_template is None", as though the key alone were missing."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ValueError) as e:
        chat.encode({"messages": messages}, tokenizer, None, 0)
    assert "the tokenizer's folder has none (no chat_template in a tokenizer_config.json" in str(
        e.value
    ) and "data.chat_template to a built-in name ('llama3'" in str(e.value)
