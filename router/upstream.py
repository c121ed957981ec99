"""HTTP to the engines (through their sidecars): tokenize, prefill, decode.

aiohttp errors are translated here, at the boundary, into `UpstreamError`
carrying a `Failure` (connect, timeout, protocol); an error status is an
answer (`Reply`), for the caller to judge.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import aiohttp
import msgspec
from aiohttp import hdrs

from kvferry.decoding import UNDECODABLE
from kvferry.hops import never_delivered
from kvferry.turnheaders import NOT_DELIVERED_HEADER, TURN_ID_HEADER
from router.decisions import Failure, FailureKind
from router.settings import UpstreamSettings

_MAX_TOKEN_ID = 2**32  # what the block digests can encode
_decode = msgspec.json.Decoder().decode
encode = msgspec.json.Encoder().encode

#: Client headers passed on to the engines (tracing); everything else is the router's to set.
_FORWARDED = ("traceparent", "tracestate")
#: Template fields of a chat request that /tokenize must see to render the same prompt.
_CHAT_TEMPLATE_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)


_MAX_CLIENT_REQUEST_ID = 256


def client_request_id(client: Mapping[str, str], body: Mapping[str, Any] | None = None) -> str:
    """The id the client gave its request, as vLLM takes it: X-Request-Id, else the body's
    ``request_id``. Passed on to the engines, which name the answer after it, and echoed.
    "" when there is none, or not printable ASCII of at most 256 characters (the router's
    own id is used then)."""
    value = client.get("X-Request-Id")
    if value is None and body is not None:
        value = body.get("request_id")
    if not isinstance(value, str):
        return ""
    value = value.strip()
    ok = len(value) <= _MAX_CLIENT_REQUEST_ID and value.isascii() and value.isprintable()
    return value if ok else ""


class UpstreamError(Exception):
    """The engine could not be asked, or its answer broke off."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass(frozen=True)
class Reply:
    """A complete answer of an engine."""

    status: int
    body: bytes
    content_type: str

    def json(self) -> Any:
        """The body as JSON (None when it is not)."""
        try:
            return _decode(self.body)
        except UNDECODABLE:
            return None


def _failure_of(e: BaseException) -> Failure:
    if never_delivered(e):
        return Failure(FailureKind.CONNECT)
    if isinstance(e, TimeoutError):
        return Failure(FailureKind.TIMEOUT)
    return Failure(FailureKind.PROTOCOL)


def _check_delivered(url: str, r: aiohttp.ClientResponse) -> None:
    """A sidecar's 502 for an engine it never reached fails like an unreachable node."""
    if r.status == 502 and NOT_DELIVERED_HEADER in r.headers:
        raise UpstreamError(
            Failure(FailureKind.CONNECT), f"{url}: the engine behind the sidecar is unreachable"
        )


def tokenize_request(path: str, body: Mapping[str, Any]) -> dict[str, Any] | list[int] | None:
    """The /tokenize body rendering the same prompt as the request, its token ids when it
    carries them already, or None when there is no single prompt to tokenize."""
    out: dict[str, Any] = {}
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]
    if path.endswith("/chat/completions"):
        for name in _CHAT_TEMPLATE_FIELDS:
            if name in body:
                out[name] = body[name]
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        # Ids out of range: no reuse; the engine answers the client's mistake itself.
        return list(prompt) if min(prompt) >= 0 and max(prompt) < _MAX_TOKEN_ID else None
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


class _Tokenized(msgspec.Struct):
    tokens: list[Annotated[int, msgspec.Meta(ge=0, lt=_MAX_TOKEN_ID)]]


_decode_tokenized = msgspec.json.Decoder(_Tokenized).decode


def tokens_of(raw: bytes) -> list[int] | None:
    """Token ids of a /tokenize answer (None: not one). Typed decoding checks the ids in C:
    this runs on every conversation turn, on prompts of up to hundreds of thousands of tokens."""
    try:
        tokens = _decode_tokenized(raw).tokens
    except UNDECODABLE:  # (ValidationError too)
        return None
    return tokens or None


def authorization(settings: UpstreamSettings, client: Mapping[str, str]) -> str | None:
    """The Authorization an engine gets: the engine key when there is one, else the client's."""
    if settings.api_key:
        return f"Bearer {settings.api_key}"
    return client.get(hdrs.AUTHORIZATION)


class Engines:
    """Requests to engines over one pooled aiohttp session."""

    def __init__(self, http: aiohttp.ClientSession, settings: UpstreamSettings) -> None:
        self._http = http
        self._s = settings
        self._bounded = aiohttp.ClientTimeout(
            total=settings.prefill_timeout_s, sock_connect=settings.connect_timeout_s
        )
        self._streaming = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.decode_idle_timeout_s
        )

    def headers(
        self,
        client: Mapping[str, str],
        turn_id: str,
        extra: Sequence[tuple[str, str]] = (),
        answer_id: str = "",
    ) -> dict[str, str]:
        """Headers of a request to an engine: `turn_id` is the router's id of the request;
        X-Request-Id is `answer_id`, else the client's own, else `turn_id` (vLLM names its
        answer after it)."""
        out = {
            "Content-Type": "application/json",
            # identity: the router reads D's answer (and passes it on as it came)
            "Accept-Encoding": "identity",
            "X-Request-Id": answer_id or client_request_id(client) or turn_id,
            TURN_ID_HEADER: turn_id,
        }
        auth = authorization(self._s, client)
        if auth is not None:
            out["Authorization"] = auth
        for name in _FORWARDED:
            if name in client:
                out[name] = client[name]
        out.update(extra)
        return out

    def _timeout(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        if timeout_s is None:
            return self._bounded
        return aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._s.connect_timeout_s)

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float | None = None
    ) -> Reply:
        """POST and read the whole answer (bounded by `timeout_s`, default the prefill timeout)."""
        timeout = self._timeout(timeout_s)
        try:
            async with self._http.post(url, data=body, headers=headers, timeout=timeout) as r:
                raw = await r.read()
                _check_delivered(url, r)
                return Reply(r.status, raw, r.headers.get(hdrs.CONTENT_TYPE, ""))
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UpstreamError(_failure_of(e), f"{url}: {str(e) or type(e).__name__}") from e

    async def get(self, url: str, headers: Mapping[str, str], timeout_s: float | None = None) -> Reply:
        """GET and read the whole answer (bounded by `timeout_s`, default the prefill timeout)."""
        try:
            async with self._http.get(url, headers=headers, timeout=self._timeout(timeout_s)) as r:
                return Reply(r.status, await r.read(), r.headers.get(hdrs.CONTENT_TYPE, ""))
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UpstreamError(_failure_of(e), f"{url}: {str(e) or type(e).__name__}") from e

    async def open(self, url: str, body: bytes, headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        """POST and return as soon as the status line is in; the caller reads and releases it."""
        try:
            r = await self._http.post(url, data=body, headers=headers, timeout=self._streaming)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise UpstreamError(_failure_of(e), f"{url}: {str(e) or type(e).__name__}") from e
        try:
            _check_delivered(url, r)
        except UpstreamError:
            r.release()
            raise
        return r
