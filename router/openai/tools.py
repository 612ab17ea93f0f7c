"""The OpenAI face's structured output and tool calling. Pure: no gRPC calls.

- `response_format` (`text`, `json_object`, `json_schema`) and vLLM's `guided_json`,
  `guided_regex` and `guided_choice` become the request's `tandem.v1.Structured`.
- `tools` go to the chat template (`ChatPrompt.tools_json`; a template without tool support gets
  them in the system message, `cluster.model.chat_tools`). `tool_choice: "none"` leaves them out;
  `"required"` and a named function constrain the output to `<tool_call>` blocks whose JSON is a
  call of one of the (named) functions with arguments valid against its `parameters`; `"auto"`
  leaves the model free. `parallel_tool_calls: false` allows one call.
- The reply's text is parsed back into `tool_calls`, whole (`parse`) or as streamed deltas
  (`ToolStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.v1 import api_pb2

from cluster.model.chat_tools import CLOSE, OPEN
from router.openai.fields import FieldError

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
# Calls are written as the model's examples write them: ", " and ": ", no other free whitespace.
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tools:
    """A chat's tools: their definitions (JSON text, for the template) and how calls are read."""

    json: str
    names: tuple[str, ...]
    choice: str  # "auto", "required" or a function's name
    parallel: bool


def structured(body: dict[str, Any]) -> api_pb2.Structured | None:
    """The constraint a body's response_format or guided_* field asks for (at most one of them)."""
    asked = [k for k in ("response_format", "guided_json", "guided_regex", "guided_choice") if body.get(k) is not None]
    if len(asked) > 1:
        raise FieldError(asked[1], f"{asked[1]} cannot be combined with {asked[0]}")
    if not asked:
        return None
    key, value = asked[0], body[asked[0]]
    if key == "response_format":
        return _response_format(value)
    if key == "guided_json":
        if not isinstance(value, dict | str):
            raise FieldError(key, "guided_json must be a JSON schema (an object or its text)")
        return api_pb2.Structured(json_schema=value if isinstance(value, str) else json.dumps(value))
    if key == "guided_regex":
        if not isinstance(value, str):
            raise FieldError(key, "guided_regex must be a string")
        return api_pb2.Structured(regex=value)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise FieldError(key, "guided_choice must be a non-empty list of strings")
    return api_pb2.Structured(choice=api_pb2.Choices(choices=value))


def _response_format(value: Any) -> api_pb2.Structured | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise FieldError("response_format.type", f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}")
    extra = [k for k in value if k not in ("type", "json_schema")]
    if extra:
        raise FieldError(f"response_format.{extra[0]}", f"Unrecognized request argument: response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return api_pb2.Structured(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise FieldError("response_format.json_schema", "response_format.json_schema needs a name and a schema")
    extra = [k for k in spec if k not in JSON_SCHEMA_KEYS]
    if extra:
        name = f"response_format.json_schema.{extra[0]}"
        raise FieldError(name, f"Unrecognized request argument: {name}")
    schema = spec.get("schema") or {}
    if not isinstance(schema, dict):
        raise FieldError("response_format.json_schema.schema", "response_format.json_schema.schema must be an object")
    # strict or not, the output is constrained: it always validates.
    return api_pb2.Structured(json_schema=json.dumps(schema))


def tools(body: dict[str, Any]) -> tuple[Tools | None, api_pb2.Structured | None]:
    """A chat body's tools (None when there are none, or tool_choice is "none") and, for
    tool_choice required or named, the grammar of the calls."""
    defined, choice = body.get("tools") or [], body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    functions = [_function(t, i) for i, t in enumerate(defined)] if isinstance(defined, list) else None
    if functions is None:
        raise FieldError("tools", "tools must be a list of function tools")
    names = tuple(f["name"] for f in functions)
    mode = _choice(choice, names)
    if not functions or mode == "none":
        return None, None
    found = Tools(json.dumps(defined), names, mode, parallel is not False)
    if mode == "auto":
        return found, None
    chosen = [f for f in functions if mode in ("required", f["name"])]
    return found, api_pb2.Structured(grammar=calls_grammar(chosen, found.parallel))


def _function(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise FieldError(where, f'{where} must be {{"type": "function", "function": {{...}}}}')
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
        raise FieldError(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, _ . -")
    if not isinstance(function.get("parameters", {}), dict):
        raise FieldError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema")
    return function


def _choice(choice: Any, names: tuple[str, ...]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise FieldError("tool_choice", 'tool_choice "required" needs tools')
        return str(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise FieldError("tool_choice", 'tool_choice must be "none", "auto", "required" or a named function')
    if name not in names:
        raise FieldError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return name


def calls_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar: one `<tool_call>` block (or several, one a line, when `parallel`), each a
    JSON call of one of `functions` with arguments valid against its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {"anyOf": calls, "x-guidance": CALL_JSON}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}"
    return f"{start}\n{call}\nbody: %json {json.dumps(schema)}"


def _call(body: str) -> dict[str, Any] | None:
    """A `<tool_call>` block's JSON as an OpenAI tool call; None if it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": text}}  # fmt: skip


_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole reply: each well-formed `<tool_call>` block is a call (the
    first only, unless `parallel`); the rest of the text, stripped, is the content (None if empty
    when there are calls). A block that is not a call stays in the content."""
    calls, kept, at = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1).strip())
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        if parallel or not calls:
            calls.append(call)
    kept.append(text[at:])
    content = "".join(kept)
    if calls:
        return (content.strip() or None), calls
    return content, []


@dataclass
class ToolStream:
    """Streamed text → OpenAI deltas: content as it comes (holding back what may open a call, and
    whitespace until it is known not to surround calls only), each call whole once its block closes."""

    parallel: bool = True
    calls: int = 0
    _buffer: str = ""
    _space: str = ""  # whitespace-only content held back
    _in_call: bool = False
    _out: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buffer += text
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                self._close(self._buffer[:end])
                self._buffer, self._in_call = self._buffer[end + len(CLOSE) :], False
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._content(self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start + len(OPEN) :], True
                continue
            keep = _partial_open(self._buffer)
            self._content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        out, self._out = self._out, []
        return out

    def finish(self) -> list[dict[str, Any]]:
        """What is left at the end: an unclosed block or a partial tag, as content."""
        rest = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        self._content(rest)
        if self._space and not self.calls:
            self._out.append({"content": self._space})
        self._space = ""
        out, self._out = self._out, []
        return out

    def _close(self, body: str) -> None:
        call = _call(body.strip())
        if call is None:
            self._content(OPEN + body + CLOSE)
            return
        if self.parallel or not self.calls:
            self._out.append({"tool_calls": [{"index": self.calls, **call}]})
            self.calls += 1

    def _content(self, text: str) -> None:
        if not text:
            return
        if not text.strip():
            self._space += text
            return
        if self.calls and not self.parallel:
            return  # one call only: nothing after it
        self._out.append({"content": self._space + text})
        self._space = ""


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that begins `OPEN`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
