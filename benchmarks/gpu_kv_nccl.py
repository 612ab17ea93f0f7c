"""KV transfer between a prefill and a decode engine over one transport, checked bit for bit.

    .venv/bin/python benchmarks/gpu_kv_nccl.py [--cpu] [--transport collective|grpc|local[,...]] [--model DIR]
        [--json FILE]

This process is the decode worker (cuda:0): a decode engine behind a KV intake. The prefill side
(1) sends random KV made from a known seed, and (2) prefills real prompts with the prefill engine
and ships their KV. This process then checks (1) its paged cache bit for bit against the same
seeded tensors and (2) the greedy tokens against a single-process engine on cuda:0, and prints the
transfer throughput.

- `collective` (the default): the prefill side is a second process on cuda:1, over NCCL. NCCL
  refuses two ranks on one GPU, so with fewer than two devices the check says it is skipped and
  exits 0.
- `grpc`: the prefill side is a second process on the same GPU (cuda:0), over gRPC on loopback.
- `local`: the prefill engine in this process, on the same GPU, handing the blocks over in memory.

`--cpu` runs the same check with both sides on the CPU (`collective` over Gloo: the path
tests/test_disaggregated.py and tests/test_kv_transport.py cover), to check the script itself.
Several transports, comma-separated, run one after another in this process. `--model` takes a
bfloat16 model folder (default: the tiny preset, written to a temporary folder); `--json FILE` writes
each transport's outcome (passed, failed, or not run and why) into one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.config import CacheConfig, SchedulerConfig, TransferConfig  # noqa: E402
from cluster.engine.request import SamplingParams  # noqa: E402
from cluster.kv.collective import CollectiveGroups  # noqa: E402
from cluster.kv.grpc_transport import CollectiveSender, GrpcSender, serve  # noqa: E402
from cluster.kv.transport import KVSender, LocalSender, TransferState  # noqa: E402
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


def prefill_side(model, sender: KVSender, device: str) -> dict:  # type: ignore[no-untyped-def]
    """Sends the seeded KV, then prefills `PROMPTS` and ships their KV through `sender`."""
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
        raise RuntimeError(f"random transfer failed: {stream.error}")
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
                raise RuntimeError(f"{out.request_id}: {out.transfer.error}")
    return {"first": first, "bytes": nbytes, "seconds": seconds}


def prefill_process(transport: str, target: str, folder: str, device: str) -> NoReturn:
    """The prefill side in its own process: prints its report as one JSON line, then exits."""
    model = load_model(folder, "bfloat16", device)
    if transport == "collective":
        groups = CollectiveGroups(device, timeout_s=60)
        report = prefill_side(model, CollectiveSender(target, groups, timeout_s=60), device)
        groups.close()
    else:
        report = prefill_side(model, GrpcSender(target, timeout_s=60), device)
    print(json.dumps(report), flush=True)
    # Its report is out: exit now, without the interpreter's teardown. Gloo's threads, still joinable
    # when the process group's C++ objects are destroyed at exit, can abort the process there
    # ("terminate called without an active exception"), which would fail a transfer that succeeded.
    os._exit(0)


def devices(transport: str, cpu: bool) -> tuple[str, str] | None:
    """(decode device, prefill device), or None where this machine cannot run the transport."""
    if cpu:
        return "cpu", "cpu"
    if transport == "collective":
        return ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else None
    return "cuda:0", "cuda:0"


def decode_process(transport: str, cpu: bool, folder: str) -> dict:
    """Runs the check for one transport with the model of `folder`; returns its outcome (raises on a mismatch)."""
    placed = devices(transport, cpu)
    if placed is None:
        reason = "the NCCL check needs two CUDA devices (NCCL refuses two ranks on one GPU)"
        print(f"SKIPPED: {reason}")
        return {"status": "not run", "reason": reason, "cuda_devices": torch.cuda.device_count()}
    device, peer_device = placed
    model = load_model(folder, "bfloat16", device)
    engine = Engine(model, NoText(), CACHE, SchedulerConfig())
    intake = KVIntake(engine, model_fingerprint(model, model.arch), timeout_s=60)
    groups = CollectiveGroups(device, timeout_s=60) if transport == "collective" else None
    server, port = (None, 0) if transport == "local" else serve(intake, groups=groups)
    if transport == "local":
        report = prefill_side(load_model(folder, "bfloat16", peer_device), LocalSender(intake), peer_device)
    else:
        peer = subprocess.run(
            [sys.executable, __file__, "--prefill", transport, f"127.0.0.1:{port}", folder, peer_device],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if peer.returncode != 0:
            raise RuntimeError(f"the prefill process failed:\n{peer.stderr}")
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
    if server is not None:
        server.stop(None)
    via = "in memory" if transport == "local" else groups.backend if groups is not None else "grpc"
    if groups is not None:
        groups.close()
    gbps = report["bytes"] / report["seconds"] / 1e9
    mb = report["bytes"] / 1e6
    print(f"OK: {mb:.1f} MB of KV bit-identical over {via} ({gbps:.2f} GB/s with set-up and checksums);")
    print(f"    {len(PROMPTS)} prompts prefilled on {peer_device}, decoded on {device}: the single-process tokens")
    return {"status": "passed", "via": via, "devices": [peer_device, device], "kv_bytes": report["bytes"],
            "GBps": gbps, "prompts": len(PROMPTS), "kv_bit_identical": True,
            "tokens_equal_one_engine": True}  # fmt: skip


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--prefill":
        prefill_process(*sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="both sides on the CPU")
    parser.add_argument("--transport", default="collective", help="collective, grpc or local; several comma-separated")
    parser.add_argument("--model", default=None, help="a bfloat16 model folder (default: the tiny preset, written now)")
    parser.add_argument("--json", default=None, help="also write each transport's outcome to this JSON file")
    args = parser.parse_args()
    transports = args.transport.split(",")
    if unknown := set(transports) - {"collective", "grpc", "local"}:
        parser.error(f"unknown transports {sorted(unknown)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or str(init_model_folder(tmp, "tiny", dtype="bfloat16", seed=0))
        outcomes = {}
        for transport in transports:
            try:
                outcomes[transport] = decode_process(transport, args.cpu, folder)
            except Exception as e:  # the other transports still run; this one is reported failed
                print(f"FAILED ({transport}): {e!r}", file=sys.stderr)
                outcomes[transport] = {"status": "failed", "error": repr(e)[:2000]}
    if args.json is not None:
        Path(args.json).write_text(json.dumps(outcomes, indent=2))
    return 0 if all(o["status"] != "failed" for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
