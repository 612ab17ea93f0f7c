"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: a body becomes a chat body
(`chat_body`), runs as a chat completion does, and its reply is written as a `response` object
(`response`) or as the Responses API's stream of events (`events`).

    input            a string (one user turn) or a list of items: messages (`input_text` /
                     `output_text` parts or a string), `function_call` and `function_call_output`
    instructions     a system turn before the input
    tools            function tools ({"type": "function", "name", "description", "parameters"})
    text.format      "text", "json_object" or "json_schema" (name, schema, strict, description)
    output           a `message` item with one `output_text` part, then a `function_call` item
                     per call the reply makes

Nothing is stored: `previous_response_id` and `conversation` are refused, and a response cannot be
read back. Pure but for the event stream, which reads the chat call's messages.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tandem.v1 import api_pb2

from router.openai.fields import NOT_STORED, PROMPT_CACHE, FieldError, check, honoured, ignored, refused
from router.openai.request import Plan
from router.openai.response import messages_from
from router.openai.tools import ToolStream

TEXT_FORMAT = {
    "format": honoured('"text", "json_object" or "json_schema" (name, schema, strict, description): constrained'),
    "verbosity": refused("the served model has no verbosity control"),
}
RESPONSES = {
    "model": honoured("the served model's name, or a LoRA adapter's (`/v1/models` lists them; another is 404)"),
    "input": honoured(
        "a string, or a list of messages (text parts) and function_call / function_call_output items; an item's "
        "id and status are read past (nothing is stored), any other unknown key is refused"
    ),
    "instructions": honoured("a system turn before the input"),
    "tools": honoured(
        'function tools ({"type": "function", name, description, parameters, strict}), as chat\'s; strict or '
        "not, required and named calls are constrained to the parameters"
    ),
    "tool_choice": honoured('"none", "auto", "required" or {"type": "function", "name"}'),
    "parallel_tool_calls": honoured("false: at most one call"),
    "text": honoured("text.format: structured output", TEXT_FORMAT),
    "max_output_tokens": honoured("at least 1; up to the context window when unset"),
    "temperature": honoured("0 is greedy; unset: the model's default"),
    "top_p": honoured("nucleus sampling"),
    "stream": honoured("server-sent events: response.created ... response.completed"),
    "previous_response_id": refused("responses are not stored; send the whole conversation as input"),
    "conversation": refused("conversations are not stored; send the whole conversation as input"),
    "store": ignored(NOT_STORED + "; a response cannot be read back"),
    "metadata": ignored(NOT_STORED),
    "user": ignored(NOT_STORED),
    "safety_identifier": ignored(NOT_STORED),
    "service_tier": ignored("there is one tier"),
    "prompt_cache_key": ignored(PROMPT_CACHE),
    "truncation": refused("the input is never truncated; a prompt too long is refused", "disabled"),
    "include": refused("no extra output items are computed", []),
    "reasoning": refused("the served model has no reasoning mode"),
    "background": refused("responses run in the foreground", False),
    "max_tool_calls": refused("tool calls are not counted across turns"),
    "prompt": refused("stored prompts are not kept"),
    "top_logprobs": refused("the Responses API's logprobs are not written; use chat completions"),
}


# The keys of each input item the face reads. An item's `id` and `status` (what an earlier response
# wrote on it) are read past: nothing is stored to look them up.
ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status"),
    "function_call": ("type", "call_id", "name", "arguments", "id", "status"),
    "function_call_output": ("type", "call_id", "output", "id", "status"),
}
PART_KEYS = ("type", "text", "annotations", "logprobs")  # an earlier reply's output_text carries the last two


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body that asks for what a Responses body does."""
    check(body, RESPONSES)
    messages = [{"role": "system", "content": _text(body["instructions"], "instructions")}] if body.get(
        "instructions"
    ) is not None else []  # fmt: skip
    messages += _input(body.get("input"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": bool(body.get("stream"))}
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        _known(choice, ("type", "name"), "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    form = (body.get("text") or {}).get("format") if isinstance(body.get("text") or {}, dict) else None
    if form is not None:
        chat["response_format"] = _format(form)
    return chat


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(_list(value, "input")):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise FieldError(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind not in ITEM_KEYS:
            raise FieldError(f"{where}.type", f"{where}.type {kind!r} is not read (messages and function calls are)")
        _known(item, ITEM_KEYS[kind], where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise FieldError(f"{where}.role", f"{where}.role must be user, assistant, system or developer")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _text(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": _text(item.get("name"), f"{where}.name"),
                                 "arguments": _text(item.get("arguments"), f"{where}.arguments")}}  # fmt: skip
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # the calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{where}.call_id"),
                             "content": text})  # fmt: skip
    if not messages:
        raise FieldError("input", "input must not be empty")
    return messages


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(_list(content, f"{where}.content")):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise FieldError(f"{where}.content[{j}]", f"{where}.content[{j}]: only text parts are read")
        _known(part, PART_KEYS, f"{where}.content[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError(f"tools[{i}]", f'tools[{i}] must be a function tool ({{"type": "function", "name": ...}})')
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise FieldError(f"tools[{i}].{min(unknown)}", f"tools[{i}].{min(unknown)} is not read")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _format(form: Any) -> dict[str, Any]:
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError("text.format", 'text.format.type must be "text", "json_object" or "json_schema"')
    _known(form, ("type", "name", "description", "schema", "strict"), "text.format")
    if form["type"] != "json_schema":
        return {"type": form["type"]}
    schema = {k: form[k] for k in ("name", "description", "schema", "strict") if form.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def _known(item: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """Refuses, by name, a key of `item` the face does not read."""
    unknown = sorted(k for k in item if k not in keys and item[k] is not None)
    if unknown:
        raise FieldError(f"{where}.{unknown[0]}", f"{where}.{unknown[0]} is not read")


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise FieldError(where, f"{where} must be a list")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FieldError(where, f"{where} must be a string")
    return value


# -- the reply ---------------------------------------------------------------------------------------


def response(rid: str, body: dict[str, Any], model: str, chat: dict[str, Any], status: str = "completed") -> dict:
    """The `response` object for a chat completion's reply (`chat`, as `collect` writes it)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content"):
        output.append(_message_item(message["content"]))
    output += [_call_item(call) for call in message.get("tool_calls") or []]
    usage = chat["usage"]
    out = _shell(rid, body, model, status, output)
    if choice["finish_reason"] == "length":
        out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    out["usage"] = {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
    return out


def _shell(rid: str, body: dict[str, Any], model: str, status: str, output: list[dict[str, Any]]) -> dict:
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
        "output": output, "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}}, "previous_response_id": None, "store": False,
        "truncation": "disabled", "metadata": body.get("metadata") or {}, "error": None, "incomplete_details": None,
        "usage": None,
    }  # fmt: skip


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
            "content": [part] if text or status == "completed" else []}  # fmt: skip


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": "completed"}  # fmt: skip


class _Numbered:
    """Server-sent events of the Responses API, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        return f"event: {kind}\ndata: {data}\n\n".encode()


async def events(rid: str, body: dict[str, Any], model: str, plan: Plan, call, first) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
    """The Responses API's server-sent events for one chat call: the text as `output_text` deltas,
    each tool call as a `function_call` item once its block closes, `response.completed` with the
    whole response last. The call ends when the client goes away."""
    event = _Numbered()
    shell = _shell(rid, body, model, "in_progress", [])
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    reader = ToolStream(plan.tools.parallel) if plan.tools is not None else None
    text, calls, message, last = "", [], None, api_pb2.GenerateResponse()  # type: ignore[var-annotated]
    try:
        async for m in messages_from(call, first):
            last = m
            deltas = reader.feed(m.text) if reader is not None else [{"content": m.text}] if m.text else []
            if reader is not None and m.finish_reason:
                deltas += reader.finish()
            for delta in deltas:
                if delta.get("content"):
                    if message is None:
                        message = _message_item("", "in_progress")
                        yield event("response.output_item.added", output_index=0, item=message)
                        part = {"type": "output_text", "text": "", "annotations": []}
                        yield event("response.content_part.added", item_id=message["id"], output_index=0,
                                    content_index=0, part=part)  # fmt: skip
                    text += delta["content"]
                    yield event("response.output_text.delta", item_id=message["id"], output_index=0, content_index=0,
                                delta=delta["content"])  # fmt: skip
                calls += delta.get("tool_calls") or []
    finally:
        call.cancel()
    output: list[dict[str, Any]] = []
    for chunk in _closing(event, message, text, calls, output):
        yield chunk
    finish = "length" if last.finish_reason == api_pb2.FINISH_REASON_LENGTH else "stop"
    usage = last.usage
    chat = {"choices": [{"finish_reason": finish, "message": {"content": None}}],
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}}  # fmt: skip
    done = response(rid, body, model, chat)
    done["output"] = output
    yield event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)


def _closing(
    event: _Numbered, message: dict[str, Any] | None, text: str, calls: list[dict[str, Any]], output: list[dict]
) -> list[bytes]:
    """The events that close the message item and carry each call's item; the items go to `output`."""
    out = []
    if message is not None:
        part = {"type": "output_text", "text": text, "annotations": []}
        out.append(event("response.output_text.done", item_id=message["id"], output_index=0, content_index=0,
                         text=text))  # fmt: skip
        out.append(event("response.content_part.done", item_id=message["id"], output_index=0, content_index=0,
                         part=part))  # fmt: skip
        message = {**message, "status": "completed", "content": [part]}
        out.append(event("response.output_item.done", output_index=0, item=message))
        output.append(message)
    for call in calls:
        item, index = _call_item(call), len(output)
        opened = {**item, "arguments": "", "status": "in_progress"}
        out.append(event("response.output_item.added", output_index=index, item=opened))
        out.append(event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                         delta=item["arguments"]))  # fmt: skip
        out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         arguments=item["arguments"]))  # fmt: skip
        out.append(event("response.output_item.done", output_index=index, item=item))
        output.append(item)
    return out
