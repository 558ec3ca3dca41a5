"""A run's text as a model reads and writes it, for reading what the model says
(`mptrain.generate`, the samples in a run's record): encode, decode, the tokens that end an
answer, and the chat template, all from the run's own data settings or a tokenizer's folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mptrain.data import chat, dpo, sft, template, tokenize

SFT_BYTES = "sft-bytes"  # `data.sft`'s byte tokenizer (with Llama 3's markers)


@dataclasses.dataclass(frozen=True)
class Codec:
    encode: Callable[[str, bool], list[int]]  # (text, with the tokenizer's own specials: BOS)
    decode: Callable[[list[int]], str]
    stop_ids: list[int]  # the end-of-text and end-of-turn tokens the tokenizer knows
    template: template.Template | None  # the chat template, if any
    tokens: dict  # bos_token / eos_token for the template

    def prompt(self, prompt: Any) -> str:
        """A prompt's text: a string as it is; a conversation (a list of messages) through the
        chat template, with the generation prompt. A `ValueError` says what is wrong."""
        if isinstance(prompt, str):
            return prompt
        if self.template is None:
            raise ValueError("a conversation, and the model has no chat template")
        messages = chat.check_messages(prompt, need_assistant=False)
        return chat.render(self.template, messages, add_generation_prompt=True, **self.tokens)


def of_tokenizer(
    spec: str, chat_template: template.Template | None = None, tokens: dict | None = None
) -> Codec:
    """The `Codec` of `data.tokenizer=spec`: "bytes" (the text data's bytes, no stop token),
    `SFT_BYTES`, or a tokenizer.json's path (its folder's tokenizer_config.json gives the
    template and the tokens where `template` is None)."""
    if spec == tokenize.BYTES:
        encode = lambda text, specials=False: list(text.encode("utf-8"))
        decode = lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return Codec(encode, decode, [], None, {})
    if spec != SFT_BYTES:
        spec = tokenize.tokenizer_file(spec)  # a folder: its tokenizer.json
    tokenizer = sft.tokenizer_of(tokenize.BYTES if spec == SFT_BYTES else spec)
    if chat_template is None and spec != SFT_BYTES:
        folder = sft.folder_config(spec)
        tokens = {k: sft.token_text(folder.get(k)) or "" for k in ("bos_token", "eos_token")}
        chat_template = sft.folder_template(folder, spec)
    ends = (*tokenize.EOS_TOKENS, "<|eot_id|>", (tokens or {}).get("eos_token"))
    stop = {tokenizer.token_to_id(t) for t in ends if t}
    return Codec(
        lambda text, specials=False: tokenizer.encode(text, add_special_tokens=specials).ids,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        sorted(i for i in stop if i is not None),
        chat_template,
        tokens or {},
    )


def of_run(config: Any) -> Codec:
    """The `Codec` of a run's data: `data.sft`'s tokenizer, template and tokens (a DPO run's
    pairs are read with the same), or the text data's tokenizer (bytes, or a tokenizer.json and
    its folder's template)."""
    if config.data.name in ("sft", "dpo"):
        s = sft.settings(config) if config.data.name == "sft" else dpo.settings(config).base
        spec = SFT_BYTES if s.tokenizer == sft.BYTES else s.tokenizer
        codec = of_tokenizer(spec, s.template, s.tokens)
        stops = sorted({*codec.stop_ids, s.eos_id})  # what the run's pairs end with
        return dataclasses.replace(codec, stop_ids=stops)
    if config.data.name != "text":
        raise ValueError(
            f"data.name={config.data.name!r}: the run's text has no tokenizer here to read "
            "prompts with; give the model's folder (--hf), which holds one"
        )
    return of_tokenizer(config.data.get("tokenizer", tokenize.BYTES))


def prepare(codec: Codec, prompts: list, max_len: int, max_new_tokens: int, switch=None) -> tuple:
    """`(texts, ids, lengths)` of the prompts, as the decoder takes them (`decode.pad_prompts`:
    right-padded); a `ValueError` names a prompt that cannot be read or leaves no room for
    `max_new_tokens` in `max_len`."""
    from mptrain.models.decoder import decode

    texts = []
    for i, prompt in enumerate(prompts):
        try:
            texts.append(codec.prompt(prompt))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    # a plain prompt as the tokenizer reads a text (its BOS, as transformers adds it); a
    # rendered conversation as it is (its template wrote the BOS)
    encoded = [codec.encode(t, isinstance(p, str)) for t, p in zip(texts, prompts, strict=True)]
    return texts, *decode.pad_prompts(encoded, max_len, max_new_tokens, switch)


def complete(
    codec: Codec,
    model: Any,
    params: Any,
    prompts: list,
    max_new_tokens: int,
    sampling: Any = None,
    seed: int = 0,
    cache_dtype: Any = None,
    run: Any = None,
) -> list[dict]:
    """`{"prompt", "completion", "tokens"}` of each prompt (a string, or a conversation: see
    `Codec.prompt`), decoded in one batch by `decode.make_decoder` (`sampling`: a
    `decode.Sampling`, None: greedy). A `ValueError` names a prompt that cannot be read or
    leaves no room for `max_new_tokens` in the model's context. `run`: a decoder made for
    `model` and `max_new_tokens` already (made here where None)."""
    import numpy as np

    from mptrain.models.decoder import decode

    switch = decode.longrope_switch(model)
    texts, ids, lengths = prepare(codec, prompts, model.max_len, max_new_tokens, switch)
    run = run or decode.make_decoder(model, max_new_tokens, cache_dtype)
    sampling = (sampling or decode.Sampling()).values()
    out = run(params, ids, lengths, sampling, seed, decode.stops(codec.stop_ids))
    rows = decode.strip(np.asarray(out), codec.stop_ids)
    return [
        {"prompt": text, "completion": codec.decode(row), "tokens": row}
        for text, row in zip(texts, rows, strict=True)
    ]
