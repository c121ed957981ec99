"""The router's own tokenizer (`router.tokenizer`): the emulator's tokenizer files give the
emulator's ids, pieces tokenized apart give what tokenizing the whole does, requests the
local path cannot render alike go to the engine, and unusable files are refused."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from emulator.tokenizer import apply_chat_template, encode
from emulator.tokenizer_files import CHAT_TEMPLATE, write_tokenizer_files
from kvferry import logs
from router.cli import main as router_main
from router.tokenizer import (
    Check,
    LocalTokenizer,
    PieceCache,
    TokenizerChecks,
    TokenizerFilesError,
    renderable,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MARKERS = ("<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenizer:
    return LocalTokenizer(write_tokenizer_files(tmp_path_factory.mktemp("emu"), "m", 4096))


def ids(tok: LocalTokenizer, path: str, body: dict[str, Any]) -> list[int]:
    pieces = tok.pieces(path, body)
    assert not isinstance(pieces, str), pieces
    return list(tok.finish(pieces))


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abc de\u00e9f\n\t  .,\u4e2d\U0001f600") for _ in range(n))


def test_the_emulators_files_give_the_emulators_ids(emulated: LocalTokenizer) -> None:
    rng = random.Random(3)
    assert emulated.piecewise
    messages = [{"role": "system", "content": _text(rng, 300)}, {"role": "user", "content": _text(rng, 50)}]
    for _ in range(4):
        for generation in (True, False):
            body = {"messages": messages, "add_generation_prompt": generation}
            assert ids(emulated, CHAT, body) == apply_chat_template(
                messages, add_generation_prompt=generation
            )
        messages = [
            *messages,
            {"role": "assistant", "content": _text(rng, 20)},
            {"role": "tool", "content": ""},
        ]
    assert len(emulated.cache) > 0  # (the history's pieces: the next turns looked them up)
    for prompt in ("", "plain", _text(rng, 500)):
        assert ids(emulated, COMPLETIONS, {"prompt": prompt}) == encode(prompt)
        assert ids(emulated, COMPLETIONS, {"prompt": [prompt], "add_special_tokens": False}) == encode(prompt)


def _bpe_with_bos(tmp: Path, prefix_space: bool) -> Path:
    """A byte-level BPE trained here (as realvllm.model trains one) whose post-processor
    puts a BOS first, with a ChatML template; `prefix_space`: a space before each piece."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", *MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    tok.train_from_iterator([_text(rng, 80) for _ in range(300)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": MARKERS[1]}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


@pytest.mark.parametrize("prefix_space", [False, True])
def test_pieces_tokenized_apart_give_the_whole_texts_ids(tmp_path: Path, prefix_space: bool) -> None:
    tok = LocalTokenizer(_bpe_with_bos(tmp_path, prefix_space))
    assert tok.piecewise
    rng = random.Random(7)
    messages = [{"role": "system", "content": _text(rng, 400)}, {"role": "user", "content": _text(rng, 40)}]
    for _ in range(3):
        for special in (False, True):
            body = {"messages": messages, "add_special_tokens": special}
            text = tok.render(messages, True)
            assert text is not None
            assert ids(tok, CHAT, body) == tok.encode(text, special)
        messages = [*messages, {"role": "assistant", "content": _text(rng, 30)}]
    prompt = _text(rng, 300)
    assert ids(tok, COMPLETIONS, {"prompt": prompt})[0] == 0  # (the BOS completions get by default)
    assert ids(tok, COMPLETIONS, {"prompt": prompt}) == tok.encode(prompt, True)


def test_a_tokenizer_that_treats_the_first_piece_apart_is_used_whole(tmp_path: Path) -> None:
    """A Metaspace pre-tokenizer prepending only to the first piece: cut pieces would not give
    the whole text's ids, so the files are used whole (slower, never wrong)."""
    vocab = {"<unk>": 0, MARKERS[0]: 1, MARKERS[1]: 2, "\u2581": 3, "a": 4, "\u2581a": 5, "b": 6}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=""))
    tok.add_special_tokens(list(MARKERS))
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.save(str(tmp_path / "tokenizer.json"))
    local = LocalTokenizer(tmp_path)
    assert not local.piecewise
    text = "a b ab"
    assert ids(local, COMPLETIONS, {"prompt": text}) == local.encode(text, True)
    assert local.pieces(CHAT, {"messages": [{"role": "user", "content": "a"}]}) == "template"  # (no template)


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "template_input"),
        (CHAT, {"chat_template": "{{ messages }}"}, "template_input"),
        (CHAT, {"chat_template_kwargs": {"enable_thinking": False}}, "template_input"),
        (CHAT, {"documents": [{"text": "d"}]}, "template_input"),
        (CHAT, {"continue_final_message": True, "add_generation_prompt": False}, "template_input"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "content"),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "message_fields"),
        (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, "message_fields"),
        (CHAT, {"messages": [{"role": "user", "content": "say <|im_end|> now"}]}, "marker"),
        (CHAT, {"messages": []}, "messages"),
        (COMPLETIONS, {"prompt": "a <|im_start|> b"}, "marker"),
        (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt"),
    ],
)
def test_what_the_local_path_cannot_render_alike_goes_to_the_engine(
    emulated: LocalTokenizer, path: str, body: dict[str, Any], reason: str
) -> None:
    if path == CHAT:
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    assert renderable(path, body, emulated.markers) == reason
    assert emulated.pieces(path, body) == reason


def test_a_template_that_raises_goes_to_the_engine(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, "m", 4096)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = LocalTokenizer(tmp_path)
    assert tok.pieces(CHAT, {"messages": [{"role": "system", "content": "s"}]}) == "template"
    assert ids(tok, CHAT, {"messages": [{"role": "user", "content": "s"}]}) == [ord("x")]


def test_unusable_files_are_refused_with_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(TokenizerFilesError, match=r"no tokenizer\.json"):
        LocalTokenizer(tmp_path)
    write_tokenizer_files(tmp_path, "m", 4096)
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(TokenizerFilesError, match=r"tokenizer_config\.json: not a JSON object"):
        LocalTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerFilesError, match="the chat template does not compile"):
        LocalTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerFilesError, match=r"tokenizer\.json"):
        LocalTokenizer(tmp_path)
    argv = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--tokenizer", str(tmp_path)]
    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)  # keep the process's logging as it is
    assert router_main(argv) == 2
    assert "kvferry router: " in capsys.readouterr().err


def test_the_piece_cache_is_bounded_and_keeps_the_recent_pieces() -> None:
    cache = PieceCache(max_bytes=1000)
    cache.put("a" * 100, [1] * 100)  # 100 + 400 + 120 bytes
    cache.put("b" * 100, [2] * 50)  # 100 + 200 + 120: over the bound, "a..." leaves
    assert cache.get("a" * 100) is None and list(cache.get("b" * 100) or []) == [2] * 50
    assert cache.size_bytes == 420
    cache.put("c" * 2000, [3])  # (larger than the whole cache: not kept)
    assert len(cache) == 1


def test_each_node_is_compared_first_and_again_later() -> None:
    checks = TokenizerChecks(recheck_s=60.0)
    assert checks.check("p1", "chat", now=0.0) is Check.COMPARE
    checks.record("p1", "chat", agreed=True, now=0.0)
    assert checks.check("p1", "chat", now=59.0) is Check.LOCAL
    assert checks.check("p1", "completion", now=59.0) is Check.COMPARE  # (each kind on its own)
    assert checks.check("p2", "chat", now=59.0) is Check.COMPARE
    assert checks.check("p1", "chat", now=60.0) is Check.COMPARE
    checks.record("p1", "chat", agreed=False, now=60.0)
    assert checks.check("p1", "chat", now=100.0) is Check.ENGINE
