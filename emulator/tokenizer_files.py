"""The emulator's tokenizer as a model's tokenizer files: what a router is given to
tokenize locally (``kvferry router --tokenizer DIR``) with the same ids as the engine.

A real model ships ``tokenizer.json`` (the `tokenizers` library's format) and
``tokenizer_config.json`` (its chat template and special tokens); vLLM serves with
them, and a router given the same files renders and tokenizes prompts as the engine
does. `write_tokenizer_files` writes such files for `emulator.tokenizer`: a byte-level
BPE with no merges whose vocabulary maps every byte to its own id (0-255), the two
template markers as special tokens 256 and 257, and a ChatML template that renders
messages as `emulator.tokenizer.apply_chat_template` does.

What the files express is the emulator's tokenizer for plain messages: the context
block the emulator renders for tools, ``chat_template_kwargs``, documents and a
reasoning effort is not in the template (a router renders such requests through the
engine's ``/tokenize``), and a text holding a marker's own characters is split at the
marker by the files' tokenizer (vLLM's does that too) but not by the emulator's.

    python -m emulator --write-tokenizer DIR
"""

from __future__ import annotations

import json
from pathlib import Path

from emulator.tokenizer import IM_END, IM_START, VOCAB_SIZE

IM_START_TEXT = "<|im_start|>"
IM_END_TEXT = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""`emulator.tokenizer.apply_chat_template` for messages with string content, in Jinja."""


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte-to-character table (`tokenizers`' ByteLevel alphabet): each byte's symbol."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def _special(token_id: int, content: str) -> dict[str, object]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def tokenizer_json() -> dict[str, object]:
    """``tokenizer.json`` of the emulator's byte-level tokenizer."""
    vocab = {symbol: b for b, symbol in byte_symbols().items()}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_special(IM_START, IM_START_TEXT), _special(IM_END, IM_END_TEXT)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": {**byte_level, "type": "ByteLevel"},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_config(model: str, max_model_len: int) -> dict[str, object]:
    """``tokenizer_config.json``: the chat template and the special tokens, as
    `transformers` writes it."""
    return {
        "added_tokens_decoder": {
            str(IM_START): _special(IM_START, IM_START_TEXT),
            str(IM_END): _special(IM_END, IM_END_TEXT),
        },
        "bos_token": None,
        "eos_token": IM_END_TEXT,
        "pad_token": IM_END_TEXT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_model_len,
        "name_or_path": model,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer_files(directory: Path, model: str, max_model_len: int) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into `directory` (made when
    missing); -> the directory."""
    assert VOCAB_SIZE == IM_END + 1 == IM_START + 2  # (the files spell the vocabulary out)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False, indent=1))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model, max_model_len), indent=1)
    )
    return directory
