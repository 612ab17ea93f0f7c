"""The auth table: client API keys at the router, the cluster secret on internal channels, and
router-minted capabilities on KV transfers. Servers run in this process on loopback."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

from cluster.auth import SECRET_HEADER, mint_capability
from cluster.config import parse_config
from cluster.engine.request import SamplingParams
from cluster.kv.grpc_transport import GrpcSender
from cluster.kv.transport import TransferState
from cluster.kv.wire import KVHeader, make_chunk
from decode_worker import service as decode_service
from prefill_worker import service as prefill_service
from router.sdk.client import Client, Unauthenticated
from router.service import server as router_server

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
KEY, SECRET = "Key-123", "cluster-s3cret"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    keys = tmp_path_factory.mktemp("secrets") / "api-keys"
    keys.write_text("another-key\n")
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
            "cache": {"block_size": 16, "num_blocks": 64},
            "router": {"local_prefill_max_tokens": 4},
            "auth": {"api_keys": [KEY], "api_keys_file": str(keys), "cluster_secret": SECRET},
        }
    )
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = router_server.from_config(config, lambda: workers)
    address = router.start()
    yield address, workers, decode, config
    router.stop()
    prefill.stop()
    decode.stop()


def test_clients_need_a_valid_key_and_health_stays_open(cluster):
    address, _, decode, _ = cluster
    for key in (None, "wrong", KEY.lower(), KEY + " "):
        with Client(address, api_key=key, retries=0) as client, pytest.raises(Unauthenticated):
            client.generate("def f():", max_tokens=2)
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            api_pb2_grpc.TandemStub(channel).GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=5)
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.AdminStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    for key in (KEY, "another-key"):  # inline and from the key file
        with Client(address, api_key=key) as client:
            done = client.generate(list(range(10, 40)), max_tokens=3, temperature=0)  # prefilled remotely
        assert len(done.token_ids) == 3 and done.metadata["tandem-prefill"].startswith("remote")
    assert decode.engine.occupancy.free_blocks == 64


def test_workers_refuse_calls_without_the_cluster_secret(cluster):
    _, workers, _, _ = cluster
    for address in workers.values():
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for metadata in ((), ((SECRET_HEADER, "guess"),)):
                with pytest.raises(grpc.RpcError) as e:
                    stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5, metadata=metadata)
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5, metadata=((SECRET_HEADER, SECRET),)).role


def push(address: str, decode, capability: bytes, request_id: str = "r", secret: str | None = SECRET):
    arch = decode.engine.info.arch
    header = KVHeader(
        request_id, decode.intake.fingerprint, "float32", arch.num_layers, arch.num_kv_heads, arch.head_dim,
        16, tuple(range(5, 45)), SamplingParams(max_tokens=512), capability=capability,  # still running when cancelled
    )  # fmt: skip
    metadata = ((SECRET_HEADER, secret),) if secret else ()
    sender = GrpcSender(address, timeout_s=10, metadata=metadata)
    stream = sender.open(header)
    import torch

    for layer in range(arch.num_layers):
        kv = torch.zeros(1, 40, arch.num_kv_heads, arch.head_dim)
        stream.send(make_chunk(layer, kv, kv))
    stream.commit(7)
    stream.wait(15)
    sender.close()
    return stream


def test_kv_pushes_need_a_genuine_capability_for_their_request(cluster):
    _, workers, decode, _ = cluster
    address, secret = workers["decode-0"], SECRET.encode()
    now = time.time()
    cases = {
        "none": (b"", grpc.StatusCode.PERMISSION_DENIED),
        "expired": (mint_capability(secret, "r", 40, 16, ttl_s=1, now=now - 10), grpc.StatusCode.PERMISSION_DENIED),
        "another request": (mint_capability(secret, "other", 40, 16, ttl_s=60), grpc.StatusCode.PERMISSION_DENIED),
        "too few blocks": (mint_capability(secret, "r", 16, 16, ttl_s=60), grpc.StatusCode.PERMISSION_DENIED),
        "forged": (mint_capability(b"not the secret", "r", 40, 16, ttl_s=60), grpc.StatusCode.PERMISSION_DENIED),
    }
    for name, (capability, code) in cases.items():
        stream = push(address, decode, capability)
        assert stream.state is TransferState.FAILED and stream.error.code is code, (name, stream.error)
        assert decode.engine.occupancy.free_blocks == 64, f"{name}: a block was reserved"
        assert decode.intake.in_flight == 0
    no_secret = push(address, decode, mint_capability(secret, "r", 40, 16, ttl_s=60), secret=None)
    assert no_secret.error.code is grpc.StatusCode.UNAUTHENTICATED
    good = push(address, decode, mint_capability(secret, "r", 40, 16, ttl_s=60))
    assert good.state is TransferState.DONE, good.error
    assert decode._cancel("r")
    assert decode.engine.occupancy.free_blocks == 64


def test_tls_and_mutual_tls_with_the_generated_certificates(tmp_path):
    from cluster.tls import generate_dev_certs

    certs = generate_dev_certs(tmp_path / "certs")
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
            "cache": {"block_size": 16, "num_blocks": 64},
            "router": {"local_prefill_max_tokens": 4},
            "auth": {"tls_cert": str(certs["cert"]), "tls_key": str(certs["key"]), "tls_ca": str(certs["ca"])},
        }
    )
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = router_server.from_config(config, lambda: workers)
    address = router.start()
    try:
        with Client(address, tls_ca=str(certs["ca"])) as client:  # the KV crosses the mutual-TLS channel
            done = client.generate(list(range(10, 40)), max_tokens=3, temperature=0)
        assert len(done.token_ids) == 3 and done.metadata["tandem-prefill"].startswith("remote")
        with Client(address, retries=0, timeout=5) as plaintext, pytest.raises(Exception) as e:
            plaintext.generate("x", max_tokens=1)
        assert type(e.value).__name__ == "Unavailable"
        ca = certs["ca"].read_bytes()
        no_client_cert = grpc.secure_channel(workers["decode-0"], grpc.ssl_channel_credentials(root_certificates=ca))
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.WorkerStub(no_client_cert).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, "workers demand a client certificate"
        mutual = grpc.ssl_channel_credentials(ca, certs["key"].read_bytes(), certs["cert"].read_bytes())
        with grpc.secure_channel(workers["decode-0"], mutual) as channel:
            assert worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5).role == "decode"
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
