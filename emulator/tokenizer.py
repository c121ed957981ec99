"""Deterministic tokenizer and chat template shared by every emulator.

Byte-level: every UTF-8 byte of a text is one token (ids 0-255), so
``encode(decode(ids)) == ids`` for any ASCII output, and the answer an engine
generated re-tokenizes to the very ids it produced. Template markers are special
ids >= 256 that no text encodes to, laid out like a ChatML template::

    [<|im_start|>context\\nkey=json\\n ...<|im_end|>\\n]
    <|im_start|>role\\ncontent<|im_end|>\\n ... <|im_start|>assistant\\n

The context block renders what a real chat template also sees besides the messages
(tools, ``chat_template_kwargs``, RAG documents, a reasoning effort), so that a
prompt rendered without one of them differs, as it would on a real model.

``<|im_end|>`` doubles as end-of-sequence: an answer that stops generates it,
and the next turn's template closes the assistant message with it, so the
decoder's sequence (prompt + answer) is a prefix of the next turn's prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

IM_START = 256
IM_END = 257
EOS_TOKEN_ID = IM_END
VOCAB_SIZE = 258

_NEWLINE = 10
_SPECIAL_TEXT = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}


class TemplateError(ValueError):
    """A chat message cannot be rendered."""


def encode(text: str) -> list[int]:
    """Token ids of a text: its UTF-8 bytes, no special tokens."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of token ids; special ids are dropped or rendered as their markers."""
    parts: list[str] = []
    run = bytearray()
    for token in ids:
        if 0 <= token < 256:
            run.append(token)
            continue
        if token not in _SPECIAL_TEXT:
            raise ValueError(f"token id {token} is outside the vocabulary")
        if not skip_special_tokens:
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(_SPECIAL_TEXT[token])
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)


def message_text(content: Any) -> str:
    """Text of an OpenAI message content: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise TemplateError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise TemplateError("a text content part needs a string 'text'")
            texts.append(text)
        return "".join(texts)
    raise TemplateError("message content must be a string or a list of parts")


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    context: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the shared template. `context`: what
    else the template is given (``tools``, ``documents``, ``chat_template_kwargs``
    entries ...; None values are left out), rendered in a block of its own first.
    `continue_final_message` leaves the last message open, for the model to go on."""
    if continue_final_message and add_generation_prompt:
        raise TemplateError("continue_final_message and add_generation_prompt cannot both be set")
    ids: list[int] = []
    given = {key: value for key, value in (context or {}).items() if value is not None}
    if given:
        ids.append(IM_START)
        ids.extend(encode("context"))
        ids.append(_NEWLINE)
        for key in sorted(given):
            ids.extend(encode(f"{key}={json.dumps(given[key], sort_keys=True)}"))
            ids.append(_NEWLINE)
        ids.append(IM_END)
        ids.append(_NEWLINE)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError("each message needs a string 'role'")
        ids.append(IM_START)
        ids.extend(encode(role))
        ids.append(_NEWLINE)
        ids.extend(encode(message_text(message.get("content"))))
        if continue_final_message and i == len(messages) - 1:
            return ids
        ids.append(IM_END)
        ids.append(_NEWLINE)
    if add_generation_prompt:
        ids.append(IM_START)
        ids.extend(encode("assistant"))
        ids.append(_NEWLINE)
    return ids


def is_valid_token(token: int) -> bool:
    """Whether an id belongs to the vocabulary."""
    return 0 <= token < VOCAB_SIZE
