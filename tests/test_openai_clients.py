"""The tools people already use, against a served cluster of the demo model: the OpenAI Agents SDK
runs an agent with one function tool through the Responses API and through chat completions (the
tool is called with valid arguments and the run finishes), and LangChain's `ChatOpenAI` invokes,
streams, answers in a pydantic model and binds tools. Tool arguments are a closed set of cities:
the demo model is a code model, and would loop inside a free string."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import agents
import langchain_openai
import pytest
from langchain_core.tools import tool
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.test_openai import KEY, served  # noqa: F401  (the module's cluster)

MODEL = "tandem-demo-code"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agents_sdk_agent_calls_its_tool_and_finishes(served, api):  # noqa: F811
    agents.set_tracing_disabled(True)  # the SDK would upload its traces to OpenAI
    base, *_ = served
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"Sunny in {city}."

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)(
        model=MODEL, openai_client=client
    )
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                            max_tokens=48),
        tool_use_behavior="stop_on_first_tool",  # the tool's answer ends the run (a code model's own may not)
    )  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert called and set(called) <= {"Paris", "Rome"}, "the tool ran with valid arguments"
    assert result.final_output == f"Sunny in {called[0]}.", "the run finished with the tool's answer"


class Number(BaseModel):
    n: int


def test_langchain_chat_openai_invokes_streams_answers_in_a_model_and_binds_tools(served):  # noqa: F811
    base, *_ = served
    llm = langchain_openai.ChatOpenAI(base_url=f"{base}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=16)
    whole = llm.invoke("Write a loop.")
    assert whole.content and whole.response_metadata["finish_reason"] == "length"
    assert "".join(chunk.content for chunk in llm.stream("Write a loop.")) == whole.content
    number = llm.with_structured_output(Number, method="json_schema").bind(max_tokens=40).invoke("A number, please.")
    assert isinstance(number, Number)

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return f"Sunny in {city}."

    # strict: no properties beyond the schema's (LangChain leaves them open otherwise, and a constrained
    # model may fill them)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).bind(max_tokens=48)
    message = bound.invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    assert json.dumps(message.tool_calls[0]["args"])
