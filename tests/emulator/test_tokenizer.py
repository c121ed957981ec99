"""The shared tokenizer and chat template."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emulator import kvmodel
from emulator.tokenizer import (
    EOS_TOKEN_ID,
    IM_END,
    IM_START,
    TemplateError,
    apply_chat_template,
    decode,
    encode,
)


@given(st.text())
def test_text_round_trips(text: str) -> None:
    assert decode(encode(text)) == text


@given(st.lists(st.integers(min_value=32, max_value=126)))
def test_ascii_ids_round_trip(ids: list[int]) -> None:
    assert encode(decode(ids)) == ids


def test_template_layout() -> None:
    ids = apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == [IM_START, *encode("user\nhi"), IM_END, 10, IM_START, *encode("assistant\n")]
    assert decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert decode(ids) == "user\nhi\nassistant\n"


def test_next_turn_extends_the_decoder_sequence() -> None:
    first = [{"role": "user", "content": "hi"}]
    answer = encode("well hello")
    decoder_sequence = apply_chat_template(first) + answer + [EOS_TOKEN_ID]
    second = [*first, {"role": "assistant", "content": "well hello"}, {"role": "user", "content": "more"}]
    assert apply_chat_template(second)[: len(decoder_sequence)] == decoder_sequence


def test_text_parts_and_errors() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert apply_chat_template(parts) == apply_chat_template([{"role": "user", "content": "ab"}])
    with pytest.raises(TemplateError):
        apply_chat_template([{"content": "no role"}])
    with pytest.raises(TemplateError):
        apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError):
        decode([999])


@given(st.binary(min_size=32, max_size=32), st.integers(min_value=0, max_value=100))
def test_sampled_tokens_are_printable_or_eos(state: bytes, produced: int) -> None:
    token = kvmodel.sample(state, produced)
    assert token == EOS_TOKEN_ID or 32 <= token <= 126
    assert kvmodel.sample(state, produced, ignore_eos=True) != EOS_TOKEN_ID
    if produced == 0:
        assert token != ord(" ")


def test_the_template_renders_what_it_is_given_besides_the_messages() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    plain = apply_chat_template(messages)
    assert apply_chat_template(messages, context={"tools": None}) == plain  # (None: not given)
    with_tools = apply_chat_template(messages, context={"tools": [{"name": "ls"}]})
    assert with_tools != plain and with_tools[len(with_tools) - len(plain) :] == plain  # a block first
    ordered = apply_chat_template(messages, context={"b": 1, "a": 2})
    assert ordered == apply_chat_template(messages, context={"a": 2, "b": 1})
    open_end = apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert decode(open_end).endswith("Once") and decode(open_end, skip_special_tokens=False).endswith("Once")
    with pytest.raises(TemplateError):
        apply_chat_template(messages, continue_final_message=True)  # (and a generation prompt)
