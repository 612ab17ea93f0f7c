"""The running cluster: a real local Ray cluster (one per module), worker actors serving gRPC on
loopback, the router in this process, and the client SDK. Two clusters share the Ray instance:
one shipping KV over `grpc`, one over `collective` (Gloo)."""

from __future__ import annotations

import asyncio
import itertools
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import ray
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

from cli.main import main as cli
from cluster.config import parse_config
from cluster.engine.block_names import chain
from cluster.engine.request import SamplingParams
from cluster.generate import generate
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from cluster.pools import ray_cluster
from decode_worker.engine import Engine
from router.sdk.client import AsyncClient, Client, DeadlineExceeded, InvalidArgument
from router.service.server import from_config
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
LOCAL_MAX = 8  # prompts up to this many tokens are prefilled on the decode worker

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def config(transport: str):
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 128},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 512},
            "transfer": {"transport": transport, "timeout_s": 20},
            "router": {"local_prefill_max_tokens": LOCAL_MAX, "max_queued_requests": 64},
            "prefill": {"num_cpus": 1},
            "decode": {"num_cpus": 1},
        }
    )


@pytest.fixture(scope="module")
def ray_instance():
    ray.init("local", num_cpus=4, include_dashboard=False, namespace="tandem-tests", log_to_driver=False)
    yield
    ray.shutdown()


def start(transport: str):
    cfg = config(transport)
    cluster = ray_cluster.start(cfg, namespace=f"tandem-{transport}")
    router = from_config(cfg, cluster.discover)
    address = router.start()
    return cluster, router, address


@pytest.fixture(scope="module")
def grpc_cluster(ray_instance):
    cluster, router, address = start("grpc")
    yield cluster, router, address
    router.stop()
    cluster.shutdown()


def prompts(n: int = 16, seed: int = 0) -> dict[str, tuple[list[int], int]]:
    """Token prompts, half short enough for local prefill, half long enough to be shipped."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        length = rng.randint(2, LOCAL_MAX) if i % 2 else rng.randint(20, 120)
        out[f"q{i}"] = ([rng.randrange(5, 2000) for _ in range(length)], rng.randint(4, 24))
    return out


@pytest.fixture(scope="module")
def reference():
    model = load_model(DEMO, "float32")
    tok = Tokenizer(DEMO)
    cfg = config("grpc")
    engine = Engine(model, tok, cfg.cache, cfg.scheduler, tok.eos_token_ids)
    for rid, (prompt, max_tokens) in prompts().items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts()}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return tokens


def run_concurrently(address: str) -> tuple[dict[str, list[int]], dict[str, str]]:
    results, placement = {}, {}
    with Client(address, timeout=120) as client:

        def one(rid: str, prompt: list[int], max_tokens: int) -> None:
            done = client.generate(prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0)
            results[rid], placement[rid] = done.token_ids, done.metadata["tandem-prefill"]

        threads = [threading.Thread(target=one, args=(rid, p, m)) for rid, (p, m) in prompts().items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results, placement


def kv_in_use(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        status = worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    return {w.name: w.load.total_kv_blocks - w.load.free_kv_blocks for w in status.workers}


def wait_for_idle_kv(address: str, within_s: float) -> float:
    """Seconds until no decode worker holds a KV block; fails past `within_s`."""
    start = time.monotonic()
    while True:
        used = {n: u for n, u in kv_in_use(address).items() if n.startswith("decode")}
        elapsed = time.monotonic() - start
        if not any(used.values()):
            return elapsed
        assert elapsed < within_s, f"KV blocks still in use after {elapsed:.2f} s: {used}"
        time.sleep(0.02)


def test_16_concurrent_requests_over_grpc_and_local_prefill_match_one_engine(grpc_cluster, reference):
    _, router, address = grpc_cluster
    results, placement = run_concurrently(address)
    assert results == reference
    assert {p.split(":")[0] for p in placement.values()} == {"remote", "local"}, placement
    assert sum(router.decisions.values()) >= 16
    wait_for_idle_kv(address, within_s=5)


def test_16_concurrent_requests_over_collective_match_one_engine(ray_instance, reference):
    cluster, router, address = start("collective")
    try:
        results, placement = run_concurrently(address)
        assert results == reference
        assert any(p.startswith("remote") for p in placement.values())
    finally:
        router.stop()
        cluster.shutdown()


INVALID = [
    ("empty text", dict(text=""), "text"),
    ("no prompt", dict(), "prompt"),
    ("over the context", dict(text="x", sampling=dict(max_tokens=5000)), "max_tokens"),
    ("negative temperature", dict(text="x", sampling=dict(max_tokens=4, temperature=-1)), "temperature"),
    ("top_p 0", dict(text="x", sampling=dict(max_tokens=4, top_p=0)), "top_p"),
    ("top_p above 1", dict(text="x", sampling=dict(max_tokens=4, top_p=1.5)), "top_p"),
    ("top_k -2", dict(text="x", sampling=dict(max_tokens=4, top_k=-2)), "top_k"),
    ("unknown stop token", dict(text="x", sampling=dict(max_tokens=4, stop_token_ids=[10**6])), "stop_token_ids"),
    ("too many stop strings", dict(text="x", sampling=dict(max_tokens=4, stop=["a"] * 17)), "stop"),
    ("token id outside vocab", dict(token_ids=dict(ids=[1, 10**6])), "token_ids"),
    ("empty chat", dict(chat=dict(messages=[])), "chat"),
]


def test_invalid_requests_get_invalid_argument_and_others_keep_running(grpc_cluster):
    _, _, address = grpc_cluster
    stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
    long_request = api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=list(range(40, 90))),
        sampling=api_pb2.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    )
    running = stub.Generate(long_request, timeout=120)
    first = next(running)
    for name, fields, field in INVALID:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(api_pb2.GenerateRequest(**fields), timeout=30))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, name
        assert field in e.value.details(), (name, e.value.details())
    rest = list(running)
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 200
    assert rest[-1].finish_reason == api_pb2.FINISH_REASON_LENGTH


def test_sdk_raises_typed_errors(grpc_cluster):
    _, _, address = grpc_cluster
    with Client(address) as client, pytest.raises(InvalidArgument, match="temperature"):
        client.generate("x", max_tokens=4, temperature=-1)


@pytest.mark.parametrize("prompt_len", [4, 60], ids=["local-prefill", "remote-prefill"])
def test_cancelled_stream_frees_decode_kv_within_a_second(grpc_cluster, prompt_len):
    _, _, address = grpc_cluster
    with Client(address, timeout=120) as client:
        stream = client.stream(list(range(100, 100 + prompt_len)), max_tokens=500, temperature=0, ignore_eos=True)
        for _, _ in zip(range(3), stream, strict=False):
            pass
        assert any(kv_in_use(address)[n] for n in kv_in_use(address) if n.startswith("decode"))
        stream.close()  # the client leaves mid-stream
        assert wait_for_idle_kv(address, within_s=1.0) < 1.0


def test_deadline_frees_decode_kv_within_a_second(grpc_cluster):
    _, _, address = grpc_cluster
    with Client(address, timeout=120) as client, pytest.raises(DeadlineExceeded):
        client.generate(list(range(200, 260)), max_tokens=900, temperature=0, ignore_eos=True, timeout=0.5)
    assert wait_for_idle_kv(address, within_s=1.0) < 1.0


def test_streaming_and_async_clients_agree(grpc_cluster):
    _, _, address = grpc_cluster
    with Client(address) as client:
        whole = client.generate("def add(a, b):", max_tokens=20, temperature=0)
        deltas = list(client.stream("def add(a, b):", max_tokens=20, temperature=0))
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert deltas[-1].finish_reason == whole.finish_reason == "length"
    assert whole.completion_tokens == 20 and whole.prompt_tokens > 0

    async def use_async():
        async with AsyncClient(address) as client:
            done = await client.generate("def add(a, b):", max_tokens=20, temperature=0)
            streamed = [d async for d in client.stream("def add(a, b):", max_tokens=20, temperature=0)]
            return done, streamed

    done, streamed = asyncio.run(use_async())
    assert done.token_ids == whole.token_ids
    assert "".join(d.text for d in streamed) == whole.text


def test_retry_reaches_a_router_that_was_briefly_unavailable(grpc_cluster):
    cluster, _, _ = grpc_cluster
    port = free_port()
    late = from_config(config("grpc"), cluster.discover)
    timer = threading.Timer(0.6, late.start, args=(f"127.0.0.1:{port}",))
    timer.start()
    try:
        with Client(f"127.0.0.1:{port}", retries=6, backoff_s=0.1, timeout=60) as client:
            done = client.generate("import os", max_tokens=8, temperature=0)
        assert len(done.token_ids) == 8
    finally:
        timer.join()
        late.stop()


def test_status_shows_the_pools_while_requests_run(grpc_cluster, capsys):
    _, _, address = grpc_cluster
    with Client(address, timeout=120) as client:
        stream = client.stream(list(range(300, 360)), max_tokens=400, temperature=0, ignore_eos=True)
        next(stream)
        assert cli(["status", "--target", address]) == 0
        stream.close()
    out = capsys.readouterr().out
    assert "model tandem-demo-code" in out
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert role in line and " up " in line
    assert "placement: prefill=" in out


def test_sdk_imports_without_torch_or_ray():
    code = (
        "import sys\n"
        "import router.sdk.client as c\n"
        "assert c.Client and c.AsyncClient\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'numpy', 'cluster') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_router_serves_health_and_reflection_and_bounds_its_queue(grpc_cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    cluster, _, address = grpc_cluster
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([ask]), timeout=5)
        names = {s.name for s in answer.list_services_response.service}
        assert {"tandem.v1.Tandem", "tandem.v1.Admin", "grpc.health.v1.Health"} <= names

    small = from_config(
        config("grpc").model_copy(
            update={"router": config("grpc").router.model_copy(update={"max_queued_requests": 1})}
        ),
        cluster.discover,
    )
    small_address = small.start()
    try:
        with Client(small_address, timeout=60, retries=0) as client:
            busy = client.stream(list(range(400, 430)), max_tokens=300, temperature=0, ignore_eos=True)
            next(busy)
            with pytest.raises(Exception) as e:
                client.generate("x", max_tokens=2)
            assert type(e.value).__name__ == "ResourceExhausted", e.value
            busy.close()
    finally:
        small.stop()


def test_a_worker_that_dies_is_restarted_and_registered_again(grpc_cluster):
    cluster, _, address = grpc_cluster
    before = cluster.discover()["decode-0"]
    cluster.kill_worker("decode-0")
    deadline = time.monotonic() + 60
    while cluster.discover().get("decode-0") == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.discover()["decode-0"] != before, "the restarted worker should register its new address"
    time.sleep(1.2)  # the router refreshes its worker list every second
    with Client(address, timeout=60) as client:
        done = client.generate(list(range(500, 560)), max_tokens=6, temperature=0)
    assert len(done.token_ids) == 6


def test_turn_2_returns_to_its_kv_on_the_ray_cluster_and_computes_only_its_new_tokens(grpc_cluster):
    _, router, address = grpc_cluster
    model = load_model(DEMO, "float32")
    history = [(37 * i) % 1900 + 5 for i in range(33)]  # 33 + 16 output - 1 = three whole blocks computed
    with Client(address, timeout=60) as client:
        first = client.generate(history, max_tokens=16, temperature=0.0, ignore_eos=True)
        decode = first.metadata["tandem-decode"]
        index = router.view.index

        (root,) = index.prefix.roots()  # the model root the workers reported
        computed = chain([*history, *first.token_ids[:-1]], 16, root)  # the three blocks turn 1 left

        def heard() -> bool:  # the decode worker's cache events, and its load with the request gone
            load = index.loads().get(decode)
            held = index.prefix.match(computed).get(decode, 0)
            return held == len(computed) == 3 and load is not None and load.running_seqs == 0

        deadline = time.monotonic() + 30
        while not heard() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert heard(), (index.prefix.match(computed), index.loads().get(decode))
        history = [*history, *first.token_ids, 7, 8, 9, 10]
        second = client.generate(history, max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = generate(model, [history], 8)[0].tokens
    assert second.token_ids == expected
    assert (second.metadata["tandem-decode"], second.metadata["tandem-prefill"]) == (decode, "local:cached-prefix")
    assert second.cached_prompt_tokens == 48  # of 53 prompt tokens, the decode worker computed 5


def test_chat_messages_go_through_the_models_chat_template(grpc_cluster):
    _, _, address = grpc_cluster
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    tok = Tokenizer(DEMO)
    expected_prompt = tok.encode_chat(messages)
    with Client(address) as client:
        chat = client.generate(messages, max_tokens=8, temperature=0)
        same = client.generate(expected_prompt, max_tokens=8, temperature=0)
    assert chat.prompt_tokens == len(expected_prompt)
    assert chat.token_ids == same.token_ids


def scrape(address: str) -> dict[str, float]:
    """Prometheus text at http://address/metrics as {sample name with labels: value}."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_prometheus_endpoints_count_the_requests(grpc_cluster):
    _, router, address = grpc_cluster
    before = scrape(router.telemetry.metrics.address)
    with grpc.insecure_channel(address) as channel:
        status = worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    workers = {w.name: w.load.metrics_address for w in status.workers}
    prefill_before = scrape(workers["prefill-0"])
    with Client(address, timeout=60) as client:
        finals = [client.generate(list(range(600 + i, 640 + i)), max_tokens=5, temperature=0) for i in range(3)]
        finals.append(client.generate([7, 8], max_tokens=5, temperature=0))  # local prefill
    after = scrape(router.telemetry.metrics.address)
    for name in ("tandem_ttft_seconds_count", "tandem_e2e_seconds_count", "tandem_tpot_seconds_count"):
        assert after[name] - before.get(name, 0) == 4, name
    assert after["tandem_itl_seconds_count"] - before.get("tandem_itl_seconds_count", 0) >= 4
    key = 'tandem_requests_total{prefill_mode="remote",status="ok"}'
    assert after[key] - before.get(key, 0) == 3
    assert 0 <= after["tandem_slo_attainment"] <= 1
    prefill_after = scrape(workers["prefill-0"])
    count = 'tandem_kv_transfer_seconds_count{transport="grpc"}'
    assert prefill_after[count] - prefill_before.get(count, 0) == 3
    assert prefill_after['tandem_kv_transfer_bytes_sum{transport="grpc"}'] > prefill_before.get(
        'tandem_kv_transfer_bytes_sum{transport="grpc"}', 0
    )
    decode = scrape(workers["decode-0"])
    assert "tandem_kv_cache_usage" in decode and "tandem_running_seqs" in decode


def test_the_last_message_reports_the_slo(grpc_cluster):
    _, _, address = grpc_cluster
    stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
    tight = api_pb2.GenerateRequest(
        text="def add(a, b):",
        sampling=api_pb2.SamplingParams(max_tokens=6, temperature=0),
        budget=api_pb2.LatencyBudget(ttft_seconds=1e-6),
    )
    last = list(stub.Generate(tight, timeout=60))[-1]
    assert last.slo.ttft_target_seconds == 1e-6 and not last.slo.met
    assert last.slo.ttft_seconds > 0 and last.slo.tpot_seconds > 0
    loose = api_pb2.GenerateRequest(
        text="def add(a, b):",
        sampling=api_pb2.SamplingParams(max_tokens=6, temperature=0),
        budget=api_pb2.LatencyBudget(ttft_seconds=60, tpot_seconds=60),
    )
    assert list(stub.Generate(loose, timeout=60))[-1].slo.met


def test_one_request_is_one_trace_across_router_prefill_and_decode(ray_instance, tmp_path):
    import json

    spans_dir = tmp_path / "spans"
    cfg = config("grpc").model_copy(
        update={
            "telemetry": parse_config(
                {"model": {"path": str(DEMO)}, "telemetry": {"exporter": "console", "console_dir": str(spans_dir)}}
            ).telemetry
        }
    )
    cluster = ray_cluster.start(cfg, namespace="tandem-traced")
    router = from_config(cfg, cluster.discover)
    address = router.start()
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
        request = api_pb2.GenerateRequest(
            token_ids=api_pb2.TokenIds(ids=list(range(30, 90))),
            sampling=api_pb2.SamplingParams(max_tokens=5, temperature=0),
        )
        metadata = (("traceparent", f"00-{trace_id}-{client_span}-01"),)
        assert len(list(stub.Generate(request, metadata=metadata, timeout=60))) >= 1
        wanted = {
            "router.generate",
            "router.queue",
            "router.prefill",
            "router.relay",
            "prefill.queue",
            "prefill.compute",
            "kv.transfer",
            "decode.admit",
            "decode",
        }
        deadline = time.monotonic() + 10
        while True:
            spans = [json.loads(line) for f in spans_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
            spans = [s for s in spans if s["context"]["trace_id"] == f"0x{trace_id}"]
            if wanted <= {s["name"] for s in spans} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        router.stop()
        cluster.shutdown()
    by_name = {s["name"]: s for s in spans}
    assert wanted <= set(by_name), sorted(by_name)
    root = by_name["router.generate"]
    assert root["parent_id"] == f"0x{client_span}", "the client's traceparent is continued"
    for name in wanted - {"router.generate"}:
        assert by_name[name]["parent_id"] == root["context"]["span_id"], name
    services = {name: by_name[name]["resource"]["attributes"]["service.name"] for name in wanted}
    assert services["router.generate"] == "tandem-router"
    assert services["prefill.compute"] == services["kv.transfer"] == "tandem-prefill-0"
    assert services["decode"] == services["decode.admit"] == "tandem-decode-0"
    files = {f.name.split("-")[-1] for f in spans_dir.glob("*.jsonl")}
    assert len(files) >= 3, "router, prefill and decode write from three processes"
    transfer = by_name["kv.transfer"]["attributes"]
    arch = load_model(DEMO, "float32").arch
    assert transfer["tandem.kv.bytes"] == 2 * arch.num_layers * 60 * arch.num_kv_heads * arch.head_dim * 4
    assert transfer["tandem.kv.transport"] == "grpc"
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert root["attributes"]["tandem.prefill_mode"] == "remote"
    # TTFT in three parts, end to end: queued at the router, prefilled, relayed to the client
    parts = [by_name[n] for n in ("router.queue", "router.prefill", "router.relay")]
    assert all(a["end_time"] <= b["start_time"] for a, b in itertools.pairwise(parts))
    assert by_name["router.prefill"]["attributes"]["tandem.first_token_from"] in ("prefill", "decode")
    assert root["attributes"]["gen_ai.request.model"] == "tandem-demo-code"
