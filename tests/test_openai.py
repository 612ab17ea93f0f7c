"""The OpenAI-compatible HTTP face, driven by the official `openai` client: completions and chat,
streamed and not, usage, n, logprobs, the error shapes and statuses, models, health, metrics, and
a client that disconnects mid-stream freeing its KV. Servers run in this process on loopback."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import openai
import pytest

from cluster.config import parse_config
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from router import server as router_server
from router.client import Client
from router.http import HTTPServer, create_app

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
KEY = "sk-tandem-test"


@pytest.fixture(scope="module")
def served():
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 128},
            "router": {"local_prefill_max_tokens": 4, "max_queued_requests": 4},
            "auth": {"api_keys": [KEY]},
        }
    )
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = router_server.from_config(config, lambda: workers)
    grpc_address = router.start()
    http = HTTPServer(create_app(grpc_address, "tandem-demo-code", router.telemetry.metrics.registry), "127.0.0.1", 0)
    base = f"http://{http.start()}"
    yield base, grpc_address, decode, router
    http.stop()
    router.stop()
    prefill.stop()
    decode.stop()


def raw(base: str, method: str, path: str, body: dict | None = None, key: str | None = KEY):
    """An HTTP exchange with the standard library: (connection, response), the body unread."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, json.dumps(body) if body is not None else None, headers)
    return conn, conn.getresponse()


def client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_completions_match_the_grpc_api(served):
    base, grpc_address, _, _ = served
    done = client(base).completions.create(
        model="tandem-demo-code", prompt="def add(a, b):", max_tokens=12, temperature=0
    )
    with Client(grpc_address, api_key=KEY) as native:
        expected = native.generate("def add(a, b):", max_tokens=12, temperature=0)
    assert done.choices[0].text == expected.text
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == expected.prompt_tokens
    streamed = client(base).completions.create(
        model="tandem-demo-code", prompt="def add(a, b):", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_beam_search_and_speculation_fields_as_extra_body(served):
    base, grpc_address, _, _ = served
    beam = {"num_beams": 3, "length_penalty": 0.5, "early_stopping": "never"}
    done = client(base).completions.create(
        model="tandem-demo-code", prompt="import os\n", max_tokens=10, extra_body=beam
    )
    with Client(grpc_address, api_key=KEY) as native:
        expected = native.generate("import os\n", max_tokens=10, num_beams=3, length_penalty=0.5,
                                   early_stopping="EARLY_STOPPING_NEVER")  # fmt: skip
    assert len(expected.beams) == 3 and done.choices[0].text == expected.beams[0].text
    plain = client(base).completions.create(
        model="tandem-demo-code", prompt="import os\n", max_tokens=10, temperature=0,
        extra_body={"speculative_tokens": 0},
    )  # fmt: skip
    assert plain.usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError, match="early_stopping"):
        client(base).completions.create(
            model="tandem-demo-code", prompt="x", max_tokens=4, extra_body={"num_beams": 2, "early_stopping": "soon"}
        )


def test_chat_streamed_equals_whole_with_usage_n_and_logprobs(served):
    base, _, _, _ = served
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    whole = client(base).chat.completions.create(
        model="tandem-demo-code", messages=messages, max_completion_tokens=10, temperature=0, n=2, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    assert len(whole.choices) == 2 and whole.choices[0].message.content == whole.choices[1].message.content
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].logprobs.content) == 10 and len(whole.choices[0].logprobs.content[0].top_logprobs) == 2
    assert whole.usage.completion_tokens == 20
    chunks = list(
        client(base).chat.completions.create(
            model="tandem-demo-code", messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_errors_have_openais_shape_and_status(served):
    base, _, _, _ = served
    with pytest.raises(openai.BadRequestError) as bad:
        client(base).completions.create(model="tandem-demo-code", prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.AuthenticationError):
        client(base, key="wrong").completions.create(model="tandem-demo-code", prompt="x", max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client(base).completions.create(model="gpt-4", prompt="x", max_tokens=4)
    conn, response = raw(base, "POST", "/v1/chat/completions", {"messages": []})
    assert response.status == 400 and json.loads(response.read())["error"]["type"] == "invalid_request_error"
    conn.close()


def test_overload_is_429_with_retry_after_before_any_stream(served):
    base, _, _, router = served
    stop = threading.Event()

    def hold() -> None:  # keep the router's four admission slots busy
        body = {"prompt": "x = 1", "max_tokens": 900, "stream": True, "ignore_eos": True}
        conn, response = raw(base, "POST", "/v1/completions", body)
        while not stop.is_set() and response.readline():
            pass
        conn.close()

    holders = [threading.Thread(target=hold) for _ in range(4)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 30
    while router._in_flight < 4:  # every admission slot taken
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        conn, response = raw(base, "POST", "/v1/completions", {"prompt": "y = 2", "max_tokens": 4, "stream": True})
        assert response.status == 429 and response.getheader("retry-after")
        assert json.loads(response.read())["error"]["type"] == "rate_limit_error"
        conn.close()
    finally:
        stop.set()
        for t in holders:
            t.join()


def test_a_client_that_disconnects_frees_its_kv(served):
    base, _, decode, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600, "stream": True, "ignore_eos": True}
    conn, response = raw(base, "POST", "/v1/chat/completions", body)
    assert response.status == 200 and response.readline().startswith(b"data: ")
    assert decode.engine.scheduler.blocks.num_free_blocks < 128
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 5
    while decode.engine.scheduler.blocks.num_free_blocks < 128:
        assert time.monotonic() < deadline, "the disconnected request's KV should be freed"
        time.sleep(0.05)


def test_models_health_and_metrics(served):
    base, _, _, _ = served
    assert [m.id for m in client(base).models.list()] == ["tandem-demo-code"]
    conn, health = raw(base, "GET", "/health", key=None)
    assert health.status == 200
    conn.close()
    conn, metrics = raw(base, "GET", "/metrics", key=None)
    assert metrics.status == 200 and b"tandem_ttft_seconds_count" in metrics.read()
    conn.close()
