"""What the HTTP tap decides, as pure functions over bytes and dicts.

For a generation request that names a conversation (`plan_request`): strip the
body's ``conversation_id`` (vLLM does not know it; ``session_id`` is vLLM's and
stays), ask the engine for ``return_token_ids`` and remember whether the client
wanted them. On the way back (`TurnObserver`, fed the JSON body or each SSE
event): collect the prompt's and the generated token ids, the finish reason and
``kv_transfer_params``, and remove the token ids the client did not ask for.
`SseRewriter` cuts a byte stream into SSE events without holding back any
complete event. The retention itself is drafted from the finished turn in
``sidecar.drafts``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvferry.decoding import UNDECODABLE, lax_bool
from kvferry.sse import SseEvent, SseEvents, is_error_event, join_events, split_events
from kvferry.turnheaders import TURN_ID_HEADER, conversation_of, ends_here, tapped_tenant

#: Paths whose requests the tap rewrites and whose answers it reads.
TAPPED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_MAX_REQUEST_ID = 128  # bytes (the daemon takes ids up to 256); a longer one is not kept
# The engine stopped or hit max_tokens (vLLM's FINISHED_STOPPED / _LENGTH_CAPPED, when D
# keeps the blocks): "tool_calls" is a stop the chat layer renamed because the model called
# a tool, the turn agent conversations take most.
NORMAL_FINISH = frozenset({"stop", "length", "tool_calls"})

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class RequestPlan:
    """A tapped request: what to forward and what to remember for the answer."""

    body: bytes
    """The body to send to the engine."""
    tenant: str
    conversation_id: str
    model: str
    """The model the request names ("" = the engine's default)."""
    strip_token_ids: bool
    """The client did not ask for token ids: remove them from the answer."""
    capture: bool = True
    """Read the answer for D's params (decode and both nodes)."""
    request_id: str = ""
    """The request's id (the router's id of the turn), registered with the retention."""
    with_prefill_params: bool = False
    """The request came with a prefill's kv_transfer_params (``do_remote_prefill``): a
    decode engine with bidirectional transfer pins its blocks when it finishes normally."""
    ends: bool = False
    """The router said it is the conversation's last turn: D's blocks are released at
    once, not registered (kvferry.turnheaders.END_HEADER)."""


class _Head(msgspec.Struct):
    """The request fields the tap reads; decoding only these skips the rest (messages,
    token ids) without building it."""

    conversation_id: Any = msgspec.UNSET
    session_id: Any = msgspec.UNSET
    return_token_ids: Any = msgspec.UNSET
    model: Any = msgspec.UNSET
    echo: Any = msgspec.UNSET
    kv_transfer_params: msgspec.Raw = msgspec.Raw()
    """Kept as bytes: decoded (only its flag) when the request names a conversation."""


class _KvHead(msgspec.Struct):
    do_remote_prefill: Any = None


_head_decode = msgspec.json.Decoder(_Head).decode
_kv_head_decode = msgspec.json.Decoder(_KvHead).decode
_ASK_IDS = b'"return_token_ids":true'


def plan_request(
    method: str,
    path: str,
    headers: Mapping[str, str],
    raw: bytes,
    tenant_header: str,
    capture: bool = True,
) -> RequestPlan | None:
    """The rewrite of a request the tap should follow, or None to pass it through untouched.

    Conversation and tenant are read by `kvferry.turnheaders`' rules, the router's;
    `tenant_header` is the one a request that did not come from the router names its
    tenant in. Without `capture` (a prefill node) only the body's ``conversation_id`` is
    removed.
    """
    if method != "POST" or path not in TAPPED_PATHS or not raw:
        return None
    try:
        head = _head_decode(raw)
    except UNDECODABLE:  # not JSON, or not an object: the engine answers it itself
        return None
    # (an absent field is UNSET, which conversation_of skips like any non-id value)
    conversation = conversation_of(
        headers, {"conversation_id": head.conversation_id, "session_id": head.session_id}
    )
    in_body = head.conversation_id is not msgspec.UNSET
    if not conversation or (not capture and not in_body):
        return None
    # The answer's token ids make the retention's digests, so the engine is asked for them;
    # but a completion that echoes its prompt would lose the prompt's text (vLLM echoes ""
    # with return_token_ids): such a turn's retention goes without digests (unverifiable:
    # the next turn recomputes, never pulls unchecked).
    echoes = _flag(head.echo) and not path.endswith("/chat/completions")
    ask_ids = capture and not _flag(head.return_token_ids) and not echoes
    body = raw
    if in_body or ask_ids:
        try:
            body = _rewrite(raw, ask_ids, in_body, head.return_token_ids is msgspec.UNSET)
        except UNDECODABLE:  # (a number beyond a float, say, which the head skipped over)
            return None
    return RequestPlan(
        body=body,
        tenant=tapped_tenant(headers, tenant_header),
        conversation_id=conversation,
        model=head.model if isinstance(head.model, str) else "",
        strip_token_ids=ask_ids,
        capture=capture,
        request_id=_request_id(headers),
        with_prefill_params=capture and _from_prefill(head.kv_transfer_params),
        ends=capture and ends_here(headers),
    )


def _from_prefill(raw: msgspec.Raw) -> bool:
    """Whether a request's kv_transfer_params are a prefill's (truthy ``do_remote_prefill``,
    as vLLM's connector reads it)."""
    try:
        return bool(raw) and bool(_kv_head_decode(raw).do_remote_prefill)
    except UNDECODABLE:  # (not an object: the engine refuses the request)
        return False


def _flag(value: Any) -> bool:
    """A request's flag as vLLM reads it ("true", 1, "off"...); unset, or one vLLM refuses
    (the engine answers that request itself): False."""
    try:
        return value is not msgspec.UNSET and value is not None and lax_bool(value)
    except ValueError:
        return False


def _request_id(headers: Mapping[str, str]) -> str:
    """The request's id as the daemon takes it: the router's id of the turn, else (another
    front door) its X-Request-Id; "" if absent, too long or not printable (a client's own
    header must not cost the retention its registration)."""
    value = (headers.get(TURN_ID_HEADER) or headers.get("X-Request-Id", "")).strip()
    # (ASCII first: aiohttp hands odd bytes over as surrogates, which do not encode)
    ok = value.isascii() and value.isprintable() and len(value) <= _MAX_REQUEST_ID
    return value if ok else ""


def _rewrite(raw: bytes, ask_ids: bool, drop_conversation: bool, ids_absent: bool) -> bytes:
    """The body without ``conversation_id`` and, with `ask_ids`, with ``return_token_ids: true``.

    The common case (the router's requests: the conversation in a header, no
    ``return_token_ids``) only needs the key added: it goes in front of the others,
    byte for byte the rest of the body (a 64k-token body is 300 KB: re-encoding it
    whole cost 1.6 ms). Anything else is decoded and encoded again.
    """
    if ask_ids and ids_absent and not drop_conversation:
        start = len(raw) - len(raw.lstrip())
        rest = raw[start + 1 :]
        empty = rest.lstrip().startswith(b"}")
        return raw[: start + 1] + _ASK_IDS + (b"" if empty else b",") + rest
    body = _json_decode(raw)
    body.pop("conversation_id", None)
    if ask_ids:
        body["return_token_ids"] = True
    return _json_encode(body)


@dataclass
class FinishedTurn:
    """What an answer said about the finished request (choice 0)."""

    params: dict[str, Any]
    prompt_token_ids: list[int] | None
    output_token_ids: list[int] | None
    finish_reason: str
    params_seen_at: float = field(default=0.0, compare=False)
    """Wall-clock time D's params came (D had finished: its blocks' TTL runs from about
    then), however long the client then took to read the rest."""


@dataclass
class TurnObserver:
    """Reads one answer's JSON objects (the body, or each SSE event) in order."""

    strip_token_ids: bool
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    finish_reason: str | None = None
    params: dict[str, Any] | None = None
    params_seen_at: float = 0.0
    failed: bool = False
    choices: set[int] = field(default_factory=set)
    stop_reason: Any = None
    """vLLM's stop_reason: a string when a stop string ended the answer (the engine aborted
    the request then, and kept nothing), a token id, or None."""
    finished_at: float = 0.0
    """`time.monotonic()` when the finish reason came (D had finished)."""
    usage: tuple[int, int] | None = None
    """(prompt tokens, completion tokens) when the answer reported its usage."""
    prompt_ids_json: bytes | None = None
    """The prompt's ids as the engine's JSON list, cut out of an event (`cut_prompt_ids`) and
    decoded only once the turn has finished: off the path of the first token."""

    def observe(self, obj: Any) -> bool:
        """Take in one object; -> whether it was changed (token ids stripped)."""
        if not isinstance(obj, dict):
            return False
        if is_error_event(obj):
            self.failed = True
            return False
        changed = False
        prompt = obj.get("prompt_token_ids")
        if isinstance(prompt, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = prompt
        if self.strip_token_ids and "prompt_token_ids" in obj:
            del obj["prompt_token_ids"]
            changed = True
        params = obj.get("kv_transfer_params")
        if isinstance(params, dict):
            self.params = params
            self.params_seen_at = time.time()
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt_n, output_n = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if type(prompt_n) is int and type(output_n) is int:
                self.usage = (prompt_n, output_n)
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    changed |= self._choice(choice)
        return changed

    def _choice(self, choice: dict[str, Any]) -> bool:
        index = choice.get("index", 0)
        self.choices.add(index if isinstance(index, int) else -1)
        changed = False
        if index == 0:
            prompt = choice.get("prompt_token_ids")
            if isinstance(prompt, list) and self.prompt_token_ids is None:
                self.prompt_token_ids = prompt
            tokens = choice.get("token_ids")
            if isinstance(tokens, list):  # (in place: a long answer comes in thousands of chunks)
                if self.output_token_ids is None:
                    self.output_token_ids = []
                self.output_token_ids.extend(tokens)
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.finish_reason = reason
                self.stop_reason = choice.get("stop_reason")
                self.finished_at = time.monotonic()
        if self.strip_token_ids:
            for key in _CHOICE_IDS:
                if key in choice:
                    del choice[key]
                    changed = True
        return changed

    def finished(self) -> FinishedTurn | str:
        """The finished turn, or why there is none (a metrics label)."""
        if self.failed:
            return "engine_error"
        if self.finish_reason is None:
            return "unfinished"
        if self.finish_reason not in NORMAL_FINISH:
            return "abnormal_finish"
        if len(self.choices) > 1:
            return "several_choices"
        if self.params is None or not self.params.get("do_remote_decode"):
            return "no_params"
        prompt = self.prompt_token_ids
        if prompt is None and self.prompt_ids_json is not None:
            try:
                prompt = _ids_decode(self.prompt_ids_json)
            except UNDECODABLE:
                prompt = None  # (cut_prompt_ids checked the bytes; a draft without ids is still valid)
        return FinishedTurn(
            self.params, prompt, self.output_token_ids, self.finish_reason, self.params_seen_at
        )


_PROMPT_IDS = b'"prompt_token_ids":['
#: A choice's token ids (a completion's choice has its prompt's too).
_CHOICE_IDS = ("token_ids", "prompt_token_ids")
_ids_decode = msgspec.json.Decoder(list[int]).decode


def cut_prompt_ids(payload: bytes) -> tuple[bytes, bytes] | None:
    """(the JSON object without its ``prompt_token_ids`` member, the member's list) when the
    member is one compact list of plain integers (what vLLM writes); None: decode it whole.

    vLLM puts the whole prompt's ids in the first event of an answer: 64k of them are
    300 KB, and decoding and re-encoding that event held the first token back ~1 ms.
    Cutting bytes costs microseconds. A match preceded by ``{`` or ``,`` is a member's
    key (inside a string its quotes would be escaped), and the list ends at its first
    ``]``.
    """
    i = payload.find(_PROMPT_IDS)
    if i <= 0 or payload[i - 1] not in b"{,":
        return None
    start = i + len(_PROMPT_IDS) - 1
    end = payload.find(b"]", start)
    if end < 0 or payload.find(_PROMPT_IDS, end) >= 0:
        return None
    ids = payload[start : end + 1]
    if ids[1:-1].translate(None, b"0123456789,"):
        return None
    before, after = payload[:i], payload[end + 1 :]
    if after.startswith(b","):
        after = after[1:]
    elif before.endswith(b","):
        before = before[:-1]
    elif not (before.endswith(b"{") and after.startswith(b"}")):
        return None
    return before + after, ids


def rewrite_json(raw: bytes, observer: TurnObserver) -> bytes:
    """A JSON answer as the client gets it (unchanged bytes when nothing was stripped)."""
    try:
        obj = _json_decode(raw)
    except UNDECODABLE:
        observer.failed = True
        return raw
    # What vLLM answers when not asked for the ids: the fields, null (a whole response is
    # dumped with its unset fields; stream chunks leave them out).
    nulled = [(obj, "prompt_token_ids")] if isinstance(obj, dict) and "prompt_token_ids" in obj else []
    choices = obj.get("choices") if isinstance(obj, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            nulled += [(choice, key) for key in _CHOICE_IDS if key in choice]
    if not observer.observe(obj):
        return raw
    for holder, key in nulled:
        holder.setdefault(key, None)
    return _json_encode(obj)


class SseRewriter:
    """Cuts a byte stream into SSE events and passes each one through `observer`.

    Every complete event is returned as soon as its terminating blank line has
    arrived; only a partial event is held back. Events whose data is not JSON
    (``[DONE]``, comments) pass unchanged.
    """

    def __init__(self, observer: TurnObserver) -> None:
        self._observer = observer
        self._events = SseEvents()
        self.done = False
        """``data: [DONE]`` was seen."""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to forward now for `chunk`."""
        complete = self._events.complete(chunk)
        return self._rewrite(complete) if complete else b""

    def flush(self) -> bytes:
        """Whatever is held back at the end of the stream: an event whose blank line never
        came, through the observer like any other (its line end kept)."""
        return self._rewrite(self._events.flush())

    def _rewrite(self, data: bytes) -> bytes:
        """`data`'s events as they are forwarded."""
        events = [
            SseEvent(out, e.end) for e in split_events(data) if (out := self._event(e.lines)) is not None
        ]
        return join_events(events) if events else b""

    def _event(self, event: bytes) -> bytes | None:
        """The event to forward, its lines without their end (None: none)."""
        if not event.startswith(b"data:") or b"\n" in event or b"\r" in event:
            return event  # comments, multi-line or named events: not vLLM's, pass through
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return event
        observer = self._observer
        # Only the first event carries the prompt's ids: later ones are decoded whole.
        first = observer.prompt_token_ids is None and observer.prompt_ids_json is None
        cut = cut_prompt_ids(payload) if observer.strip_token_ids and first else None
        if cut is not None:
            payload, ids = cut
        try:
            obj = _json_decode(payload)
        except UNDECODABLE:
            return event
        if cut is not None:
            observer.prompt_ids_json = ids
        if observer.observe(obj):
            if only_for_token_ids(obj):
                return None
            return b"data: " + _json_encode(obj)
        return b"data: " + payload if cut is not None else event


def only_for_token_ids(obj: dict[str, Any]) -> bool:
    """Whether a chat chunk, its token ids stripped, is one vLLM sends only because the
    request asked for ``return_token_ids``: a delta with no field at all (a tool-call or
    reasoning parser held the token back; vLLM sends such a chunk, logprobs and all, only
    to a request that asked for ids). A client that did not ask would not have got it.
    (A token that made no text yet streams ``"content": ""`` either way: kept.) One that
    finishes a choice, or carries usage, is kept too."""
    choices = obj.get("choices")
    if obj.get("object") != "chat.completion.chunk" or obj.get("usage") or not choices:
        return False
    return all(
        isinstance(c, dict) and c.get("finish_reason") is None and c.get("delta") == {} for c in choices
    )
