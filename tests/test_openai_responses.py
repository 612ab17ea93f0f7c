"""The Responses API (`POST /v1/responses`) through the official `openai` client against a served
cluster of the demo model: text and message input with instructions equal the chat completion they
stand for, whole and streamed; a required tool is called with valid arguments, and its output fed
back as a `function_call_output` item; text.format constrains the output; nothing stored is refused
by name."""

from __future__ import annotations

import json

import openai
import pytest

from router.openai.fields import HONOURED, REFUSED, rows
from router.openai.responses import RESPONSES
from tests.test_openai import client, served  # noqa: F401  (the module's cluster)
from tests.test_openai_fields import docs_table

MODEL = "tandem-demo-code"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}  # fmt: skip
# (a closed set of cities: the demo model, a code model, would otherwise loop inside a free string)

pytestmark = pytest.mark.slow


def test_text_and_messages_with_instructions_are_the_chat_they_stand_for(served):  # noqa: F811
    base, *_ = served
    api = client(base)
    args = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
    done = api.responses.create(input="Write a loop.", instructions="You write Python.", **args)
    chat = api.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=12,
        messages=[{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Write a loop."}],
    )  # fmt: skip
    assert done.object == "response" and done.id.startswith("resp_")
    assert done.output_text == chat.choices[0].message.content
    assert done.output[0].type == "message" and done.output[0].content[0].type == "output_text"
    assert (done.usage.input_tokens, done.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    items = [{"role": "system", "content": "You write Python."},
             {"role": "user", "content": [{"type": "input_text", "text": "Write a loop."}]}]  # fmt: skip
    assert api.responses.create(input=items, **args).output_text == done.output_text
    events = list(api.responses.create(input="Write a loop.", instructions="You write Python.", stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    assert events[-1].response.output[0].content[0].text == done.output_text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_a_required_tool_is_called_and_its_output_read(served):  # noqa: F811
    base, *_ = served
    api = client(base)
    args = {"model": MODEL, "temperature": 0, "max_output_tokens": 64, "tools": [WEATHER]}
    done = api.responses.create(input="What is the weather in Paris?", tool_choice="required", **args)
    call = next(item for item in done.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id
    events = list(api.responses.create(input="What is the weather in Paris?", tool_choice="required", stream=True,
                                       **args))  # fmt: skip
    streamed = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(call.name, call.arguments)]
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}]  # fmt: skip
    after = api.responses.create(input=turn, tool_choice="none", **args)
    assert after.output and after.output[0].type == "message"


def test_text_format_constrains_the_output(served):  # noqa: F811
    base, *_ = served
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    done = client(base).responses.create(
        model=MODEL, input="A number, please.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert isinstance(json.loads(done.output_text)["n"], int)


def test_what_is_not_stored_or_not_served_is_refused_by_name(served):  # noqa: F811
    base, *_ = served
    api = client(base)
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"reasoning": {"effort": "low"}}, "reasoning"), ({"frobnicate": 1}, "frobnicate"),
                         ({"input": [{"type": "image", "image_url": "x"}]}, "input[0].type"),
                         ({"input": [{"role": "user", "content": "hi", "name": "x"}]}, "input[0].name"),
                         ({"text": {"format": {"type": "json_object", "x": 2}}}, "text.format.x")]:  # fmt: skip
        body = {"model": MODEL, "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError) as bad:
            api.responses.create(**body) if "frobnicate" not in extra else api.responses.create(
                model=MODEL, input="hi", extra_body=extra
            )
        assert bad.value.body["param"] == param, extra
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model="gpt-5", input="hi")
    ok = api.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=True, metadata={"k": "v"})
    assert ok.store is False and ok.metadata == {"k": "v"}, "accepted, not stored"


def test_the_docs_table_is_the_codes():
    assert docs_table("/v1/responses") == {name: f"{f.decision} | {f.note}" for name, f in rows(RESPONSES)}
    assert {f.decision for _, f in rows(RESPONSES)} >= {HONOURED, REFUSED}
