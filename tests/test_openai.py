"""The OpenAI-compatible HTTP face, driven by the official `openai` client: completions and chat,
streamed and not, usage, n, logprobs, the error shapes and statuses, models, health, metrics, and
a client that disconnects mid-stream freeing its KV; every row of the field tables (docs/openai.md)
through the client, echo for text and token prompts, the prefix cache's tokens in usage, and usage
in every chunk. Servers run in this process on loopback."""

from __future__ import annotations

import http.client
import inspect
import itertools
import json
import threading
import time
import types
from pathlib import Path

import openai
import pytest

from cluster.config import parse_config
from cluster.model.tokenizer import Tokenizer
from router.openai.fields import REFUSED, TABLES, rows
from router.sdk.client import Client
from tests.served import serving
from tests.test_openai_fields import ROWS, base_body, body_with, example

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
KEY = "sk-tandem-test"


@pytest.fixture(scope="module")
def served():
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
            "cache": {"block_size": 16, "num_blocks": 128},
            "router": {"local_prefill_max_tokens": 4, "max_queued_requests": 4},
            "auth": {"api_keys": [KEY]},
        }
    )
    with serving(config, "tandem-demo-code") as cluster:
        yield cluster.base, cluster.grpc_address, cluster.decode, cluster.router


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


def test_logprobs_name_each_token_by_its_text_and_bytes_whole_and_streamed(served):
    """OpenAI's logprobs: each token's text (they join to the choice's text), its UTF-8 bytes (they
    decode to it), its alternatives by text; a completion's text offsets."""
    base, _, _, _ = served
    api = client(base)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    args = {"model": "tandem-demo-code", "max_tokens": 16, "temperature": 0}
    whole = api.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **args)
    content = whole.choices[0].logprobs.content
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == whole.choices[0].message.content
    assert all(e.top_logprobs[0].token == e.token for e in content), "greedy: the best alternative is the token"
    assert all(bytes(t.bytes).decode(errors="replace") == t.token for e in content for t in e.top_logprobs)
    streamed = [c for c in api.chat.completions.create(messages=messages, logprobs=True, stream=True, **args)
                if c.choices and c.choices[0].logprobs]  # fmt: skip
    assert [e.token for c in streamed for e in c.choices[0].logprobs.content] == [e.token for e in content]
    done = api.completions.create(prompt="def add(a, b):", logprobs=2, **args)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.tokens) == 16
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
    assert all(top and max(top, key=top.get) == token for top, token in zip(lp.top_logprobs, lp.tokens, strict=True))
    chunks = list(api.completions.create(prompt="def add(a, b):", logprobs=2, stream=True, **args))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_a_batch_of_prompts_gets_its_choices_in_order_with_usage_summed(served):
    """Each prompt of a completions batch is its own request: choice p * n + j is prompt p's j-th,
    whole or streamed, each equal to the prompt sent alone; usage counts each prompt once. (The
    router here admits 4 requests at a time: a batch of 2 prompts with n=2 fills it.)"""
    base, _, _, _ = served
    api = client(base)
    prompts = ["def add(a, b):", [481, 795, 10, 67]]
    args = {"model": "tandem-demo-code", "max_tokens": 6, "temperature": 0}
    alone = [api.completions.create(prompt=p, **args) for p in prompts]
    batch = api.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in batch.choices] == list(range(4))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 4 * 6
    chunks = list(api.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                         **args))  # fmt: skip
    texts = ["" for _ in range(4)]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in batch.choices]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (batch.usage.prompt_tokens, 24)
    three = ["def add(a, b):", "import os\n", "class A:"]
    echoed = api.completions.create(prompt=three, echo=True, **args)
    assert [c.text for c in echoed.choices] == [
        p + api.completions.create(prompt=p, **args).choices[0].text for p in three
    ]


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


def test_loading_an_adapter_while_serving_is_refused_unless_the_config_allows_it(served):
    base, _, _, _ = served
    conn, response = raw(base, "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    error = json.loads(response.read())["error"]
    assert response.status == 400 and "lora.runtime_loading" in error["message"]
    conn.close()
    conn, response = raw(base, "POST", "/v1/unload_lora_adapter", {"lora_path": "/nowhere"})
    assert response.status == 400 and json.loads(response.read())["error"]["param"] == "lora_name"
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
    deadline = time.monotonic() + 10  # the stream opens with the role's chunk, maybe before the request has blocks
    while decode.engine.occupancy.free_blocks == 128:
        assert time.monotonic() < deadline, "the streaming request should hold KV blocks"
        time.sleep(0.01)
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 5
    while decode.engine.occupancy.free_blocks < 128:
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


def send(api: openai.OpenAI, endpoint: str, body: dict):
    """`body` through the official client: its typed parameters where it has them, the rest as
    extra_body. A stream is read to its end (a list of chunks)."""
    create = api.completions.create if endpoint == "/v1/completions" else api.chat.completions.create
    typed = set(inspect.signature(create).parameters)
    extra = {k: v for k, v in body.items() if k not in typed}
    result = create(**{k: v for k, v in body.items() if k in typed}, extra_body=extra or None)
    return list(result) if body.get("stream") else result


def test_every_field_of_the_tables_through_the_openai_client(served):
    """Refused rows are 400 naming the field (their accepted values are not); the others are 200.
    What each honoured row changes is test_openai_fields.py's; the echo, usage and streaming rows
    are checked in full below."""
    api = client(served[0])
    for endpoint, name in ROWS:
        field = dict(rows(TABLES[endpoint]))[name]
        body = body_with(endpoint, name, example(endpoint, name))
        if field.decision != REFUSED:
            send(api, endpoint, body)
            continue
        with pytest.raises(openai.BadRequestError) as refused:
            send(api, endpoint, body)
        assert refused.value.param == name.replace("[]", "[0]"), (endpoint, name)
        assert refused.value.type == "invalid_request_error"
        for value in field.neutral:
            send(api, endpoint, body_with(endpoint, name, value))


def test_null_is_absent_and_unknown_fields_are_refused_over_raw_http(served):
    base = served[0]
    for endpoint, table in TABLES.items():
        nulls = {name: None for name in table if name not in ("prompt", "messages")}
        conn, response = raw(base, "POST", endpoint, {**nulls, **base_body(endpoint)} | {"stream": None})
        assert response.status == 200, response.read()
        conn.close()
        for extra, param in [({"tempreature": 1}, "tempreature"), ({"stream": True, "stream_options": {"x": 1}},
                             "stream_options.x")]:  # fmt: skip
            conn, response = raw(base, "POST", endpoint, {**base_body(endpoint), **extra})
            error = json.loads(response.read())["error"]
            assert response.status == 400 and error["param"] == param and "Unrecognized" in error["message"]
            conn.close()


def test_echo_for_text_and_token_prompts_whole_and_streamed(served):
    base = served[0]
    prompt, ids = "def add(a, b):", Tokenizer(DEMO).encode("def add(a, b):")
    args = {"model": "tandem-demo-code", "max_tokens": 8, "temperature": 0}
    completion = client(base).completions.create(prompt=prompt, **args).choices[0].text
    echoed = client(base).completions.create(prompt=prompt, echo=True, **args)
    assert echoed.choices[0].text == prompt + completion
    decoded = Tokenizer(DEMO).decode(ids)
    by_ids = client(base).completions.create(prompt=ids, echo=True, n=2, **args)
    assert [c.text for c in by_ids.choices] == [decoded + completion] * 2
    for sent, text in ((prompt, prompt), (ids, decoded)):
        chunks = list(client(base).completions.create(prompt=sent, echo=True, stream=True, **args))
        assert chunks[0].choices[0].text == text and "".join(c.choices[0].text for c in chunks) == text + completion


def test_echo_with_logprobs_scores_the_prompt_as_the_grpc_api_does(served):
    """lm-evaluation-harness's request (echo, logprobs, max_tokens 1), for a prompt prefilled on
    the decode worker and one on the prefill worker, whole and streamed, with the prefix cache warm:
    the prompt's tokens lead the logprobs (the first with null), their texts join to the echoed
    prompt, and their logprobs are the gRPC API's prompt_logprobs; vLLM's prompt_logprobs agree."""
    base, grpc_address, _, _ = served
    api = client(base)
    args = {"model": "tandem-demo-code", "max_tokens": 1, "temperature": 0}
    for prompt in ("x = 1", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"):  # local, then remote
        api.completions.create(prompt=prompt, **args)  # its blocks are now cached
        with Client(grpc_address, api_key=KEY) as native:
            expected = native.generate(prompt, prompt_logprobs=2, max_tokens=1, temperature=0)
        assert len(expected.prompt_logprobs) == expected.prompt_tokens - 1 > 0
        whole = api.completions.create(prompt=prompt, echo=True, logprobs=2, **args).choices[0]
        chunks = api.completions.create(prompt=prompt, echo=True, logprobs=2, stream=True, **args)
        streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]  # the prompt's, the token's
        joined = {
            key: [v for lp in streamed for v in getattr(lp, key)]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
        for logprobs in (whole.logprobs, types.SimpleNamespace(**joined)):
            n = expected.prompt_tokens
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            assert "".join(logprobs.tokens[:n]) == prompt
            assert logprobs.text_offset[:n] == [len("".join(logprobs.tokens[:i])) for i in range(n)]
            got = logprobs.token_logprobs[1:n]
            assert got == pytest.approx([lp.logprob for lp in expected.prompt_logprobs], abs=1e-5)
            assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:n])
            assert len(logprobs.tokens) == n + 1 and logprobs.text_offset[n] == len(prompt)
        assert whole.text == prompt + expected.text
        vllm = api.completions.create(prompt=prompt, extra_body={"prompt_logprobs": 1}, **args).choices[0]
        entries = vllm.model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == n
        for entry, lp in zip(entries[1:], expected.prompt_logprobs, strict=True):
            own = entry[str(lp.token_id)]
            assert own["logprob"] == pytest.approx(lp.logprob, abs=1e-5) and own["decoded_token"] == lp.token
            ranked = {int(t): e["rank"] for t, e in entry.items() if e["rank"] is not None}
            assert ranked == {lp.top[0][0]: 1}
    chat = api.chat.completions.create(messages=[{"role": "user", "content": "hi"}], extra_body={"prompt_logprobs": 0},
                                       **args)  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 2


def test_cached_tokens_are_what_the_prefix_cache_served(served):
    """The same long prompt twice: the second's usage reports the prefix cache's tokens, whole
    blocks, as the gRPC API does; whole and streamed, on both endpoints."""
    base, grpc_address, _, _ = served
    prompt = "".join(f"total_{i} = sum(range({i}))\n" for i in range(12))
    messages = [{"role": "user", "content": prompt}]
    args = {"model": "tandem-demo-code", "max_tokens": 2, "temperature": 0}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    api = client(base)
    with Client(grpc_address, api_key=KEY) as native:
        endpoints = [(api.completions.create, {"prompt": prompt}, prompt),
                     (api.chat.completions.create, {"messages": messages}, messages)]  # fmt: skip
        for create, sent, native_prompt in endpoints:
            create(**sent, **args)
            second = create(**sent, **args).usage
            cached = second.prompt_tokens_details.cached_tokens
            assert 0 < cached < second.prompt_tokens and cached % 16 == 0
            assert native.generate(native_prompt, max_tokens=2, temperature=0).cached_prompt_tokens == cached
            streamed = list(create(**sent, **args, **usage))[-1].usage
            assert streamed.prompt_tokens_details.cached_tokens == cached
            assert streamed.prompt_tokens == second.prompt_tokens


def test_requests_with_different_cache_salts_share_no_cached_tokens(served):
    """vLLM's `cache_salt`: a prompt cached under one salt is a miss under another and unsalted; the
    same salt hits, on the OpenAI face and the gRPC API alike. A bad salt is a 400 naming it."""
    base, grpc_address, _, _ = served
    prompt = "".join(f"salted_{i} = {i} * {i}\n" for i in range(12))
    args = {"model": "tandem-demo-code", "max_tokens": 2, "temperature": 0}
    create = client(base).completions.create

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        details = create(prompt=prompt, extra_body=extra, **args).usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    assert cached("tenant-a") == 0 and cached("tenant-a") > 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    with Client(grpc_address, api_key=KEY) as native:
        assert native.generate(prompt, max_tokens=2, temperature=0, cache_salt="tenant-c").cached_prompt_tokens == 0
        assert native.generate(prompt, max_tokens=2, temperature=0, cache_salt="tenant-a").cached_prompt_tokens > 0
    for bad in ("", 7, "x" * 257):
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            create(prompt=prompt, extra_body={"cache_salt": bad}, **args)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served):
    base = served[0]
    args = {
        "model": "tandem-demo-code",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "extra_body": {"ignore_eos": True},
    }
    options = {"include_usage": True, "continuous_usage_stats": True}
    create = client(base).completions.create
    chunks = list(create(prompt="import os\n", n=2, stream_options=options, logprobs=0, **args))
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens == 10 and last.usage.prompt_tokens_details
    # A chunk may carry more than one token (a lagging stream's are merged): count them by their logprobs.
    carried = itertools.accumulate(sum(len(c.logprobs.tokens) for c in chunk.choices) for chunk in chunks[:-1])
    assert [c.usage.completion_tokens for c in chunks[:-1]] == list(carried) and len(chunks) > 2
    assert all(c.usage.prompt_tokens == last.usage.prompt_tokens > 0 for c in chunks)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(
        client(base).chat.completions.create(messages=messages, stream_options={"continuous_usage_stats": True}, **args)
    )
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 5]  # no usage-only chunk
    plain = list(client(base).chat.completions.create(messages=messages, **args))
    assert all(c.usage is None for c in plain)
