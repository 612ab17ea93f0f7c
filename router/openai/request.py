"""An OpenAI request body as a `tandem.v1.GenerateRequest` and the shape of its reply (`Plan`).

The body is first checked against its endpoint's field table (`router.openai.fields`); every
honoured field is then read here. Raises `FieldError` naming the field. Pure: no gRPC calls.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tandem.v1 import api_pb2

from cluster.engine.request import EARLY_STOPPING, MAX_CACHE_SALT
from router.openai.fields import CHAT, COMPLETIONS, FieldError, check
from router.openai.tools import Tools, structured, tools

SAMPLING = {  # body field -> tandem.v1.SamplingParams field (stop_token_ids is a list)
    "temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos", "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids", "speculative_tokens": "speculative_tokens", "num_beams": "num_beams",
    "length_penalty": "length_penalty",
}  # fmt: skip
BUDGET = ("ttft_seconds", "tpot_seconds")  # body field = tandem.v1.LatencyBudget field
UINT32 = 2**32


MAX_PROMPTS = 64  # prompts in one completions request


@dataclass(frozen=True)
class Plan:
    """What to ask the cluster (`n` calls of each request: one request per prompt of a completions
    batch) and how to answer. Choice `p * n + j` is prompt `p`'s `j`-th."""

    requests: tuple[api_pb2.GenerateRequest, ...]
    chat: bool
    n: int
    stream: bool
    include_usage: bool  # a last chunk with the whole usage
    continuous_usage: bool  # usage so far in every chunk
    echo: bool
    prompt_texts: tuple[str | None, ...]  # each text prompt as sent (echoed); None: the router returns it (token ids)
    tools: Tools | None = None  # a chat's tools: its replies are read for tool calls
    echo_logprobs: int | None = None  # echo with logprobs: the echoed prompt's tokens lead the logprobs, top n each
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: each prompt token's, with the top n, by token id

    @property
    def request(self) -> api_pb2.GenerateRequest:
        """The first (a chat's only) request."""
        return self.requests[0]


def completion_plan(body: dict[str, Any]) -> Plan:
    check(body, COMPLETIONS)
    prompts = _completion_prompts(body.get("prompt"))
    echo = _flag(body, "echo")
    requests, texts = [], []
    constraint = structured(body)
    for prompt in prompts:
        request = _request(body, prompt, chat=False)
        if constraint is not None:
            request.sampling.structured.CopyFrom(constraint)
        text = prompt.get("text")
        request.return_prompt_text = echo and text is None
        requests.append(request)
        texts.append(text)
    return _plan(body, requests, chat=False, echo=echo, prompt_texts=texts)


def chat_plan(body: dict[str, Any]) -> Plan:
    check(body, CHAT)
    request = _request(body, {"chat": _chat_prompt(body.get("messages"))}, chat=True)
    found, calls = tools(body)
    constraint = structured(body)
    if calls is not None and constraint is not None:
        raise FieldError("tool_choice", "a required or named tool_choice cannot be combined with response_format")
    if found is not None:
        request.chat.tools_json = found.json
    if (constraint := constraint or calls) is not None:
        request.sampling.structured.CopyFrom(constraint)
    return dataclasses.replace(_plan(body, [request], chat=True, echo=False, prompt_texts=[None]), tools=found)


def _plan(
    body: dict[str, Any], requests: list[api_pb2.GenerateRequest], chat: bool, echo: bool,
    prompt_texts: list[str | None],
) -> Plan:  # fmt: skip
    n = body.get("n")
    n = 1 if n is None else n
    if not _integer(n) or not 1 <= n <= 16:
        raise FieldError("n", "n must be an integer in [1, 16]")
    stream, options = _flag(body, "stream"), body.get("stream_options")
    if options is not None and not stream:
        raise FieldError("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options or {}, dict):
        raise FieldError("stream_options", "stream_options must be an object")
    usage = _flag(options or {}, "include_usage", "stream_options.")
    continuous = _flag(options or {}, "continuous_usage_stats", "stream_options.")
    echo_logprobs = body["logprobs"] if echo and body.get("logprobs") is not None else None
    prompt_logprobs = requests[0].sampling.prompt_logprobs if body.get("prompt_logprobs") is not None else None
    return Plan(
        tuple(requests), chat, n, stream, usage, continuous, echo, tuple(prompt_texts),
        echo_logprobs=echo_logprobs, prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def _completion_prompts(prompt: Any) -> list[dict[str, Any]]:
    """The GenerateRequest prompt field of each prompt of a completions body: a string, a list of
    token ids, or a list of either (a batch)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise FieldError("prompt", f"at most {MAX_PROMPTS} prompts in one request, not {len(prompt)}")
        return [_completion_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_completion_prompt(prompt, "prompt")]


def _completion_prompt(prompt: Any, where: str) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list) and prompt and all(_integer(t) and 0 <= t < UINT32 for t in prompt):
        return {"token_ids": api_pb2.TokenIds(ids=prompt)}
    raise FieldError(where, f"{where} must be a string or a non-empty list of token ids (or a list of either)")


def _chat_prompt(messages: Any) -> api_pb2.ChatPrompt:
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty list")
    return api_pb2.ChatPrompt(messages=[_message(m, f"messages[{i}]") for i, m in enumerate(messages)])


def _message(m: Any, where: str) -> api_pb2.ChatMessage:
    if not isinstance(m, dict):
        raise FieldError(where, f"{where} must be an object")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise FieldError(f"{where}.role", f"{where}.role must be a non-empty string")
    if content is None and role == "assistant":
        content = m.get("refusal") or ""
    if isinstance(content, list):
        content = "".join(_part(p, f"{where}.content[{j}]", role) for j, p in enumerate(content))
    if content is None and m.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise FieldError(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    message = api_pb2.ChatMessage(role="system" if role == "developer" else role, content=content)
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(_tool_call(c) for c in calls):
            raise FieldError(f"{where}.tool_calls", f"{where}.tool_calls must be OpenAI tool calls")
        message.tool_calls_json = json.dumps(calls)
    if m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise FieldError(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string")
        message.tool_call_id = m["tool_call_id"]
    return message


def _tool_call(c: Any) -> bool:
    function = c.get("function") if isinstance(c, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _part(part: Any, where: str, role: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = "text" if kind == "text" else "refusal" if kind == "refusal" and role == "assistant" else None
    if key is None or not isinstance(part.get(key), str):
        raise FieldError(f"{where}.type", f"{where}: only text parts (and an assistant's refusal parts) are read")
    return str(part[key])


def _request(body: dict[str, Any], prompt: dict[str, Any], chat: bool) -> api_pb2.GenerateRequest:
    request = api_pb2.GenerateRequest(sampling=_sampling(body, chat), **prompt)
    for key in BUDGET:
        if body.get(key) is not None:
            _set(request.budget, key, body[key], key)
    return request


def _sampling(body: dict[str, Any], chat: bool) -> api_pb2.SamplingParams:
    sampling = api_pb2.SamplingParams(max_tokens=_max_tokens(body, chat))
    for key, field in SAMPLING.items():
        if body.get(key) is not None:
            _set(sampling, field, body[key], key)
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, str) and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise FieldError("stop", "stop must be a string or a list of strings")
        sampling.stop.extend([stop] if isinstance(stop, str) else stop)
    early = body.get("early_stopping")
    if early is not None:
        early = {True: "true", False: "false"}.get(early, early) if isinstance(early, bool) else early
        if not isinstance(early, str) or early not in EARLY_STOPPING:
            raise FieldError("early_stopping", 'early_stopping must be true, false or "never"')
        sampling.early_stopping = EARLY_STOPPING[early]
    if chat:
        top = body.get("top_logprobs")
        if _flag(body, "logprobs"):
            sampling.logprobs = _count(0 if top is None else top, "top_logprobs")
        elif top is not None:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
    elif body.get("logprobs") is not None:
        sampling.logprobs = _count(body["logprobs"], "logprobs")
    if body.get("cache_salt") is not None:
        salt = body["cache_salt"]
        if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
            raise FieldError(
                "cache_salt", f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters"
            )
        sampling.cache_salt = salt
    if body.get("prompt_logprobs") is not None:
        if _flag(body, "stream"):
            raise FieldError("prompt_logprobs", "prompt_logprobs is not available with stream: true")
        sampling.prompt_logprobs = _count(body["prompt_logprobs"], "prompt_logprobs")
    if not chat and _flag(body, "echo") and sampling.HasField("logprobs"):  # the echoed prompt's logprobs
        sampling.prompt_logprobs = max(sampling.prompt_logprobs, sampling.logprobs)
    return sampling


def _max_tokens(body: dict[str, Any], chat: bool) -> int:
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is None:
        return 0 if chat else 16  # chat: up to the context window; completions: OpenAI's default
    if not _integer(value) or not 1 <= value < UINT32:
        raise FieldError(key, f"{key} must be an integer >= 1")
    return int(value)


def _set(message: Any, field: str, value: Any, key: str) -> None:
    try:
        if hasattr(getattr(message, field), "extend"):  # a repeated field
            getattr(message, field).extend(value)
        else:
            setattr(message, field, value)
    except (TypeError, ValueError) as e:
        raise FieldError(key, f"{key}: {e}") from None


def _count(value: Any, key: str) -> int:
    if not _integer(value) or not 0 <= value < UINT32:
        raise FieldError(key, f"{key} must be an integer >= 0")
    return int(value)


def _flag(body: dict[str, Any], key: str, prefix: str = "") -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise FieldError(prefix + key, f"{prefix}{key} must be true or false")
    return bool(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
