"""Supervised fine-tuning examples as token ids and the tokens that carry the loss.

Two forms of example, each a JSON object (a line of a `.jsonl` file):

  * a conversation, `{"messages": [{"role": "system" | "user" | "assistant" | "tool",
    "content": ...}, ...]}` (the OpenAI and HuggingFace form), rendered by a chat template, with
    the line's `tools` (a list of function schemas) if it has them;
  * a pair, `{"prompt": ..., "completion": ...}`: the prompt's text then the completion's,
    and the end-of-text token.

A chat template is Jinja2 text, as a HuggingFace folder's `tokenizer_config.json` carries it
(`chat_template`), rendered as `transformers` renders it (`mptrain.data.template`: a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, `raise_exception()` to refuse a
conversation, `bos_token`/`eos_token` from the folder's config, `tools`, and the messages as
they are, an assistant's `tool_calls` and a tool's `tool_call_id` included), within bounds on
its time and on what it makes. A message's content is a string, or OpenAI's list of parts whose
text parts are read as their texts joined by newlines (as vLLM reads them for a text model);
a part of another type (an image) is refused. `tool_calls` or `tools` that a template never
reads are refused rather than dropped. `BUILTIN` names templates for folders that carry none:
`"llama3"`, Llama 3's header-and-end-of-turn layout.

The loss falls on what the model should learn to say: each assistant turn's text and the
template's end of that turn (so that it learns to stop), or a pair's completion and its
end-of-text token; the rest (system, user, tool, the template's headers) gets no loss unless
`train_on_prompt`. A template with `{% generation %}` ... `{% endgeneration %}` blocks (what
TRL asks of templates for assistant-only loss, and transformers tracks) decides itself: the
text of its blocks carries the loss. Otherwise the assistant turns are found by rendering:
the conversation up to an assistant turn, with the template's generation prompt, is where its
text starts, and the conversation through that turn is where it ends; each render must be a
prefix of the whole one (a template for which it is not is refused). A token carries the
loss where its first character falls in such a span (`tokenizers`' offsets).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mptrain.data import template as templates
from mptrain.data.template import Template

ROLES = ("system", "user", "assistant", "tool")
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


# a conversation with no template to render it (`data.chat_template` None and no folder's)
NO_TEMPLATE = (
    "a conversation, and no chat template to render it: data.chat_template is None and the "
    "tokenizer's folder has none (no chat_template in a tokenizer_config.json beside its "
    "tokenizer.json); set data.chat_template to a built-in name ({names}) or a template's text"
)


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


def _template(template: Template | str) -> Template:
    """A template's text is a `Template` under the default bounds."""
    return template if isinstance(template, Template) else Template(template)


def render(template: Template | str, messages: list, add_generation_prompt: bool = False,
           tools: list | None = None, **tokens) -> str:  # fmt: skip
    """The text of `messages` under `template` (`tokens`: `bos_token`, `eos_token`); a
    `ValueError` names the template and why it does not render them."""
    context = _context(messages, add_generation_prompt, tools, tokens)
    return templates.render(_template(template), **context)


def _context(messages: list, add_generation_prompt: bool, tools: list | None, tokens: dict):
    """What a template renders from, as transformers hands it over (`tools` where given)."""
    context = {"messages": messages, "add_generation_prompt": add_generation_prompt, **tokens}
    return context | ({"tools": tools} if tools else {})


def _text_of_parts(i: int, parts: list) -> str:
    """OpenAI's content parts as their text (the module doc)."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f"message {i}: a content part of type {kind!r}; a text model reads "
                "[{'type': 'text', 'text': ...}] parts only"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages: Any, need_assistant: bool = True) -> list[dict]:
    """`messages` as a template reads them: a list of `{"role", "content"}` with known roles,
    each content a string (text parts joined; an assistant's content may be empty beside its
    `tool_calls`), and an assistant turn (for training; a prompt to answer needs none); else a
    `ValueError` saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"message {i} has no 'role'")
        if message["role"] not in ROLES:
            raise ValueError(f"message {i}: role {message['role']!r} is not one of {ROLES}")
        calls, content = message.get("tool_calls"), message.get("content")
        if calls is not None and not (isinstance(calls, list) and all(map(_is_dict, calls))):
            raise ValueError(f"message {i}: 'tool_calls' must be a list of objects")
        if isinstance(content, list):
            message = {**message, "content": _text_of_parts(i, content)}
        elif not isinstance(content, str) and not (calls and content is None):
            raise ValueError(f"message {i}: 'content' must be a string or a list of text parts")
        out.append(message)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant turn: nothing to learn from")
    return out


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def _check_read(template: Template, messages: list, tools: Any) -> None:
    """Refuses `tool_calls` or `tools` that `template` never reads (they would be dropped)."""
    for i, message in enumerate(messages):
        if message.get("tool_calls") and "tool_calls" not in template.text:
            raise ValueError(
                f"message {i} has 'tool_calls', and the chat template ({template.source}) never "
                "reads 'tool_calls': they would be dropped from what trains; use a template "
                "that renders them"
            )
    if tools and "tools" not in template.text:
        raise ValueError(
            f"the line has 'tools', and the chat template ({template.source}) never reads "
            "'tools': they would be dropped from what trains; use a template that renders them"
        )


def conversation_spans(template: Template | str, messages: list, tools: list | None = None,
                       **tokens) -> tuple[str, list]:  # fmt: skip
    """The rendered conversation and the `(start, end)` character spans of its assistant
    turns, each with the template's end of that turn (see the module doc); or, for a template
    with `{% generation %}` blocks, the spans those mark."""
    template = _template(template)
    if templates.has_generation(template):
        text, spans = templates.render_marked(template, **_context(messages, False, tools, tokens))
        if not spans:
            raise ValueError(
                f"the chat template ({template.source}) has generation blocks, and none marks "
                "a turn of this conversation: nothing to learn from"
            )
        return text, spans
    text = render(template, messages, tools=tools, **tokens)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(template, messages[:k], add_generation_prompt=True, tools=tools, **tokens)
        through = render(template, messages[: k + 1], tools=tools, **tokens)
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template renders a conversation's first turns other than the whole "
                "conversation begins: its assistant turns cannot be found"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode(example: Any, tokenizer: Any, template: Template | str | None, eos_id: int,
           train_on_prompt: bool = False, **tokens) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`(ids, loss)` of one example (see the module doc): int32 token ids and a bool per id,
    True where it carries the loss. `tokenizer`: a `tokenizers.Tokenizer`; `template`: the chat
    template (None: conversations are refused); `eos_id`: the end-of-text token a pair ends
    with. A `ValueError` says what is wrong with the example."""
    if not isinstance(example, dict):
        raise ValueError("not a JSON object")
    tools = example.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(map(_is_dict, tools))):
        raise ValueError("'tools' must be a list of objects (function schemas)")
    if "messages" in example:
        if template is None:
            raise ValueError(NO_TEMPLATE.format(names=", ".join(map(repr, BUILTIN))))
        template, messages = _template(template), check_messages(example["messages"])
        _check_read(template, messages, tools)
        text, spans = conversation_spans(template, messages, tools, **tokens)
        extra = []
    elif "prompt" in example or "completion" in example:
        prompt, completion = example.get("prompt"), example.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("'prompt' and 'completion' must both be strings")
        if tools:
            raise ValueError("a pair has 'tools', which only a conversation's template reads")
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
