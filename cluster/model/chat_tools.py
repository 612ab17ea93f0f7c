"""Tool definitions for a chat template that takes none: the Hermes form (which Qwen2.5's template
writes, and which small instruct models follow) described in the system message, and earlier tool
calls written into their assistant turns the same way. Pure.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    f"{CLOSE}"
)


def tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    return PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def with_tools_prompt(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tools described at the end of the system message (a new one first if none)."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{tools_prompt(tools)}".lstrip()
        return out
    return [{"role": "system", "content": tools_prompt(tools)}, *out]


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it; `arguments` a JSON object, or its text."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # text that is not JSON is written as text
            arguments = json.loads(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def fold_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's `tool_calls` (OpenAI's shape) written into its content."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    texts = [call_text(c["function"]["name"], c["function"].get("arguments", "{}")) for c in calls]
    content = message.get("content") or ""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = "\n".join([content, *texts] if content else texts)
    return out
