"""KV transfer between two CUDA processes over NCCL, checked bit for bit.

    .venv/bin/python benchmarks/gpu_kv_nccl.py [--cpu]

This process is the decode worker (cuda:0): a decode engine behind a KV intake, served with the
collective transport. It starts a prefill process on cuda:1 that (1) sends random KV made from a
known seed, and (2) prefills real prompts with the prefill engine and ships their KV. This process
then checks (1) its paged cache bit for bit against the same seeded tensors and (2) the greedy
tokens against a single-process engine on cuda:0, and prints the transfer throughput.

NCCL refuses two ranks on one GPU, so with fewer than two devices the check says it is skipped
and exits 0. `--cpu` runs the same check with both processes on the CPU over Gloo (the path
tests/test_disaggregated.py and tests/test_kv_transport.py cover), to check the script itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.config import CacheConfig, SchedulerConfig, TransferConfig  # noqa: E402
from cluster.engine.request import SamplingParams  # noqa: E402
from cluster.kv.collective import CollectiveGroups  # noqa: E402
from cluster.kv.grpc_transport import CollectiveSender, serve  # noqa: E402
from cluster.kv.transport import TransferState  # noqa: E402
from cluster.kv.wire import KVHeader, make_chunk, model_fingerprint  # noqa: E402
from cluster.model.builder import init_model_folder  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402
from decode_worker.kv_intake import KVIntake  # noqa: E402
from prefill_worker.engine import PrefillEngine  # noqa: E402

CACHE = CacheConfig(block_size=16, num_blocks=512, watermark=0.0)
RANDOM_TOKENS = 1000
PROMPTS = {f"p{i}": (list(range(3 + i, 3 + i + 17 * (i + 1))), 12) for i in range(6)}


class NoText:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def seeded_kv(model, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    arch = model.arch
    g = torch.Generator().manual_seed(1234)
    shape = (RANDOM_TOKENS, arch.num_kv_heads, arch.head_dim)
    dtype = model.embed_tokens.weight.dtype
    return [
        (torch.randn(shape, generator=g).to(dtype).to(device), torch.randn(shape, generator=g).to(dtype).to(device))
        for _ in range(arch.num_layers)
    ]


def prefill_process(target: str, folder: str, device: str) -> int:
    model = load_model(folder, "bfloat16", device)
    groups = CollectiveGroups(device, timeout_s=60)
    sender = CollectiveSender(target, groups, timeout_s=60)
    arch = model.arch
    header = KVHeader(
        "random", model_fingerprint(model, arch), "bfloat16", arch.num_layers, arch.num_kv_heads, arch.head_dim,
        CACHE.block_size, tuple([5] * RANDOM_TOKENS), SamplingParams(max_tokens=4),
    )  # fmt: skip
    kv = seeded_kv(model, device)
    start = time.perf_counter()
    stream = sender.open(header)
    for i, (k, v) in enumerate(kv):
        stream.send(make_chunk(i, k[None], v[None]))
    stream.commit(0)
    if stream.wait(120) is not TransferState.DONE:
        print(f"random transfer failed: {stream.error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    nbytes = sum(2 * k.numel() * k.element_size() for k, _ in kv)
    engine = PrefillEngine(model, CACHE, SchedulerConfig(), TransferConfig(), CACHE.num_blocks)
    for rid, (prompt, max_tokens) in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), sender)
    first = {}
    while engine.scheduler.has_work:
        for out in engine.step():
            first[out.request_id] = out.first_token
            if out.transfer.wait(120) is not TransferState.DONE:
                print(f"{out.request_id}: {out.transfer.error}", file=sys.stderr)
                return 1
    groups.close()
    print(json.dumps({"first": first, "bytes": nbytes, "seconds": seconds}))
    return 0


def decode_process(cpu: bool) -> int:
    if not cpu and torch.cuda.device_count() < 2:
        print("SKIPPED: the NCCL check needs two CUDA devices (NCCL refuses two ranks on one GPU)")
        return 0
    device, peer_device = ("cpu", "cpu") if cpu else ("cuda:0", "cuda:1")
    with tempfile.TemporaryDirectory() as folder:
        init_model_folder(folder, "tiny", dtype="bfloat16", seed=0)
        model = load_model(folder, "bfloat16", device)
        engine = Engine(model, NoText(), CACHE, SchedulerConfig())
        intake = KVIntake(engine, model_fingerprint(model, model.arch), timeout_s=60)
        groups = CollectiveGroups(device, timeout_s=60)
        server, port = serve(intake, groups=groups)
        peer = subprocess.run(
            [sys.executable, __file__, "--prefill", f"127.0.0.1:{port}", folder, peer_device],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    if peer.returncode != 0:
        print(peer.stderr, file=sys.stderr)
        return 1
    report = json.loads(peer.stdout.strip().splitlines()[-1])
    table = engine.scheduler.blocks.block_table("random")
    for layer, (k, v) in enumerate(seeded_kv(model, device)):
        k_cache, v_cache = engine.kv_cache[layer]
        assert torch.equal(k_cache[table].flatten(0, 1)[:RANDOM_TOKENS], k), f"layer {layer} keys differ"
        assert torch.equal(v_cache[table].flatten(0, 1)[:RANDOM_TOKENS], v), f"layer {layer} values differ"
    engine.abort("random")
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    reference = Engine(model, NoText(), CACHE, SchedulerConfig())
    for rid, (prompt, max_tokens) in PROMPTS.items():
        reference.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    expected: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while reference.has_unfinished:
        for out in reference.step():
            expected[out.request_id] += out.token_ids
    assert tokens == expected, (tokens, expected)
    assert all(tokens[rid][0] == report["first"][rid] for rid in PROMPTS)
    server.stop(None)
    groups.close()
    gbps = report["bytes"] / report["seconds"] / 1e9
    mb = report["bytes"] / 1e6
    print(f"OK: {mb:.1f} MB of KV bit-identical over {groups.backend} ({gbps:.2f} GB/s with set-up and checksums);")
    print(f"    {len(PROMPTS)} prompts prefilled on {peer_device}, decoded on {device}: the single-process tokens")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--prefill":
        sys.exit(prefill_process(*sys.argv[2:]))
    sys.exit(decode_process(cpu="--cpu" in sys.argv))
