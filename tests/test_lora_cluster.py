"""LoRA through the cluster (the demo model, float32, engines in their core processes, gRPC on
loopback): requests through two adapters and the base model, prefilled remotely and locally, give
PEFT's greedy tokens; routers name an adapter's KV apart from the base model's; an unknown adapter is
NOT_FOUND over gRPC and 404 on the OpenAI face, which lists each adapter with its parent."""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import json
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.config import parse_config
from cluster.model.tokenizer import Tokenizer
from router.sdk.client import Client, NotFound
from tests.lora_adapters import peft, peft_greedy, peft_logprobs, write_adapter
from tests.served import serving, wait_idle

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
ADAPTERS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp-r4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "down_proj", "o_proj"]),
    "ku-r6": dict(r=6, lora_alpha=6, use_rslora=True, target_modules=["k_proj", "up_proj"]),
}
LATER = {
    "all-r2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"])
}  # loaded while serving
NEW = 8
ROW = 48  # tokens per request of the one-batch tests: long enough that all four decode together


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three adapters on the demo model, and PEFT's model holding them all."""
    root = tmp_path_factory.mktemp("demo-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype="float32").eval()
    folders = {}
    for seed, (name, kwargs) in enumerate({**ADAPTERS, **LATER}.items()):
        write_adapter(base, root / name, seed, **kwargs)
        folders[name] = root / name
    first, *rest = {**ADAPTERS, **LATER}
    reference = peft.PeftModel.from_pretrained(copy.deepcopy(base), folders[first], adapter_name=first)
    for name in rest:
        reference.load_adapter(folders[name], adapter_name=name)
    return folders, reference.eval()


@pytest.fixture(scope="module")
def served(adapters):
    folders, _ = adapters
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32", "adapters": {n: str(folders[n]) for n in ADAPTERS}},
            "cache": {"block_size": 16, "num_blocks": 96},
            "router": {"local_prefill_max_tokens": 16},
            "lora": {"max_loras": 3, "max_rank": 8, "runtime_loading": True},
        }
    )
    with serving(config, "tandem-demo-code") as cluster:
        yield cluster


def prompt(i: int, length: int) -> list[int]:
    return [(31 * i + 7 * j) % 4000 + 20 for j in range(length)]


def together(served, calls: dict) -> tuple[dict, int]:  # type: ignore[no-untyped-def,type-arg]
    """Runs `calls` ({key: callable}) at once; returns their results and the most sequences the
    decode worker ran in one batch meanwhile (its load, read every millisecond)."""
    peak, done = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, served.decode.load().running_seqs)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        results = {key: f.result(timeout=300) for key, f in futures.items()}
    done.set()
    watcher.join()
    return results, peak


def grpc_row(client: Client, p: list[int], name: str | None) -> tuple[list[int], list[float]]:
    """A greedy stream through `name` (None: the base model): its tokens and their log-probabilities."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for delta in client.stream(p, max_tokens=ROW, temperature=0.0, ignore_eos=True, adapter=name or "", logprobs=1):
        tokens += delta.token_ids
        logprobs += delta.logprobs
    return tokens, logprobs


@pytest.mark.parametrize("length, placed", [(40, "remote"), (9, "local")])
def test_rows_of_three_adapters_and_the_base_in_one_batch_give_peft_tokens_and_logprobs(
    adapters, served, length, placed
):
    """The base model's request and one through each adapter run at once (all four in the decode
    batch together) and give PEFT's greedy tokens, and log-probabilities within 1e-3 of PEFT's."""
    _, reference = adapters
    names = [None, *ADAPTERS]
    prompts = {name: prompt(i + length, length) for i, name in enumerate(names)}
    with Client(served.grpc_address) as client:
        got = client.generate(prompt(100 + length, length), max_tokens=1)  # where prompts this long go
        assert got.metadata["tandem-prefill"].startswith(placed), got.metadata
        rows, peak = together(
            served, {name: functools.partial(grpc_row, client, prompts[name], name) for name in names}
        )
    assert peak == len(names), "the four rows shared decode steps"
    for name in names:
        tokens, logprobs = rows[name]
        assert tokens == peft_greedy(reference, name, prompts[name], ROW), name
        expected = peft_logprobs(reference, name, prompts[name], tokens)
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), expected, atol=1e-3, rtol=0)


def test_the_openai_face_serves_rows_of_every_adapter_in_one_batch_with_peft_logprobs(adapters, served):
    import openai

    _, reference = adapters
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    tokenizer = Tokenizer(DEMO)
    models = {"tandem-demo-code": None, **{name: name for name in ADAPTERS}}
    prompts = {model: prompt(60 + i, 30) for i, model in enumerate(models)}

    def row(model: str):  # type: ignore[no-untyped-def]
        return client.completions.create(
            model=model,
            prompt=prompts[model],
            max_tokens=ROW,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )

    replies, peak = together(served, {model: functools.partial(row, model) for model in models})
    assert peak == len(models), "the four rows shared decode steps"
    for model, name in models.items():
        reply = replies[model]
        tokens = peft_greedy(reference, name, prompts[model], ROW)
        assert reply.model == model and reply.choices[0].text == tokenizer.decode(tokens), model
        logprobs = torch.tensor(reply.choices[0].logprobs.token_logprobs, dtype=torch.float64)
        torch.testing.assert_close(logprobs, peft_logprobs(reference, name, prompts[model], tokens), atol=1e-3, rtol=0)


def test_the_same_prompt_through_another_adapter_shares_no_kv(served):
    p = prompt(99, 48)
    with Client(served.grpc_address) as client:
        cached = {}
        for turn, name in enumerate(["qv-r8", "qv-r8", "mlp-r4", ""]):
            got = client.generate(p, max_tokens=2, temperature=0.0, ignore_eos=True, adapter=name)
            cached[(turn, name)] = got.cached_prompt_tokens
    assert cached == {(0, "qv-r8"): 0, (1, "qv-r8"): 32, (2, "mlp-r4"): 0, (3, ""): 0}


def test_an_unknown_adapter_is_not_found_by_name(served):
    with Client(served.grpc_address) as client, pytest.raises(NotFound, match="adapter 'nope'"):
        client.generate(prompt(1, 20), max_tokens=2, adapter="nope")
    request = urllib.request.Request(
        f"{served.base}/v1/completions",
        json.dumps({"model": "nope", "prompt": "def f():", "max_tokens": 2}).encode(),
        {"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 404 and "nope" in json.loads(e.value.read())["error"]["message"]


def test_the_openai_face_lists_each_adapter_with_its_parent(served):
    import openai

    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(listed) == {"tandem-demo-code", *ADAPTERS}
    assert all(listed[name]["parent"] == "tandem-demo-code" for name in ADAPTERS)


def test_an_adapter_loaded_and_unloaded_under_load_loses_no_request(adapters, served):
    """Requests stream while an adapter is loaded on every worker, serves greedy PEFT tokens, and is
    unloaded with its own requests running: every request ends whole, later ones are NOT_FOUND."""
    folders, reference = adapters
    (name,) = LATER
    admin = worker_pb2_grpc.AdminStub(grpc.insecure_channel(served.grpc_address))
    with Client(served.grpc_address) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        background = [
            pool.submit(client.generate, prompt(200 + i, 30), max_tokens=24, temperature=0.0, ignore_eos=True)
            for i in range(4)
        ]
        loaded = admin.LoadAdapter(worker_pb2.LoadAdapterRequest(name=name, path=str(folders[name])), timeout=120)
        assert sorted(loaded.workers) == ["decode-0", "prefill-0"]
        with pytest.raises(grpc.RpcError) as again:
            admin.LoadAdapter(worker_pb2.LoadAdapterRequest(name=name, path=str(folders[name])), timeout=120)
        assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS and name in again.value.details()
        wait_listed(admin, name)
        for length in (40, 9):  # prefilled remotely, then locally
            p = prompt(300 + length, length)
            got = client.generate(p, max_tokens=NEW, temperature=0.0, ignore_eos=True, adapter=name)
            assert got.token_ids == peft_greedy(reference, name, p, NEW)
        started = [threading.Event() for _ in range(3)]
        running = [pool.submit(streamed, client, prompt(400 + i, 30), name, e) for i, e in enumerate(started)]
        assert all(e.wait(120) for e in started), "each request through the adapter is running"
        unloaded = admin.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name=name), timeout=60)
        assert sorted(unloaded.workers) == ["decode-0", "prefill-0"]
        for future in background:
            assert future.result(timeout=300).completion_tokens == 24
        for i, future in enumerate(running):
            p = prompt(400 + i, 30)
            assert future.result(timeout=300) == peft_greedy(reference, name, p, 24), "finished through the adapter"
        with pytest.raises(NotFound, match=name):
            client.generate(prompt(1, 20), max_tokens=2, adapter=name)
    wait_idle(served)


def streamed(client: Client, p: list[int], adapter: str, first: threading.Event) -> list[int]:
    """A greedy stream of 24 tokens through `adapter`; `first` is set once a token has come."""
    tokens: list[int] = []
    for delta in client.stream(p, max_tokens=24, temperature=0.0, ignore_eos=True, adapter=adapter):
        tokens += delta.token_ids
        first.set()
    return tokens


def wait_listed(admin, name: str) -> None:  # type: ignore[no-untyped-def]
    """Until every worker's pushed load lists the adapter (the routers place from those)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = {a.name: a for a in admin.ListAdapters(worker_pb2.ListAdaptersRequest(), timeout=10).adapters}
        if name in found and len(found[name].workers) == 2:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} never listed on both workers")


def test_a_bad_adapter_is_refused_by_name_and_left_on_no_worker(served, tmp_path):
    admin = worker_pb2_grpc.AdminStub(grpc.insecure_channel(served.grpc_address))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(grpc.RpcError) as bad:
        admin.LoadAdapter(worker_pb2.LoadAdapterRequest(name="dora", path=str(tmp_path)), timeout=60)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'dora'" in bad.value.details()
    assert "use_dora" in bad.value.details()
    listed = admin.ListAdapters(worker_pb2.ListAdaptersRequest(), timeout=10).adapters
    assert "dora" not in {a.name for a in listed}
    with Client(served.grpc_address) as client:  # serving on
        assert client.generate(prompt(5, 20), max_tokens=3, adapter="qv-r8").completion_tokens == 3


def test_tandem_adapters_lists_loads_and_refuses_by_name(served, capsys, tmp_path):
    from cli.main import main

    assert main(["adapters", "list", "--target", served.grpc_address]) == 0
    listed = capsys.readouterr().out
    assert "qv-r8" in listed and "mlp-r4" in listed and "decode-0" in listed and "prefill-0" in listed
    assert main(["adapters", "load", "missing", str(tmp_path), "--target", served.grpc_address]) == 1
    refused = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in refused and "'missing'" in refused and "adapter_config.json is missing" in refused
    assert main(["adapters", "unload", "never-loaded", "--target", served.grpc_address]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_structured_output_runs_through_an_adapter(served):
    from router.sdk.client import Choice

    with Client(served.grpc_address) as client:
        for name in ADAPTERS:
            got = client.generate("def f():", max_tokens=8, structured=Choice(["yes", "no", "maybe"]), adapter=name)
            assert got.text in ("yes", "no", "maybe"), (name, got.text)


@pytest.fixture(scope="module")
def moving(adapters):
    """Two decode workers and a prefill worker, all holding the adapters (engines on the workers'
    threads), behind a router that places at random and moves broken streams."""
    from decode_worker import service as decode_service
    from prefill_worker import service as prefill_service
    from router.service import server as router_server

    folders, _ = adapters
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32", "adapters": {n: str(folders[n]) for n in ADAPTERS}},
            "cache": {"block_size": 16, "num_blocks": 128},
            "scheduler": {"engine_core": "thread"},
            "router": {"local_prefill_max_tokens": 16, "migration_limit": 3, "prefix_routing": "random"},
            "lora": {"max_loras": 3, "max_rank": 8},
        }
    )
    decodes = {f"decode-{i}": decode_service.from_config(config, f"decode-{i}") for i in range(2)}
    prefill = prefill_service.from_config(config, "prefill-0")
    live = {name: w.start() for name, w in decodes.items()} | {"prefill-0": prefill.start()}
    router = router_server.from_config(config, lambda: live)
    yield router.start(), router, decodes, live
    router.stop()
    prefill.stop()
    for worker in decodes.values():
        worker.stop()


def test_requests_through_adapters_moved_off_a_stopped_decode_worker_end_as_if_undisturbed(adapters, moving):
    """Greedy and seeded requests through each adapter stream while the decode worker running most
    of them stops: they move, with what they streamed, to the other, which goes on through the same
    adapter. Greedy ones end with PEFT's tokens, seeded ones with the tokens of the same request run
    undisturbed."""
    _, reference = adapters
    address, router, decodes, live = moving
    requests = {
        f"{name}-{i}": (prompt(500 + 10 * j + i, 30), name, dict(temperature=1.0, seed=j) if i % 2 else {})
        for j, name in enumerate(ADAPTERS)
        for i in range(4)
    }
    common = dict(max_tokens=96, ignore_eos=True)
    with Client(address, timeout=300) as client:
        undisturbed = {
            key: client.generate(p, adapter=name, **common, **sampling).token_ids
            for key, (p, name, sampling) in requests.items()
            if sampling
        }
    progress: dict[str, int] = {}

    def run(key: str) -> list[int]:
        p, name, sampling = requests[key]
        tokens: list[int] = []
        with Client(address, timeout=300, retries=0) as client:
            for delta in client.stream(p, adapter=name, **common, **({"temperature": 0.0} | sampling)):
                tokens += delta.token_ids
                progress[key] = len(tokens)
        return tokens

    before = router.telemetry.metrics.migrations.labels("decode")._value.get()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = {key: pool.submit(run, key) for key in requests}
        deadline = time.monotonic() + 120
        while sum(1 for n in progress.values() if n >= 3) < len(requests) // 2:
            assert time.monotonic() < deadline, "the streams never got going"
            time.sleep(0.005)
        victim = max(decodes, key=lambda name: decodes[name].engine.occupancy.running)
        assert decodes[victim].engine.occupancy.running, "a decode worker is running some of them"
        del live[victim]
        decodes[victim].stop()
        results = {key: f.result(timeout=300) for key, f in futures.items()}
    assert router.telemetry.metrics.migrations.labels("decode")._value.get() > before
    for key, (p, name, sampling) in requests.items():
        expected = undisturbed[key] if sampling else peft_greedy(reference, name, p, 96)
        assert results[key] == expected, key
