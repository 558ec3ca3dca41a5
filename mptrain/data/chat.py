"""Supervised fine-tuning examples as token ids and the tokens that carry the loss.

Two forms of example, each a JSON object (a line of a `.jsonl` file):

  * a conversation, `{"messages": [{"role": "system" | "user" | "assistant", "content": ...},
    ...]}` (the OpenAI and HuggingFace form), rendered by a chat template;
  * a pair, `{"prompt": ..., "completion": ...}`: the prompt's text then the completion's,
    and the end-of-text token.

A chat template is Jinja2 text, as a HuggingFace folder's `tokenizer_config.json` carries it
(`chat_template`), rendered as `transformers` renders it: a sandboxed environment with
`trim_blocks` and `lstrip_blocks`, `raise_exception()` to refuse a conversation, and
`bos_token`/`eos_token` from the folder's config. `BUILTIN` names templates for folders that
carry none: `"llama3"`, Llama 3's header-and-end-of-turn layout.

The loss falls on what the model should learn to say: each assistant turn's text and the
template's end of that turn (so that it learns to stop), or a pair's completion and its
end-of-text token; the rest (system, user, the template's headers) gets no loss unless
`train_on_prompt`. The assistant turns are found by rendering: the conversation up to an
assistant turn, with the template's generation prompt, is where its text starts, and the
conversation through that turn is where it ends; each render must be a prefix of the whole
one (a template for which it is not is refused). A token carries the loss where its first
character falls in such a span (`tokenizers`' offsets).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from mptrain import errors

ROLES = ("system", "user", "assistant")
# Llama 3's layout, written for mptrain: a header per message, an end-of-turn token after each.
BUILTIN = {
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] | trim }}<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return environment.from_string(template)


def template_of(spec: str, folder_config: dict | None = None) -> str:
    """The chat template `spec` names: a name of `BUILTIN`, or `"folder"` for the one in
    `folder_config` (a `tokenizer_config.json`'s content: its `chat_template`, a string or a
    list of `{"name", "template"}` whose `"default"` is taken). A `ValueError` naming
    `data.chat_template` otherwise."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec == "folder":
        found = (folder_config or {}).get("chat_template")
        if isinstance(found, list):
            found = next((t.get("template") for t in found if t.get("name") == "default"), None)
        if isinstance(found, str) and found.strip():
            return found
        raise ValueError(
            "data.chat_template='folder': the tokenizer's folder has no chat_template in its "
            f"tokenizer_config.json; name a built-in one ({', '.join(sorted(BUILTIN))})"
        )
    raise ValueError(
        f"data.chat_template={spec!r}: not a template mptrain has; use 'folder' or one of "
        f"{', '.join(sorted(BUILTIN))}"
    )


def render(template: str, messages: list, add_generation_prompt: bool = False, **tokens) -> str:
    """The text of `messages` under `template` (`tokens`: `bos_token`, `eos_token`)."""
    from jinja2.exceptions import TemplateError

    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **tokens
        )
    except TemplateError as e:
        raise ValueError(f"the chat template does not render it: {errors.first_line(e)}") from None


def check_messages(messages: Any, need_assistant: bool = True) -> list[dict]:
    """`messages` as a conversation: a list of `{"role", "content"}` with known roles and
    string contents, and an assistant turn (for training; a prompt to answer needs none);
    else a `ValueError` saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"message {i} has no 'role'")
        if message["role"] not in ROLES:
            raise ValueError(f"message {i}: role {message['role']!r} is not one of {ROLES}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {i}: 'content' must be a string")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn: nothing to learn from")
    return messages


def conversation_spans(template: str, messages: list, **tokens) -> tuple[str, list]:
    """The rendered conversation and the `(start, end)` character spans of its assistant
    turns, each with the template's end of that turn (see the module doc)."""
    text = render(template, messages, **tokens)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(template, messages[:k], add_generation_prompt=True, **tokens)
        through = render(template, messages[: k + 1], **tokens)
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template renders a conversation's first turns other than the whole "
                "conversation begins: its assistant turns cannot be found"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode(example: Any, tokenizer: Any, template: str | None, eos_id: int,
           train_on_prompt: bool = False, **tokens) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`(ids, loss)` of one example (see the module doc): int32 token ids and a bool per id,
    True where it carries the loss. `tokenizer`: a `tokenizers.Tokenizer`; `template`: the chat
    template's text (None: conversations are refused); `eos_id`: the end-of-text token a pair
    ends with. A `ValueError` says what is wrong with the example."""
    if not isinstance(example, dict):
        raise ValueError("not a JSON object")
    if "messages" in example:
        if template is None:
            raise ValueError("a conversation, and data.chat_template is None")
        text, spans = conversation_spans(template, check_messages(example["messages"]), **tokens)
        extra = []
    elif "prompt" in example or "completion" in example:
        prompt, completion = example.get("prompt"), example.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("'prompt' and 'completion' must both be strings")
        text, spans, extra = (
            prompt + completion,
            [(len(prompt), len(prompt) + len(completion))],
            [eos_id],
        )
    else:
        raise ValueError("neither 'messages' nor 'prompt' and 'completion'")
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray([*encoding.ids, *extra], np.int32)
    if len(ids) < 2:  # no input with a target after it
        raise ValueError("an empty example: nothing to learn from")
    starts = np.asarray([start for start, _ in encoding.offsets] + [len(text)] * len(extra))
    loss = np.zeros(len(ids), bool) if not train_on_prompt else np.ones(len(ids), bool)
    for start, end in spans:
        loss |= (starts >= start) & (starts < end)
    loss[len(encoding.ids) :] = True  # a pair's end-of-text token
    return ids, loss
