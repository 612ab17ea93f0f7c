"""Validation of a `tandem.v1.GenerateRequest` before any worker sees it. Pure: no gRPC calls.

`validate(request, limits, tokenizer)` returns the prompt's token ids and the sampling parameters,
or raises `InvalidRequest` naming the field, which the router turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.v1 import api_pb2

from cluster.config import MAX_ADAPTER_NAME
from cluster.engine.request import MAX_CACHE_SALT, SamplingParams, params_from_proto
from cluster.engine.structured import Grammars

MAX_BEAMS = 16  # each beam is a sequence in the decode batch
_ID = re.compile(r"[A-Za-z0-9_.:/-]+")  # ids travel in gRPC metadata, which takes printable ASCII only


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    # Called with `tools=` (OpenAI's tool definitions) only when a chat carries tools.
    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class Limits:
    context_length: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_request_id_chars: int = 128


def validate(
    request: api_pb2.GenerateRequest, limits: Limits, tokenizer: PromptTokenizer, grammars: Grammars | None = None
) -> tuple[list[int], SamplingParams]:
    """`grammars` compiles a structured-output constraint (cached by its hash): a bad one is refused
    here, before any worker sees the request; without it constrained requests are refused."""
    if len(request.request_id) > limits.max_request_id_chars:
        raise InvalidRequest("request_id", f"longer than {limits.max_request_id_chars} characters")
    if request.request_id and not _ID.fullmatch(request.request_id):
        raise InvalidRequest("request_id", "use letters, digits and - _ . : / only")
    prompt = _prompt(request, limits, tokenizer)
    params = _sampling(request.sampling, limits, len(prompt))
    if params.structured is not None:
        if grammars is None:
            raise InvalidRequest("sampling.structured", "structured output is not available for this model")
        try:
            grammars.check(params.structured)
        except ValueError as e:
            raise InvalidRequest("sampling", str(e)) from None
    if request.HasField("resume"):
        _resume(request.resume, limits, params)
    return prompt, params


def _resume(resume: api_pb2.Resume, limits: Limits, params: SamplingParams) -> None:
    if not _ID.fullmatch(resume.request_id) or len(resume.request_id) > limits.max_request_id_chars:
        raise InvalidRequest("resume.request_id", "the broken stream's request id is required")
    if any(t >= limits.vocab_size for t in resume.token_ids):
        raise InvalidRequest("resume.token_ids", "a token id is outside the vocabulary")
    if len(resume.token_ids) >= params.max_tokens:
        raise InvalidRequest("resume.token_ids", f"as many as max_tokens ({params.max_tokens}): nothing to resume")
    if params.num_beams > 1:
        raise InvalidRequest("resume", "a beam search cannot be resumed")


def _prompt(request: api_pb2.GenerateRequest, limits: Limits, tokenizer: PromptTokenizer) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("text", "the prompt is empty")
        ids = tokenizer.encode(request.text)
    elif kind == "chat":
        messages = [_message(m, i) for i, m in enumerate(request.chat.messages)]
        if not messages:
            raise InvalidRequest("chat.messages", "no messages")
        tools = _json_list(request.chat.tools_json, "chat.tools_json")
        try:
            ids = tokenizer.encode_chat(messages, tools=tools) if tools else tokenizer.encode_chat(messages)
        except ValueError as e:
            raise InvalidRequest("chat", str(e)) from None
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise InvalidRequest("token_ids.ids", f"token id {bad[0]} is outside the vocabulary ({limits.vocab_size})")
    else:
        raise InvalidRequest("prompt", "set one of text, chat or token_ids")
    if not ids:
        raise InvalidRequest(kind, "the prompt has no tokens")
    if len(ids) >= limits.context_length:
        raise InvalidRequest(kind, f"the prompt has {len(ids)} tokens; the context window is {limits.context_length}")
    return ids


def _message(m: api_pb2.ChatMessage, i: int) -> dict[str, Any]:
    if not m.role:
        raise InvalidRequest(f"chat.messages[{i}].role", "is empty")
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        out["tool_calls"] = _json_list(m.tool_calls_json, f"chat.messages[{i}].tool_calls_json")
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _json_list(text: str, field: str) -> list[Any]:
    """A JSON array of objects sent as text ("" is none)."""
    if not text:
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(field, f"not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InvalidRequest(field, "must be a JSON array of objects")
    return value


def _sampling(m: api_pb2.SamplingParams, limits: Limits, prompt_tokens: int) -> SamplingParams:
    room = limits.context_length - prompt_tokens
    max_tokens = m.max_tokens or room
    if max_tokens > room:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context window "
            f"({limits.context_length})",
        )
    checks = [
        ("temperature", not m.HasField("temperature") or m.temperature >= 0, "must be >= 0"),
        ("top_p", not m.HasField("top_p") or 0 < m.top_p <= 1, "must be in (0, 1]"),
        ("top_k", not m.HasField("top_k") or m.top_k == -1 or m.top_k >= 1, "must be -1 or >= 1"),
        ("min_p", not m.HasField("min_p") or 0 <= m.min_p <= 1, "must be in [0, 1]"),
        ("repetition_penalty", not m.HasField("repetition_penalty") or m.repetition_penalty > 0, "must be > 0"),
        ("presence_penalty", -2 <= m.presence_penalty <= 2, "must be in [-2, 2]"),
        ("frequency_penalty", -2 <= m.frequency_penalty <= 2, "must be in [-2, 2]"),
        ("min_tokens", m.min_tokens <= max_tokens, f"must be <= max_tokens ({max_tokens})"),
        ("logprobs", not m.HasField("logprobs") or m.logprobs <= 20, "must be <= 20"),
        ("prompt_logprobs", not m.HasField("prompt_logprobs") or m.prompt_logprobs <= 20, "must be <= 20"),
        ("stop", len(m.stop) <= limits.max_stop_strings, f"at most {limits.max_stop_strings} stop strings"),
        ("stop", all(m.stop), "stop strings must not be empty"),
        ("stop", all(len(s) <= limits.max_stop_string_chars for s in m.stop), "a stop string is too long"),
        ("num_beams", m.num_beams <= MAX_BEAMS, f"must be <= {MAX_BEAMS}"),
        ("early_stopping", m.early_stopping in api_pb2.EarlyStopping.values(), "unknown value"),
        ("cache_salt", len(m.cache_salt) <= MAX_CACHE_SALT, f"must be at most {MAX_CACHE_SALT} characters"),
        ("adapter", len(m.adapter) <= MAX_ADAPTER_NAME, f"must be at most {MAX_ADAPTER_NAME} characters"),
    ]
    for field, ok, message in checks:
        if not ok:
            raise InvalidRequest(f"sampling.{field}", message)
    bad = [t for t in m.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequest("sampling.stop_token_ids", f"token id {bad[0]} is outside the vocabulary")
    resolved = api_pb2.SamplingParams()
    resolved.CopyFrom(m)
    resolved.max_tokens = max_tokens  # the wire's 0, "up to the context window", resolved
    try:
        return params_from_proto(resolved)
    except ValueError as e:  # a combination no field check catches (beam search with stop strings, ...)
        raise InvalidRequest("sampling", str(e)) from None
