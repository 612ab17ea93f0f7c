"""The SDK's structured-output constraints, typed: pass one as `structured=` to `Client.generate`
or `Client.stream` (and their async twins). Imports protobuf and `tandem.v1` only.

    client.generate(prompt, structured=JsonSchema({"type": "object", ...}))
    client.generate(prompt, structured=Choice(["yes", "no"]))
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.v1 import api_pb2

__all__ = ["Choice", "Grammar", "JsonObject", "JsonSchema", "Regex", "Structured", "to_proto"]


@dataclass(frozen=True)
class JsonSchema:
    """The output is a JSON value valid against this schema (a dict, or its JSON text)."""

    schema: Mapping[str, Any] | str


@dataclass(frozen=True)
class JsonObject:
    """The output is any JSON object."""


@dataclass(frozen=True)
class Regex:
    """The whole output matches this regular expression (Rust `regex` syntax)."""

    pattern: str


@dataclass(frozen=True)
class Grammar:
    """The output is a sentence of this Lark grammar (llguidance's dialect; `start` starts it)."""

    lark: str


@dataclass(frozen=True)
class Choice:
    """The output is exactly one of these strings."""

    options: Sequence[str]


Structured = JsonSchema | JsonObject | Regex | Grammar | Choice


def to_proto(c: Structured) -> api_pb2.Structured:
    if isinstance(c, JsonSchema):
        text = c.schema if isinstance(c.schema, str) else json.dumps(c.schema)
        return api_pb2.Structured(json_schema=text)
    if isinstance(c, JsonObject):
        return api_pb2.Structured(json_object=True)
    if isinstance(c, Regex):
        return api_pb2.Structured(regex=c.pattern)
    if isinstance(c, Grammar):
        return api_pb2.Structured(grammar=c.lark)
    if isinstance(c, Choice):
        return api_pb2.Structured(choice=api_pb2.Choices(choices=list(c.options)))
    raise TypeError(f"structured: expected JsonSchema, JsonObject, Regex, Grammar or Choice, not {type(c).__name__}")
