"""The router's own tokenizer (``--tokenizer DIR``): a prompt's token ids without asking P.

Given the model's tokenizer files (``tokenizer.json``, and ``tokenizer_config.json`` or
``chat_template.jinja`` with the chat template), the router renders a chat request as
vLLM does (the template in a sandboxed Jinja environment set up as `transformers` sets
it up, then the text tokenized without special tokens unless the request asks) and
tokenizes with the `tokenizers` library, so a turn's ids, digests and lookup no longer
wait on P's ``/tokenize`` round trip. ``/tokenize`` stays the answer whenever the local
path could differ from the engine's:

- a request carrying what the local path does not render as vLLM does (`renderable`:
  tools, a template of its own, template kwargs, text parts, message fields besides
  role and content, a continued final message, a marker's text inside a message);
- a node whose ``/tokenize`` did not give the same ids (`TokenizerChecks`: each node's
  first turn of each kind is tokenized both ways and compared, and again every so often;
  a difference is logged and that node's turns go to its ``/tokenize``). This also
  catches what the files alone do not say: a vLLM that hands the template list-shaped
  content (its "openai" content format), a tokenizer class that changes the
  post-processor. A wrong id only ever costs a reuse (the digests differ from D's and
  the daemon refuses), but silently. Since the ids of later turns are not checked, they
  are never forwarded as the engines' prompt (``--forward-prompt-token-ids``: only an
  engine's ids are), where a wrong one would change the answer.

Long prompts are cut at the tokenizer's special tokens into pieces that the library
tokenizes independently of each other; a piece seen lately (a conversation's history)
is not tokenized again (`PieceCache`). Whether that holds for the files is checked when
they load (some pre-tokenizers treat the first piece alone): if not, every prompt is
tokenized whole.
"""

from __future__ import annotations

import array
import enum
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from router.settings import Settings

#: Template inputs of a chat request that only the engine's renderer takes as it does.
_ENGINE_ONLY = ("tools", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "documents")
_PIECE_ENTRY_BYTES = 120  # a cached piece's objects and dict slot, besides its text and ids


class TokenizerFilesError(ValueError):
    """The tokenizer files cannot be used (missing, unreadable, or a template that does not compile)."""


def _text_of(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_of(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else the config's (a string, or a
    list of named ones: "default")."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled as `transformers` compiles it (TokenizerFilesError: it does not)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise TokenizerFilesError(f"the chat template does not compile: {e}") from None


def renderable(path: str, body: Mapping[str, Any], markers: Sequence[str]) -> str | None:
    """Why the local path may render `body` unlike the engine (None: it renders it alike).
    `markers`: the special tokens' texts, which no message may hold (the engine's renderer
    may keep them as text)."""
    if not path.endswith("/chat/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "prompt"
        return "marker" if _holds_marker(prompt, markers) else None
    if any(body.get(name) is not None for name in _ENGINE_ONLY) or body.get("continue_final_message"):
        return "template_input"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages"
    for message in messages:
        if not isinstance(message, Mapping) or not message.keys() <= {"role", "content"}:
            return "message_fields"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            return "content"
        if _holds_marker(content, markers) or _holds_marker(role, markers):
            return "marker"
    return None


def _holds_marker(text: str, markers: Sequence[str]) -> bool:
    # (one scan per distinct two-character start: most tokenizers' markers share one)
    starts = {m[:2] for m in markers}
    return any(s in text for s in starts) and any(m in text for m in markers)


@dataclass
class PieceCache:
    """Token ids of recently tokenized pieces of text, least recently used out first,
    bounded in bytes (a piece's text and 4 bytes per id)."""

    max_bytes: int
    _entries: OrderedDict[str, array.array[int]] = field(default_factory=OrderedDict)
    size_bytes: int = 0

    def get(self, piece: str) -> array.array[int] | None:
        ids = self._entries.get(piece)
        if ids is not None:
            self._entries.move_to_end(piece)
        return ids

    def put(self, piece: str, ids: Sequence[int]) -> None:
        size = len(piece) + 4 * len(ids) + _PIECE_ENTRY_BYTES
        if size > self.max_bytes or piece in self._entries:
            return
        self._entries[piece] = array.array("I", ids)
        self.size_bytes += size
        while self.size_bytes > self.max_bytes:
            old, old_ids = self._entries.popitem(last=False)
            self.size_bytes -= len(old) + 4 * len(old_ids) + _PIECE_ENTRY_BYTES

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class Pieces:
    """A prompt's text cut at special tokens: ids known (cached pieces, specials) and the
    pieces still to tokenize (`LocalTokenizer.finish`)."""

    parts: list[str | array.array[int] | list[int]]
    """In order: known ids, or a piece's text still to tokenize."""
    missing: list[str]
    ends: tuple[list[int], list[int]]
    """Ids the tokenizer's post-processor puts before and after (special tokens asked for)."""
    whole: bool | None = None
    """Not cut: the text is tokenized whole, with special tokens or not."""

    @property
    def missing_chars(self) -> int:
        return sum(len(p) for p in self.missing)


class LocalTokenizer:
    """A model's tokenizer files, loaded: prompts rendered and tokenized as the engine does."""

    def __init__(self, directory: Path, cache_bytes: int = 64 << 20) -> None:
        """Load the files in `directory` (TokenizerFilesError: they cannot be used)."""
        self.directory = directory
        raw, config = _read_files(directory)
        try:
            self._tok = Tokenizer.from_str(raw.decode())
        except Exception as e:  # (the library raises plain Exceptions)
            raise TokenizerFilesError(f"{directory / 'tokenizer.json'}: {e}") from None
        source = _template_of(directory, config)
        self._template = compile_template(source) if source is not None else None
        self.fingerprint = hashlib.blake2b(raw + (source or "").encode(), digest_size=8).hexdigest()
        """Of tokenizer.json and the template: which files a log line speaks of."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        self._special_map = {name: _text_of(config.get(name)) for name in names if _text_of(config.get(name))}
        added = self._tok.get_added_tokens_decoder()
        self.markers = tuple(sorted((t.content for t in added.values()), key=len, reverse=True))
        self._ids = {t.content: i for i, t in added.items()}
        plain = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        self._split = re.compile("(" + "|".join(map(re.escape, self.markers)) + ")") if self.markers else None
        self.cache = PieceCache(cache_bytes)
        self._ends = {False: ([], []), True: self._post_processor_ends()}
        self.piecewise = (
            plain and self._split is not None and self._ends[True] is not None and self._pieces_agree()
        )
        """Pieces are tokenized apart (and cached); else every prompt is tokenized whole."""

    @property
    def chat(self) -> bool:
        """Whether the files have a chat template (without one, chat goes to /tokenize)."""
        return self._template is not None

    def pieces(self, path: str, body: Mapping[str, Any]) -> Pieces | str:
        """The request's prompt, rendered and cut, for `finish` -> its Pieces, or why the
        engine must tokenize it (`renderable`; "template": none, or it raised)."""
        chat = path.endswith("/chat/completions")
        why = renderable(path, body, self.markers)
        if why is not None:
            return why
        if chat:
            text = self.render(body["messages"], body.get("add_generation_prompt", True) is not False)
            if text is None:
                return "template"
        else:
            prompt = body["prompt"]
            text = prompt[0] if isinstance(prompt, list) else prompt
        special = body.get("add_special_tokens", not chat)
        return self.cut(text, special is True)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str | None:
        """The chat template's text for `messages` (None: no template, or it raised)."""
        if self._template is None:
            return None
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_map,
            )
        except jinja2.exceptions.TemplateError:
            return None

    def cut(self, text: str, add_special_tokens: bool) -> Pieces:
        """`text` cut at the special tokens, cached pieces' ids looked up."""
        ends = self._ends[add_special_tokens]
        if not self.piecewise or ends is None:
            return Pieces([text], [text], ([], []), whole=add_special_tokens)
        parts: list[str | array.array[int] | list[int]] = []
        missing: list[str] = []
        assert self._split is not None
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # (the split's captured separators: the special tokens)
                parts.append([self._ids[piece]])
            elif piece:
                ids = self.cache.get(piece)
                parts.append(piece if ids is None else ids)
                if ids is None:
                    missing.append(piece)
        return Pieces(parts, missing, ends)

    def tokenize_missing(self, pieces: Pieces) -> list[list[int]]:
        """The ids of the pieces `cut` found no ids for, in one call of the library (which
        lets go of the GIL: safe to run in a thread; it touches no cache)."""
        if pieces.whole is not None:
            return [self.encode(pieces.missing[0], pieces.whole)]
        return _encode_batch(self._tok, pieces.missing)

    def finish(self, pieces: Pieces, missing: list[list[int]] | None = None) -> array.array[int]:
        """The ids of `pieces`, with `missing` (`tokenize_missing`'s; None: tokenized here);
        the new pieces are cached.

        As uint32 (``array("I")``), the form `kvferry.digests` hashes: the cached pieces'
        ids are copied, never made into a Python int each (at 32k tokens: 0.4 ms of the
        turn's critical path for the list, 0.7 ms more to turn it back into bytes). An
        array never equals a list: compare ``list(...)`` with an engine's ids."""
        got = self.tokenize_missing(pieces) if missing is None else missing
        if pieces.whole is not None:
            return array.array("I", got[0])
        found = dict(zip(pieces.missing, got, strict=True))
        for piece, ids in found.items():
            self.cache.put(piece, ids)
        head, tail = pieces.ends
        out = array.array("I", head)
        for part in pieces.parts:
            out.extend(found[part] if isinstance(part, str) else part)
        out.extend(tail)
        return out

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s ids, tokenized whole (the reference `cut` + `finish` must equal)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def _post_processor_ends(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor adds around a text (None: not only around it)."""
        empty = self.encode("", True)
        for marker in self.markers:  # (one the post-processor does not add itself)
            ids = self.encode(marker, True)
            if ids.count(self._ids[marker]) == 1:
                at = ids.index(self._ids[marker])
                head, tail = ids[:at], ids[at + 1 :]
                return (head, tail) if empty == head + tail else None
        return None

    def _pieces_agree(self) -> bool:
        """Whether tokenizing pieces apart gives what tokenizing the whole does, on texts that
        put special tokens in every kind of place."""
        self.piecewise = True
        joint = "".join(self.markers[:2])
        probes = [
            f"  Hello world{joint}\n system  text {self.markers[0]}x y\n\n",
            f"{self.markers[-1]} a.b",
            f"a{self.markers[0]}a b{self.markers[-1]}ab",
            "x",
        ]
        try:
            return all(
                list(self.finish(self.cut(p, special))) == self.encode(p, special)
                for p in probes
                for special in (False, True)
            )
        finally:
            self.cache = PieceCache(self.cache.max_bytes)


def _encode_batch(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    fast = getattr(tok, "encode_batch_fast", tok.encode_batch)  # (no offsets: 2-3x faster)
    return [list(e.ids) for e in fast(texts, add_special_tokens=False)]


def _read_files(directory: Path) -> tuple[bytes, dict[str, Any]]:
    """tokenizer.json's bytes and tokenizer_config.json's content ({} without one)."""
    try:
        raw = (directory / "tokenizer.json").read_bytes()
    except OSError as e:
        raise TokenizerFilesError(f"--tokenizer {directory}: no tokenizer.json: {e.strerror or e}") from None
    config_file = directory / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
    except (OSError, ValueError) as e:
        raise TokenizerFilesError(f"{config_file}: {e}") from None
    if not isinstance(config, dict):
        raise TokenizerFilesError(f"{config_file}: not a JSON object")
    return raw, config


class Check(enum.Enum):
    """How a node's prompts of one kind are tokenized."""

    COMPARE = "compare"
    """Both ways, the engine's ids used, and compared (a node's first turns, and again later)."""
    LOCAL = "local"
    ENGINE = "engine"
    """Its /tokenize gave other ids: the local files are not its tokenizer."""


@dataclass
class TokenizerChecks:
    """Whether each node's ``/tokenize`` gives the local tokenizer's ids: pure bookkeeping,
    by (engine id, "chat" | "completion"). A node is compared on its first turn of each
    kind, then again every `recheck_s` (an engine restarted with other files under the same
    id); one that differed is tried again after `recheck_s` too."""

    recheck_s: float = 300.0
    _seen: dict[tuple[str, str], tuple[bool, float]] = field(default_factory=dict)

    def check(self, engine_id: str, kind: str, now: float) -> Check:
        seen = self._seen.get((engine_id, kind))
        if seen is None or now - seen[1] >= self.recheck_s:
            return Check.COMPARE
        return Check.LOCAL if seen[0] else Check.ENGINE

    def record(self, engine_id: str, kind: str, agreed: bool, now: float) -> None:
        self._seen[(engine_id, kind)] = (agreed, now)


def load_tokenizer(settings: Settings) -> LocalTokenizer | None:
    """The tokenizer files `settings` name (None: none; TokenizerFilesError: unusable)."""
    directory = settings.upstream.tokenizer
    return LocalTokenizer(Path(directory)) if directory else None
