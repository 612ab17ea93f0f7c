"""LoRA through the cluster (the demo model, float32, engines in their core processes, gRPC on
loopback): requests through two adapters and the base model, prefilled remotely and locally, give
PEFT's greedy tokens; routers name an adapter's KV apart from the base model's; an unknown adapter is
NOT_FOUND over gRPC and 404 on the OpenAI face, which lists each adapter with its parent."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cluster.config import parse_config
from cluster.model.tokenizer import Tokenizer
from router.sdk.client import Client, NotFound
from tests.lora_adapters import peft, peft_greedy, write_adapter
from tests.served import serving

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
ADAPTERS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp-r4": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "down_proj", "o_proj"]),
}
LATER = {
    "all-r2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"])
}  # loaded while serving
NEW = 8


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
            "lora": {"max_loras": 2, "max_rank": 8, "runtime_loading": True},
        }
    )
    with serving(config, "tandem-demo-code") as cluster:
        yield cluster


def prompt(i: int, length: int) -> list[int]:
    return [(31 * i + 7 * j) % 4000 + 20 for j in range(length)]


@pytest.mark.parametrize("length, placed", [(40, "remote"), (9, "local")])
def test_adapters_and_the_base_model_give_peft_greedy_tokens(adapters, served, length, placed):
    _, reference = adapters
    with Client(served.grpc_address) as client:
        for i, name in enumerate([None, *ADAPTERS]):
            p = prompt(i + length, length)
            got = client.generate(p, max_tokens=NEW, temperature=0.0, ignore_eos=True, adapter=name or "")
            assert got.metadata["tandem-prefill"].startswith(placed), got.metadata
            assert got.token_ids == peft_greedy(reference, name, p, NEW), name


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


def test_the_openai_face_lists_adapters_and_serves_them_by_model_name(adapters, served):
    import openai

    _, reference = adapters
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(listed) == {"tandem-demo-code", *ADAPTERS}
    assert all(listed[name]["parent"] == "tandem-demo-code" for name in ADAPTERS)
    tokenizer = Tokenizer(DEMO)
    p = prompt(7, 30)
    for name in ADAPTERS:
        reply = client.completions.create(
            model=name, prompt=p, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.model == name
        assert reply.choices[0].text == tokenizer.decode(peft_greedy(reference, name, p, NEW)), name


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
