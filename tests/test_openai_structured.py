"""Structured output and tool calling on the real instruct model (SmolLM2-135M-Instruct, its GGUF
file), through the OpenAI face and the official `openai` client: `response_format` json_schema
output validates, `tool_choice: required` and a named function return a call whose arguments
validate against the tool's parameters, the streamed tool-call deltas assemble to the same call,
and `auto` reads what the model chose. Servers run in this process on loopback."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from cluster.config import parse_config
from router.sdk.client import Client, JsonObject
from tests.served import serving
from tests.smollm2 import real

pytestmark = real

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(smollm2):
    """The router's gRPC address and the OpenAI client of its HTTP face."""
    config = parse_config(
        {
            "model": {"path": str(smollm2), "dtype": "float32", "name": "smollm2"},
            "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
            "cache": {"block_size": 16, "num_blocks": 256},
            "router": {"local_prefill_max_tokens": 64},  # short prompts here, long ones (tools) remote
        }
    )
    with serving(config, "smollm2") as cluster:
        api = openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="none", max_retries=0, timeout=300)
        yield cluster.grpc_address, api


@pytest.fixture(scope="module")
def api(cluster):
    return cluster[1]


def test_any_json_object_parses_with_local_and_remote_prefill(cluster):
    """`JsonObject` through the SDK: a short chat is prefilled on the decode worker, one past
    `local_prefill_max_tokens` on the prefill worker; greedy and seeded, each ends a JSON object."""
    short = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]
    note = (
        "Here is a short note about a book: The Hobbit was written by J. R. R. Tolkien and published in 1937. It "
        "tells the story of Bilbo Baggins, who travels with dwarves to reclaim their treasure. "
    )
    long = [{"role": "user", "content": note + "Give me a JSON object with the title, author and year."}]
    placements = set()
    with Client(cluster[0], timeout=300) as client:
        for messages in (short, long):
            for sampling in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 3}):
                done = client.generate(messages, max_tokens=96, structured=JsonObject(), **sampling)
                assert done.finish_reason == "stop", done.text
                assert isinstance(json.loads(done.text), dict), done.text
                placements.add(done.metadata["tandem-prefill"].split(":")[0])
    assert placements == {"local", "remote"}


def test_json_schema_output_validates(api):
    for temperature, seed in [(0.0, None), (0.7, 1), (0.7, 2)]:
        done = api.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Describe a person who lives in Lyon, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
            max_completion_tokens=80, temperature=temperature, seed=seed,
        )  # fmt: skip
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), PERSON)


def test_json_object_output_parses(api):
    done = api.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give me a JSON object with a name and an age."}],
        response_format={"type": "json_object"}, max_completion_tokens=80, temperature=0,
    )  # fmt: skip
    assert isinstance(json.loads(done.choices[0].message.content), dict)


def _call(api, stream: bool, **fields):  # type: ignore[no-untyped-def]
    return api.chat.completions.create(
        model="smollm2", messages=ASK, tools=[WEATHER, TIME], max_completion_tokens=96, temperature=0,
        stream=stream, **fields,
    )  # fmt: skip


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_required_and_named_tool_choice_return_a_call_whose_arguments_validate(api, choice):
    done = _call(api, False, tool_choice=choice, parallel_tool_calls=False)
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"

    chunks = list(_call(api, True, tool_choice=choice, parallel_tool_calls=False))
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_and_none_tool_choice(api):
    auto = _call(api, False).choices[0]
    if auto.message.tool_calls:  # the model chose to call: each call is a well-formed one
        assert auto.finish_reason == "tool_calls"
        for call in auto.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert auto.message.content
    none = _call(api, False, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content
