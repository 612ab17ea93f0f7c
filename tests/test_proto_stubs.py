"""The committed gRPC stubs are what grpcio-tools generates from the committed .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_are_fresh(tmp_path):
    subprocess.run(
        [str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    committed = ROOT / "proto"
    for rel in generated:
        assert (committed / rel).exists(), f"{rel} is not committed: run `make proto`"
        assert (committed / rel).read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run `make proto`"


def test_public_messages_import_with_grpc_and_protobuf_alone():
    code = (
        "import sys; import tandem.v1.api_pb2 as api, tandem.v1.api_pb2_grpc as rpc;"
        "r = api.GenerateRequest(text='hi', sampling=api.SamplingParams(max_tokens=4, temperature=0));"
        "assert r.WhichOneof('prompt') == 'text' and r.sampling.HasField('temperature');"
        "assert rpc.TandemStub;"
        "assert 'torch' not in sys.modules and 'cluster' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
