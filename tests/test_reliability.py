"""Bad days: overload is refused up front and leaks nothing, KV pressure preempts instead of failing,
and no request — well-formed, nonsensical or malformed — makes the router fail with INTERNAL or
UNKNOWN. Servers run in this process on loopback."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem.v1 import api_pb2, api_pb2_grpc

from cluster.config import parse_config
from cluster.engine.request import SamplingParams
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from decode_worker import service as decode_service
from decode_worker.engine import Engine
from prefill_worker import service as prefill_service
from router.service import server as router_server

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"


def start_cluster(**overrides):
    data = {
        "model": {"path": str(DEMO), "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": 256},
        "router": {"local_prefill_max_tokens": 8, "max_queued_requests": 64},
    }
    for part, values in overrides.items():
        data[part] = {**data.get(part, {}), **values}
    config = parse_config(data)
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = router_server.from_config(config, lambda: workers)
    address = router.start()

    def stop() -> None:
        router.stop()
        prefill.stop()
        decode.stop()

    return address, router, decode, stop


def generate(stub, prompt, max_tokens, timeout=120, **sampling) -> tuple[list[int], grpc.StatusCode | None, int]:
    """(tokens, status code or None, tokens received before the error); greedy unless `sampling` says."""
    request = api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=prompt),
        sampling=api_pb2.SamplingParams(max_tokens=max_tokens, **{"temperature": 0, "ignore_eos": True, **sampling}),
    )
    tokens: list[int] = []
    try:
        for m in stub.Generate(request, timeout=timeout):
            tokens += m.token_ids
        return tokens, None, len(tokens)
    except grpc.RpcError as e:
        return tokens, e.code(), len(tokens)


def test_overload_is_refused_before_the_stream_and_leaks_nothing():
    address, router, decode, stop = start_cluster(router={"max_queued_requests": 4})
    try:
        stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
        results = {}

        def one(i: int) -> None:
            results[i] = generate(stub, [10 + i, 11, 12, 13, 14, 15, 16, 17, 18, 19] * 3, 40)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]  # 10x what it admits
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [r for r in results.values() if r[1] is not None]
        served = [r for r in results.values() if r[1] is None]
        assert refused and served
        assert all(code is grpc.StatusCode.RESOURCE_EXHAUSTED and before == 0 for _, code, before in refused)
        assert all(len(tokens) == 40 for tokens, _, _ in served)
        assert router._in_flight == 0
        assert decode.engine.occupancy.free_blocks == 256, "KV blocks back to idle"
        assert not decode._streams and not decode.engine.has_unfinished
    finally:
        stop()


def test_a_worker_refuses_past_its_own_queue_bound_before_any_token():
    address, router, decode, stop = start_cluster(
        scheduler={"max_waiting": 2, "max_num_seqs": 2, "engine_core": "thread"},  # its step is held in this process
        router={"local_prefill_max_tokens": 100},
    )
    release = threading.Event()
    engine = decode.engine.engine
    step = engine.step
    engine.step = lambda: (release.wait(), step())[1]  # hold the engine while the queue fills
    try:
        stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
        results = {}
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, generate(stub, [9 + i, 10, 11], 60)))
            for i in range(8)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(results) < 8 - 3 and time.monotonic() < deadline:  # 2 waiting + 1 in the held step
            time.sleep(0.05)
        release.set()
        for t in threads:
            t.join()
        refused = [r for r in results.values() if r[1] is not None]
        assert refused and all(c is grpc.StatusCode.RESOURCE_EXHAUSTED and n == 0 for _, c, n in refused)
        assert all(len(t) == 60 for t, c, _ in results.values() if c is None)
        assert decode.engine.occupancy.free_blocks == 256 and router._in_flight == 0
    finally:
        release.set()
        stop()


def test_kv_pressure_preempts_and_outputs_do_not_change():
    """Greedy and seeded sampled requests (every other one, each with its own seed) preempted and
    recomputed give the tokens of an unloaded run."""
    address, _, decode, stop = start_cluster(
        cache={"num_blocks": 20}, router={"local_prefill_max_tokens": 1000},
        scheduler={"engine_core": "thread"},  # its preemptions are counted in this process
    )  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 2000) for _ in range(rng.randint(20, 60))] for _ in range(10)]
    sampling = [{"temperature": 0.8, "seed": 50 + i} if i % 2 else {} for i in range(len(prompts))]
    preempted: list[int | None] = []  # the seeds of preempted requests
    scheduler = decode.engine.engine.scheduler
    preempt = scheduler._preempt
    scheduler._preempt = lambda request: (preempted.append(request.params.seed), preempt(request))[1]
    try:
        stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
        results = {}
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, generate(stub, prompts[i], 80, **sampling[i])))
            for i in range(len(prompts))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert scheduler.stats.num_preemptions > 0, "20 blocks for 10 sequences of ~9 must preempt"
        assert any(seed is not None for seed in preempted), "a seeded request should be among the preempted"
    finally:
        stop()
    tok = Tokenizer(DEMO)
    config = parse_config({"model": {"path": str(DEMO)}})
    reference = Engine(load_model(DEMO, "float32"), tok, config.cache, config.scheduler, tok.eos_token_ids)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=80, ignore_eos=True, **{"temperature": 0.0, **sampling[i]})
        reference.add_request(str(i), prompt, params)
    expected: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while reference.has_unfinished:
        for out in reference.step():
            expected[out.request_id] += out.token_ids
    for i in range(len(prompts)):
        tokens, code, _ = results[i]
        assert code is None and tokens == expected[str(i)], i


@pytest.fixture(scope="module")
def fuzz_target():
    address, _, decode, stop = start_cluster()
    yield api_pb2_grpc.TandemStub(grpc.insecure_channel(address)), address, decode
    stop()


DOCUMENTED = {None, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

floats = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32))
sampling = st.builds(
    lambda max_tokens, temperature, top_p, top_k, min_p, rep, pres, freq, stop, stop_ids, seed, logprobs, min_tokens: (
        api_pb2.SamplingParams(
            max_tokens=max_tokens, presence_penalty=pres, frequency_penalty=freq, stop=stop,
            stop_token_ids=stop_ids, min_tokens=min_tokens,
            **{k: v for k, v in dict(
                temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=rep,
                seed=seed, logprobs=logprobs,
            ).items() if v is not None},
        )
    ),
    st.integers(0, 3000), floats, floats, st.one_of(st.none(), st.integers(-5, 100)), floats, floats,
    st.floats(-5, 5, width=32), st.floats(-5, 5, width=32), st.lists(st.text(max_size=6), max_size=20),
    st.lists(st.integers(0, 2**32 - 1), max_size=4), st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    st.one_of(st.none(), st.integers(0, 50)), st.integers(0, 10),
)  # fmt: skip
prompts = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=40)),
    st.builds(lambda ids: {"token_ids": api_pb2.TokenIds(ids=ids)}, st.lists(st.integers(0, 2**32 - 1), max_size=30)),
    st.builds(
        lambda msgs: {"chat": api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role=r, content=c) for r, c in msgs])},
        st.lists(
            st.tuples(st.sampled_from(["user", "system", "assistant", "", "x"]), st.text(max_size=20)), max_size=3
        ),
    ),
    st.just({}),
)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, sampling=sampling, request_id=st.text(max_size=200))
def test_fuzzed_requests_get_documented_codes_only(fuzz_target, prompt, sampling, request_id):
    stub, _, _ = fuzz_target
    # Keep generation short so thousands of cases run quickly; validation still sees every field
    # (max_tokens 0, "up to the context window", is covered by the validation unit tests).
    if sampling.max_tokens < 1000:
        sampling.max_tokens = 1 + sampling.max_tokens % 4
    request = api_pb2.GenerateRequest(request_id=request_id, sampling=sampling, **prompt)
    code = None
    try:
        for _ in stub.Generate(request, timeout=60):
            pass
    except grpc.RpcError as e:
        code = e.code()
        assert e.details(), "every refusal says why"
    assert code in DOCUMENTED, (code, request)


def test_malformed_bytes_are_invalid_argument_and_oversize_is_refused(fuzz_target):
    _, address, decode = fuzz_target
    with grpc.insecure_channel(address) as channel:
        raw = channel.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=None, response_deserializer=None)
        for junk in (b"\xff\xff\xff", b"\x12\x05abc", b"\x0a\x02\xc3\x28"):  # bad tag, short length, bad UTF-8
            with pytest.raises(grpc.RpcError) as e:
                list(raw(junk, timeout=10))
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, junk
        with pytest.raises(grpc.RpcError) as e:
            list(raw(b"\x12" + b"\xff\xff\xff\x7f" + b"a" * (300 << 20), timeout=30))
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert decode.engine.occupancy.free_blocks == 256


def test_a_wedged_engine_turns_health_not_serving_and_gets_no_requests():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from router.placement.placement import NoCapacity

    address, router, decode, stop = start_cluster(
        scheduler={"wedged_after_s": 0.5, "engine_core": "thread"},  # its step hangs in this process
        router={"local_prefill_max_tokens": 100},
    )
    release = threading.Event()
    engine = decode.engine.engine
    step = engine.step
    engine.step = lambda: (release.wait(), step())[1]  # the engine hangs on its next step
    try:
        stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
        stuck = threading.Thread(target=generate, args=(stub, [5, 6, 7], 5))
        stuck.start()
        worker_health = health_pb2_grpc.HealthStub(grpc.insecure_channel(decode.server.address))
        deadline = time.monotonic() + 10
        while (
            worker_health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            != health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline, "a wedged engine must turn its health NOT_SERVING"
            time.sleep(0.05)
        assert decode.load().wedged
        deadline = time.monotonic() + 1  # the wedged load reaches the router on its Watch stream
        while True:
            try:
                router.view.index.choose([1], 1, 16, 100)
            except NoCapacity:
                break  # the router places nothing there
            assert time.monotonic() < deadline, "the router's view must take the wedged worker out"
            time.sleep(0.01)
        release.set()
        stuck.join(60)
        deadline = time.monotonic() + 10
        while (
            worker_health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            != health_pb2.HealthCheckResponse.SERVING
        ):
            assert time.monotonic() < deadline, "health recovers once the engine steps again"
            time.sleep(0.05)
    finally:
        release.set()
        stop()


def test_two_requests_with_the_same_client_id_both_complete():
    address, router, decode, stop = start_cluster()
    try:
        stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(address))
        request = api_pb2.GenerateRequest(
            request_id="same-id", token_ids=api_pb2.TokenIds(ids=list(range(50, 90))),
            sampling=api_pb2.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        )  # fmt: skip
        results: list[list[int]] = []

        def one() -> None:
            results.append([t for m in stub.Generate(request, timeout=60) for t in m.token_ids])

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 3 and results[0] == results[1] == results[2] and len(results[0]) == 30
        assert decode.engine.occupancy.free_blocks == 256 and router.in_flight == 0
    finally:
        stop()
