"""Prompt token ids forwarded in ``kv_transfer_params``, taken as vLLM takes them.

vLLM 0.32 (``vllm/renderers/online_renderer.py``, ``_reused_prompt_token_ids``,
from vLLM PR 48145) lets a chat request carry its prompt's token ids in
``kv_transfer_params["prompt_token_ids"]``: the ids are taken out of the params
(kept out of the engine's sampling metadata) and are the prompt, templating and
tokenizing skipped; ids that are not a non-empty list of non-negative integers,
or ids outside the vocabulary, are a 400; with non-text content in the messages
the ids are ignored and the messages rendered. A disaggregated router forwards
what the prefill node tokenized so that the decode node skips that work.

Only the chat path does this: ``/v1/completions`` ignores the key (its prompt may
be token ids already), and releases before that change render every chat
request themselves (``EmulatorConfig.chat_prompt_token_ids`` off). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from emulator.errors import InvalidRequest
from emulator.tokenizer import VOCAB_SIZE

#: vLLM's message for ids of the wrong shape (its out-of-vocabulary check has its own).
MALFORMED = "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers."
OUT_OF_VOCABULARY = "The prompt contains token ids outside the vocabulary."

#: Content part types that carry no media (vLLM 0.32 ``chat_utils._TEXT_CONTENT_PART_TYPES``).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})


def forwarded_prompt_ids(params: dict[str, Any] | None, messages: Any) -> list[int] | None:
    """Take ``prompt_token_ids`` out of a chat request's `params` -> the prompt's token
    ids, or None (none given, or the messages hold non-text content: rendered instead).
    InvalidRequest for ids vLLM refuses."""
    if not params:
        return None
    ids = params.pop("prompt_token_ids", None)
    if ids is None or has_non_text_content(messages):
        return None
    # (bool is an int subclass: hence the exact type check, as vLLM's)
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        raise InvalidRequest(MALFORMED)
    if max(ids) >= VOCAB_SIZE:
        raise InvalidRequest(OUT_OF_VOCABULARY)
    return ids


def has_non_text_content(messages: Any) -> bool:
    """Whether a message's content holds a part that is not text (vLLM's
    ``has_non_text_content``: a part of a non-text type, or one naming media)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type", "text")
            if not isinstance(kind, str) or kind not in _TEXT_PARTS or any(k in part for k in _MEDIA_KEYS):
                return True
    return False


#: Keys that make a content part media whatever its type (``chat_utils._MEDIA_CONTENT_PART_KEYS``).
_MEDIA_KEYS = (
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
)
