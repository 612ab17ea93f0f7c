"""The OpenAI face's field tables, without a cluster: docs/openai.md's tables are the code's, and
every row does what its decision says to the `tandem.v1.GenerateRequest` and the reply's plan
(honoured fields change them, ignored ones do not, refused ones are a `FieldError` naming the field,
their accepted values are not). test_openai.py walks the same rows through a served cluster with
the official `openai` client, using `example` and `body_with` from here."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from router.openai.fields import HONOURED, IGNORED, REFUSED, TABLES, FieldError, rows
from router.openai.request import chat_plan, completion_plan

DOCS = Path(__file__).resolve().parents[1] / "docs" / "openai.md"
MODEL = "tandem-demo-code"
PLANS = {"/v1/completions": completion_plan, "/v1/chat/completions": chat_plan}

CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# One value per row: honoured and ignored ones are accepted, refused ones are not (a value other
# than the row's accepted ones). Used with `body_with`.
EXAMPLES: dict[str, Any] = {
    "prompt": "import os\n", "messages": [{"role": "user", "content": "Write a loop."}], "model": MODEL,
    "n": 2, "stream": True, "stream_options": {"include_usage": True}, "stream_options.include_usage": True,
    "stream_options.continuous_usage_stats": True, "stream_options.include_obfuscation": False,
    "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["\n\n"], "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "logit_bias": {"50": 10}, "user": "someone", "max_tokens": 2,
    "max_completion_tokens": 2, "echo": True, "best_of": 3, "suffix": "return x", "top_logprobs": 2,
    "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required", "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": False,
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "moderation": {"model": "omni-moderation-latest"}, "metadata": {"k": "v"},
    "store": True, "safety_identifier": "someone", "service_tier": "auto", "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit"}, "prompt_cache_retention": "24h",
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2,
    "stop_token_ids": [5], "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "include_stop_str_in_output": True, "add_special_tokens": "other", "truncate_prompt_tokens": 8,
    "prompt_logprobs": 1, "use_beam_search": True, "bad_words": ["x"], "allowed_token_ids": [5],
    "priority": 1, "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "cache_salt": "tenant-a",
    "guided_grammar": "root ::= 'a'", "structured_outputs": {"regex": "a+"},
    "add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "speculative_tokens": 0, "num_beams": 2, "length_penalty": 0.5, "early_stopping": "never",
    "ttft_seconds": 5.0, "tpot_seconds": 1.0,
    "messages[].role": "developer", "messages[].content": [{"type": "text", "text": "Write a loop."}],
    "messages[].name": "someone", "messages[].refusal": "I cannot.", "messages[].tool_calls": [CALL],
    "messages[].tool_call_id": "1", "messages[].function_call": {"name": "f", "arguments": "{}"},
    "messages[].audio": {"id": "a"}, "messages[].content[].type": "refusal", "messages[].content[].text": "Hi.",
    "messages[].content[].refusal": "I cannot.", "messages[].content[].image_url": {"url": "http://x/a.png"},
    "messages[].content[].input_audio": {"data": "", "format": "wav"}, "messages[].content[].file": {"file_id": "f"},
    "messages[].content[].prompt_cache_breakpoint": {"mode": "explicit"},
}  # fmt: skip
EXAMPLES_BY_ENDPOINT = {"/v1/completions": {"logprobs": 2}, "/v1/chat/completions": {"logprobs": True}}
# Honoured by the HTTP layer rather than the plan: the model or adapter it names (unknown: 404).
HTTP_ONLY = {"model"}


def example(endpoint: str, name: str) -> Any:
    return EXAMPLES_BY_ENDPOINT[endpoint].get(name, EXAMPLES.get(name))


def base_body(endpoint: str) -> dict[str, Any]:
    if endpoint == "/v1/completions":
        return {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "temperature": 0}  # fmt: skip


def body_with(endpoint: str, name: str, value: Any) -> dict[str, Any]:
    """The endpoint's base body with the row `name` set to `value`, nested rows in place; the
    same body without it is `body_with(endpoint, name, DROP)`."""
    body, value = base_body(endpoint), value if value is DROP else copy.deepcopy(value)
    if name.startswith("stream_options."):
        body.update(stream=True, stream_options={})
        _put(body["stream_options"], name.split(".", 1)[1], value)
    elif name.startswith("messages[].content[]."):
        key = name.rsplit(".", 1)[1]
        refusal = key in ("refusal", "type")  # a refusal part: an assistant's turn, then the user's
        part = {"type": "refusal", "refusal": "I cannot."} if refusal else {"type": "text", "text": "hi"}
        _put(part, key, value)
        role = "assistant" if refusal else "user"
        body["messages"] = [{"role": role, "content": [part]}, {"role": "user", "content": "Go on."}]
    elif name.startswith("messages[]."):
        key = name.rsplit(".", 1)[1]
        message = {"role": "assistant" if key == "refusal" else "user", "content": None if key == "refusal" else "hi"}
        _put(message, key, value)
        body["messages"] = [message, {"role": "user", "content": "Go on."}]
    else:
        if name == "max_tokens" and "messages" in body:
            del body["max_completion_tokens"]
        if name == "top_logprobs":
            body["logprobs"] = True
        if name == "stream_options":
            body["stream"] = True
        if name in ("tool_choice", "parallel_tool_calls"):  # they say how the tools are used
            body["tools"] = EXAMPLES["tools"]
        _put(body, name, value)
    return body


DROP = object()


def _put(target: dict[str, Any], key: str, value: Any) -> None:
    if value is DROP:
        target.pop(key, None)
    else:
        target[key] = value


def docs_table(endpoint: str) -> dict[str, str]:
    """{field: 'decision | note'} from the docs' table for `endpoint`."""
    text = DOCS.read_text()
    section = text.split(f"### `POST {endpoint}`", 1)[1].split("\n\n", 2)[1]
    table = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `([^`]+)` \| (\w+) \| (.*) \|", line)
        if match:
            assert match[1] not in table, f"{match[1]} is in the docs twice"
            table[match[1]] = f"{match[2]} | {match[3]}"
    return table


ROWS = [(endpoint, name) for endpoint, table in TABLES.items() for name, _ in rows(table)]


@pytest.mark.parametrize("endpoint", sorted(TABLES))
def test_the_docs_tables_are_the_code_tables(endpoint):
    docs = docs_table(endpoint)
    code = dict(rows(TABLES[endpoint]))
    assert [name for name in docs] == list(code), "the docs list the code's fields, in its order"
    for name, field in code.items():
        decision, note = docs[name].split(" | ", 1)
        assert decision == field.decision, name
        for value in field.neutral:
            assert f"`{json.dumps(value)}`" in note, f"{name}: the docs name the accepted value {value!r}"


def test_every_row_has_an_example():
    assert {name for _, name in ROWS} == set(EXAMPLES) | {"logprobs"}
    assert all(example(endpoint, name) is not None for endpoint, name in ROWS)


def _param(name: str) -> str:
    return name.replace("[]", "[0]")


@pytest.mark.parametrize(("endpoint", "name"), ROWS)
def test_each_row_does_what_its_decision_says(endpoint, name):
    field = dict(rows(TABLES[endpoint]))[name]
    plan = PLANS[endpoint]
    with_it = body_with(endpoint, name, example(endpoint, name))
    if field.decision == REFUSED:
        with pytest.raises(FieldError) as refused:
            plan(with_it)
        assert refused.value.param == _param(name)
        assert _param(name) in refused.value.message
        for value in (None, *field.neutral):  # null is absent; accepted values ask for nothing missing
            assert plan(body_with(endpoint, name, value)) == plan(body_with(endpoint, name, DROP))
        return
    try:
        without = plan(body_with(endpoint, name, DROP))
    except FieldError:  # a field the request needs (prompt, messages, a message's role)
        without = None
    if field.decision == IGNORED:
        assert plan(with_it) == without
    else:
        assert field.decision == HONOURED
        assert plan(with_it) != without or name in HTTP_ONLY


@pytest.mark.parametrize("endpoint", sorted(TABLES))
def test_unknown_fields_are_refused_by_name_even_nested(endpoint):
    plan = PLANS[endpoint]
    for body, param in [
        ({**base_body(endpoint), "tempreature": 0.5}, "tempreature"),
        ({**base_body(endpoint), "stream": True, "stream_options": {"include_usage": True, "every": 1}},
         "stream_options.every"),
    ]:  # fmt: skip
        with pytest.raises(FieldError, match="Unrecognized request argument") as unknown:
            plan(body)
        assert unknown.value.param == param
    if endpoint == "/v1/chat/completions":
        with pytest.raises(FieldError) as unknown:
            plan({**base_body(endpoint), "messages": [{"role": "user", "content": "hi", "colour": "red"}]})
        assert unknown.value.param == "messages[0].colour"


def test_values_are_checked_and_named():
    cases = [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"stop": 3}, "stop"),
        ({"temperature": "hot"}, "temperature"),
        ({"echo": "yes"}, "echo"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
        ({"prompt": ["a", 5]}, "prompt"),  # neither one prompt nor a batch of them
        ({"prompt": ["a", []]}, "prompt[1]"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"early_stopping": "soon"}, "early_stopping"),
    ]
    for change, param in cases:
        with pytest.raises(FieldError) as bad:
            completion_plan({**base_body("/v1/completions"), **change})
        assert bad.value.param == param, change
    chat = base_body("/v1/chat/completions")
    for change, param in [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
         "messages[0].content[0].type"),  # a user's turn has no refusal parts
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
    ]:  # fmt: skip
        with pytest.raises(FieldError) as bad:
            chat_plan({**chat, **change})
        assert bad.value.param == param, change


def test_echo_asks_the_router_for_a_token_prompts_text_only():
    text = completion_plan({**base_body("/v1/completions"), "echo": True})
    assert text.echo and text.prompt_texts == ("def add(a, b):",) and not text.request.return_prompt_text
    ids = completion_plan({**base_body("/v1/completions"), "prompt": [[1, 2, 3]], "echo": True})
    assert ids.echo and ids.prompt_texts == (None,) and ids.request.return_prompt_text
    assert list(ids.request.token_ids.ids) == [1, 2, 3]
