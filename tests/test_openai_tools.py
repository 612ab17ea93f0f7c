"""The OpenAI face's tools without a cluster: tool calls parsed from a reply, whole and streamed in
any chunking, the calls grammar accepting exactly well-formed calls, tool definitions and earlier
calls rendered through a chat template that takes none, and bad tool fields named."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cluster.engine.request import Constraint
from cluster.engine.structured import Grammars
from cluster.model.chat_tools import tools_prompt
from cluster.model.tokenizer import Tokenizer
from router.openai.fields import FieldError
from router.openai.request import chat_plan
from router.openai.tools import ToolStream, calls_grammar, parse

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"], "additionalProperties": False}}  # fmt: skip
TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


def _strip(calls):  # type: ignore[no-untyped-def]
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_a_whole_reply_is_content_and_calls():
    content, calls = parse(TEXT)
    assert content == "Let me check."
    assert _strip(calls) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len(parse(TEXT, parallel=False)[1]) == 1
    assert parse("no calls here") == ("no calls here", [])
    assert parse("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])


@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_assemble_to_the_whole_reply_in_any_chunking(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 12))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
    reader, deltas = ToolStream(), []
    for piece in pieces:
        deltas += reader.feed(piece)
    deltas += reader.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    whole_content, whole_calls = parse(TEXT)
    assert content.strip() == whole_content
    assert _strip(calls) == _strip(whole_calls) and [c["index"] for c in calls] == [0, 1]
    plain, reader = [], ToolStream()
    for piece in ["a <tool", "_ca", "t> b", " c <"]:
        plain += reader.feed(piece)
    plain += reader.finish()
    assert "".join(d["content"] for d in plain) == "a <tool_cat> b c <"


@pytest.fixture(scope="module")
def grammars():
    tok = Tokenizer(DEMO)
    return tok, Grammars(tok.to_json(), 4096, tok.eos_token_ids)


def test_the_calls_grammar_takes_well_formed_calls_only(grammars):
    tok, g = grammars
    one = Constraint("grammar", calls_grammar([WEATHER], parallel=False))
    many = Constraint("grammar", calls_grammar([WEATHER], parallel=True))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for c, text, ok in [
        (one, call, True), (many, call + "\n" + call, True), (one, call + "\n" + call, False),
        (one, call.replace("get_weather", "get_time"), False), (one, call.replace('"city"', '"town"'), False),
    ]:  # fmt: skip
        m = g.matcher(c, tok.encode(text, add_special_tokens=False))
        assert (not m.error and m.accepting) == ok, text


def test_tools_are_described_in_the_system_message_of_a_template_without_them():
    tok = Tokenizer(DEMO)
    tools = [{"type": "function", "function": WEATHER}]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    ]  # fmt: skip
    text = tok.apply_chat_template(history, tools=tools)
    assert text.startswith("<|im_start|>system\n" + tools_prompt(tools))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n18 C<|im_end|>" in text


def test_bad_tool_fields_are_named():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tools = [{"type": "function", "function": WEATHER}]
    for extra, param in [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": tools, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ]:  # fmt: skip
        with pytest.raises(FieldError) as e:
            chat_plan({**base, **extra})
        assert e.value.param == param, extra
    plan = chat_plan({**base, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert plan.tools is not None and not plan.tools.parallel
    assert json.loads(plan.request.chat.tools_json) == tools and plan.request.sampling.structured.grammar
    assert chat_plan({**base, "tools": tools, "tool_choice": "none"}).tools is None
