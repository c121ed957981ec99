"""The bodies vLLM's OpenAI-compatible routes take, and what a request asks of the engine.

Request types are msgspec structs decoded straight from the body (unknown fields are
ignored, as vLLM's pydantic models do); the functions check what vLLM checks before a
request reaches its engine (the model, ``n``), and read its prompts and the ids of its
engine sequences (one per prompt of a batch, ``n`` each, named as vLLM names them).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from emulator.config import EmulatorConfig
from emulator.errors import InvalidRequest, ModelNotFound
from emulator.tokenizer import encode

_T = TypeVar("_T")


class StreamOptions(msgspec.Struct):
    """OpenAI ``stream_options``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(msgspec.Struct, kw_only=True):
    """What chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = None
    # null means the default for these, as in vLLM's request models
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    session_id: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    # only read to refuse n > 1 with greedy sampling, as vLLM does; the sampler ignores it
    temperature: float | None = None
    skip_special_tokens: bool = True


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    """Body of ``/v1/chat/completions`` (unknown fields are ignored, like vLLM)."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # what vLLM's chat request also hands the template, and its /tokenize has no field for
    documents: list[Any] | None = None
    reasoning_effort: str | None = None

    def template_context(self) -> dict[str, Any]:
        given = {"documents": self.documents, "reasoning_effort": self.reasoning_effort}
        return template_context(self.tools, self.chat_template_kwargs, given)


class CompletionRequest(GenerationRequest, kw_only=True):
    """Body of ``/v1/completions`` (``best_of``, gone from vLLM, is ignored like vLLM does)."""

    # a text, token ids, or a batch of texts or of token id lists
    prompt: str | list[int | str | list[int]]
    max_tokens: int | None = 16
    use_beam_search: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``/tokenize``: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def template_context(self) -> dict[str, Any]:
        return template_context(self.tools, self.chat_template_kwargs, {})


def template_context(
    tools: list[Any] | None, kwargs: dict[str, Any] | None, given: dict[str, Any]
) -> dict[str, Any]:
    """What the chat template is given besides the messages, merged as vLLM does: the
    tools as a default the request's chat_template_kwargs may override, and the request's
    own template fields that are set (not None, not "auto": `merge_kwargs`) over both."""
    defaults = {"tools": tools} if tools is not None else {}
    return {**defaults, **(kwargs or {}), **{k: v for k, v in given.items() if v is not None and v != "auto"}}


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``/detokenize``."""

    tokens: list[int]
    model: str | None = None


def decode_body(request_type: type[_T], raw: bytes) -> _T:
    """The body as a `request_type` (msgspec errors are the caller's 400s)."""
    if not raw:
        raise InvalidRequest("The request body must be a JSON object.")
    return msgspec.json.decode(raw, type=request_type)


def check_model(config: EmulatorConfig, model: str | None) -> None:
    """Refuse a model other than the one served (no model named: the served one)."""
    if model is not None and model != config.model:
        raise ModelNotFound(f"The model `{model}` does not exist.")


def completion_prompts(prompt: str | list[int | str | list[int]]) -> list[list[int]]:
    """The token ids of each prompt of a completion request."""
    if isinstance(prompt, str):
        return [encode(prompt)]
    ids = [p for p in prompt if isinstance(p, int)]
    if len(ids) == len(prompt):
        return [ids]
    texts = [p for p in prompt if isinstance(p, str)]
    if len(texts) == len(prompt):
        return [encode(text) for text in texts]
    batch = [p for p in prompt if isinstance(p, list)]
    if len(batch) == len(prompt):
        return batch
    raise InvalidRequest("The prompt must be a string, token ids, or a list of strings or of token ids.")


#: vLLM's defaults: ``VLLM_MAX_N_SEQUENCES``, and the temperature below which it samples greedily.
_MAX_N = 16384
_SAMPLING_EPS = 1e-5


def num_sequences(body: GenerationRequest) -> int:
    """``n``, checked as vLLM's ``SamplingParams`` checks it."""
    n = 1 if body.n is None else body.n
    if n < 1:
        raise InvalidRequest(f"n must be at least 1, got {n}.")
    if n > _MAX_N:
        raise InvalidRequest(f"n must be at most {_MAX_N}, got {n}.")
    if n > 1 and body.temperature is not None and body.temperature < _SAMPLING_EPS:
        raise InvalidRequest(f"n must be 1 when using greedy sampling, got {n}.")
    return n


def sequence_ids(request_id: str, num_prompts: int, n: int, chat: bool) -> list[str]:
    """Engine request ids, prompt by prompt, n each: vLLM's ``{id}-{prompt}`` for the prompts of
    a completion and ``{i}_{parent}`` for the n children of one; a plain request keeps its id."""
    if num_prompts == 1 and n == 1:
        return [request_id]
    parents = [request_id] if chat else [f"{request_id}-{p}" for p in range(num_prompts)]
    return [parent if n == 1 else f"{i}_{parent}" for parent in parents for i in range(n)]
