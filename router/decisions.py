"""What the router decides per turn, as pure functions over plain data.

- `single_sequence`: whether a request can go through P/D at all.
- `reuse_of`: the daemon's lookup answer -> what to hand the prefill node;
  `verified_reuse`, the same for an answer whose prompt the router verifies itself.
- `prefill_kv_params`, `prefill_body`, `decode_body`: the two engine requests.
- `retry_after`, `retry_decode_elsewhere`: what to do when an engine request failed.
- `Breaker`: when to stop asking a daemon that keeps failing, and when to ask again.

The rule everywhere: a control-plane problem never becomes a client error. When
anything about reuse is in doubt, the turn is served as plain P/D.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.releases import nothing_to_pull, notifiable
from kvferry.verification import UNVERIFIABLE, Held, pull_params, verdict

#: kv_transfer_params for a prefill node that computes everything and keeps the KV for D.
FRESH: Mapping[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}

#: Body fields a prefill request must not carry (vLLM's P runs one non-streaming step).
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
#: Body fields that are the router's, never the engines'.
_ROUTER_FIELDS = ("conversation_id",)


class Skip(enum.StrEnum):
    """Why a turn with a conversation id was not looked up (lookup metric reasons)."""

    REUSE_OFF = "reuse_off"
    NO_DAEMON = "no_daemon"
    NO_TOKENS = "no_tokens"
    BACKOFF = "daemon_backoff"
    UNAVAILABLE = "daemon_unavailable"
    LATE = "daemon_timeout"
    ERROR = "daemon_error"
    MULTIPLE = "multiple_sequences"
    EMBEDDINGS = "prompt_embeds"
    MEDIA = "non_text_content"
    UNRENDERABLE = "prompt_not_reproducible"


@dataclass(frozen=True)
class LookupAnswer:
    """The daemon's LookupResponse as plain data."""

    pull: bool
    reason: str
    params: dict[str, Any]
    release: dict[str, Any]
    reusable_tokens: int
    check: Held | None = None
    """With a PULL answering a lookup sent with caller_verifies: D's sequence, to verify the
    prompt against (`verified_reuse`); `params` are then D's whole."""
    threshold: int = 0
    """With `check`: the daemon's recompute threshold."""


@dataclass(frozen=True)
class Reuse:
    """What the prefill node is told about D's blocks for one turn."""

    decision: str
    """PULL, RECOMPUTE (the daemon said so) or SKIPPED (not asked, or no usable answer)."""
    reason: str
    remote: dict[str, Any] | None = None
    """Params from the daemon to hand P: a pull, or a release (remote_num_tokens 0); None = none."""
    reusable_tokens: int = 0

    @property
    def pull(self) -> bool:
        return self.decision == "PULL"


def single_sequence(body: Mapping[str, Any]) -> bool:
    """Whether the request asks for one answer to one prompt, the only kind P/D serves.

    KV params describe one sequence's blocks. For a batch of prompts vLLM's P returns
    the params of its first prompt only, which D would apply to every prompt; with
    `n` > 1, D forks the request into several that would all pull, and free, the same
    blocks of P. Such requests are served by D alone, without params; so are prompts
    given as embeddings (`prompt_embeds`: one or several, which no token ids describe).
    (`best_of` is gone from vLLM's API: ignored there, and here.)
    """
    n = body.get("n")
    if (n is not None and n != 1) or body.get("prompt_embeds") is not None:
        return False
    prompt = body.get("prompt")
    # A list of token ids is one prompt; a list of strings or of id lists is a batch.
    return not (isinstance(prompt, list) and len(prompt) > 1 and any(type(t) is not int for t in prompt))


def decode_alone_reason(body: Mapping[str, Any]) -> Skip | None:
    """Why D serves the request alone, without P (None: it goes through P/D)."""
    if body.get("prompt_embeds") is not None:
        return Skip.EMBEDDINGS
    return None if single_sequence(body) else Skip.MULTIPLE


def plain_reason(body: Mapping[str, Any]) -> Skip | None:
    """Why the request goes through P/D plain, nothing looked up, scored or retained (None:
    the router can verify and reuse its prompt)."""
    if not text_only(body):
        return Skip.MEDIA
    return None if reproducible(body) else Skip.UNRENDERABLE


def reproducible(body: Mapping[str, Any]) -> bool:
    """Whether P's /tokenize renders the prompt the engines themselves render for the
    request, so that the digests verified against D's blocks are of the prompt P computes
    (and token ids forwarded to engines that skip their own rendering are the request's).

    Not when the prompt depends on what /tokenize is not told: `truncate_prompt_tokens`
    (the request's prompt is cut; the tokenized one is not), a `tool_choice` other than
    "auto" with tools ("none": an engine started with --exclude-tools-when-tool-choice-none
    renders the request without the tools; "required" or a named function: vLLM 0.32's
    Kimi K3 renderer puts it in the prompt, renderers/kimi_k3.py), `response_format`
    (the same renderer's), or what a chat request hands its template that vLLM's
    TokenizeChatRequest has no field for: `documents` (RAG documents) and
    `reasoning_effort` (thinking on or off)."""
    if any(body.get(name) is not None for name in _UNTOKENIZABLE):
        return False
    return not (body.get("tools") and body.get("tool_choice") not in (None, "auto"))


#: Request fields that change the prompt and that /tokenize cannot be given.
_UNTOKENIZABLE = ("truncate_prompt_tokens", "documents", "reasoning_effort", "response_format")


def text_only(body: Mapping[str, Any]) -> bool:
    """Whether every message's content is text (a string, or parts of type "text").

    The prompt's digests cover its token ids alone: two images of one size tokenize to
    the same placeholder ids, so a turn whose history holds an image (audio, video, a
    file...) cannot be verified against D's blocks. vLLM's own prefix-cache hashes add
    each item's hash for that reason; the router has none to add."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True  # a completion: its prompt is text or token ids
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            not isinstance(part, Mapping) or part.get("type") != "text" for part in content
        ):
            return False
    return True


def skipped(reason: Skip) -> Reuse:
    return Reuse("SKIPPED", reason.value)


def _usable_pull(params: Mapping[str, Any]) -> bool:
    """P can pull with these: blocks, and the holder named (the keys vLLM needs, with values)."""
    return bool(params.get("remote_block_ids")) and notifiable(params)


def reuse_of(answer: LookupAnswer) -> Reuse:
    """The daemon's answer as the prefill node's instructions."""
    if answer.pull:
        usable = _usable_pull(answer.params)
        if answer.reusable_tokens > 0 and usable:
            return Reuse("PULL", answer.reason, answer.params, answer.reusable_tokens)
        # A PULL we cannot hand over intact is not worth a failed prefill; its blocks
        # were claimed all the same, so they are released when the params allow it.
        return Reuse("RECOMPUTE", "unusable_params", nothing_to_pull(answer.params) if usable else None)
    release = answer.release if answer.release and _usable_pull(answer.release) else None
    return Reuse("RECOMPUTE", answer.reason, release)


def verified_reuse(answer: LookupAnswer, prompt: tuple[int, bytes] | None) -> Reuse:
    """The answer to a lookup sent with caller_verifies, the prompt (its token count and
    block digests; None: none could be made) verified here by the daemon's own rule: a pull
    cut to what the digests verify, else D's blocks released (the daemon claimed them)."""
    reuse = reuse_of(answer)
    if not reuse.pull or reuse.remote is None:
        return reuse
    release = nothing_to_pull(reuse.remote)
    if answer.check is None:  # (a PULL with nothing to verify against is never handed over)
        return Reuse("RECOMPUTE", UNVERIFIABLE, release)
    if prompt is None:
        return Reuse("RECOMPUTE", "no_prompt", release)
    found = verdict(answer.check, prompt[0], prompt[1], answer.threshold)
    if not found.pull:
        return Reuse("RECOMPUTE", found.reason, release)
    keep = found.keep_blocks(answer.check.block_size)
    return Reuse("PULL", found.reason, pull_params(reuse.remote, found.tokens, keep), found.tokens)


def prefill_kv_params(reuse: Reuse | None, prompt_token_ids: Sequence[int] | None) -> dict[str, Any]:
    """kv_transfer_params for the prefill request (with `prompt_token_ids` only for engines
    that take them: `UpstreamSettings.forward_prompt_token_ids`)."""
    kv = dict(reuse.remote) if reuse is not None and reuse.remote else {}
    kv.update(FRESH)
    if prompt_token_ids is not None:
        kv["prompt_token_ids"] = prompt_token_ids
    return kv


def _engine_body(body: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(body)
    for name in _ROUTER_FIELDS:
        out.pop(name, None)
    return out


def prefill_body(body: Mapping[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the prefill node gets it: one token, not streamed, P's params."""
    out = _engine_body(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for name in _NOT_FOR_PREFILL:
        out.pop(name, None)
    out["kv_transfer_params"] = kv_params
    return out


def decode_body(
    body: Mapping[str, Any], prefill_params: Mapping[str, Any] | None, prompt_token_ids: Sequence[int] | None
) -> dict[str, Any]:
    """The client's request as the decode node gets it: P's params (and `prompt_token_ids`,
    given only for engines that take them; D renders the prompt itself otherwise).

    Without P's params (none came back, or D serves alone) D gets no kv_transfer_params at
    all, token ids neither: vLLM's connector takes any request with params and no
    do_remote_decode for a decode-side one, and pins its blocks when it finishes, but
    tracks their expiry only for one that came with a prefill's params; those blocks
    would never be freed."""
    out = _engine_body(body)
    if not prefill_params:
        out.pop("kv_transfer_params", None)
        return out
    kv = dict(prefill_params)
    if prompt_token_ids is not None:
        kv["prompt_token_ids"] = prompt_token_ids
    out["kv_transfer_params"] = kv
    return out


class FailureKind(enum.StrEnum):
    CONNECT = "connect"
    """Could not reach the engine: it never saw the request."""
    TIMEOUT = "timeout"
    STATUS = "status"
    """The engine answered an error status."""
    PROTOCOL = "protocol"
    """The answer broke off or was not what an engine sends."""


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    status: int = 0

    @property
    def client_error(self) -> bool:
        """The engine refused the request itself (4xx): the client should see that answer."""
        return self.kind is FailureKind.STATUS and 400 <= self.status < 500


class Retry(enum.Enum):
    FRESH = "fresh"
    """Again without the daemon's params (P computes everything)."""
    OTHER_NODE = "other_node"
    """The same request on another prefill node."""


def retry_after(
    failure: Failure, sent_remote: bool, attempt: int, other_node_available: bool
) -> Retry | None:
    """What to do after a failed prefill request (None: give up and answer the client).

    One retry per turn. An unreachable P is retried on another P, with the daemon's
    params if it had them: it never saw them, D still holds the blocks, and any P can
    pull them (dropping them would leave D's blocks pinned until they expire). A
    failure with the params (a failed pull, an expired or reused block list, a P that
    rejects them) is retried without them. A P's own 4xx without params is the
    client's answer; so is a timeout (retrying would double the wait).
    """
    if attempt >= 1 or failure.kind is FailureKind.TIMEOUT:
        return None
    if failure.kind is FailureKind.CONNECT and other_node_available:
        return Retry.OTHER_NODE
    if sent_remote:
        return Retry.FRESH
    return None


def spends_retry(retry: Retry, sent_remote: bool) -> bool:
    """Whether `retry` uses up the turn's one retry: moving the daemon's params, untried,
    to another P does not (that P's pull may still fail and need a FRESH retry)."""
    return not (retry is Retry.OTHER_NODE and sent_remote)


def retry_decode_elsewhere(failure: Failure, other_node_available: bool) -> bool:
    """Whether a failed decode request goes to another D: only when D never saw it (any D
    can pull P's blocks), never once D answered (it may have started the request)."""
    return failure.kind is FailureKind.CONNECT and other_node_available


@dataclass
class Breaker:
    """Stops lookups to a failing daemon for a while, doubling the pause per failure.

    A turn asked while the breaker is open is served without reuse at once
    instead of waiting for the lookup deadline. The first turn after the pause
    asks again; one success closes the breaker.
    """

    base_s: float
    max_s: float
    failures: int = 0
    open_until: float = 0.0

    def allows(self, now: float) -> bool:
        return now >= self.open_until

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.failures = 0
            self.open_until = 0.0
            return
        self.failures += 1
        self.open_until = now + min(self.base_s * 2 ** min(self.failures - 1, 30), self.max_s)
