"""KV transfer: transport throughput against a raw socket, and how much of a transfer layer-wise
shipping hides behind prefill compute.

    .venv/bin/python benchmarks/kv_transfer.py [--quick]

The receiving end runs in a second process (as a decode worker would), started by this script.

1. Throughput over loopback, the same bytes each way, interleaved rounds, medians: the `grpc`
   transport and the `collective` transport (Gloo) into a receiver that accepts every chunk, and a
   raw TCP socket (`sendall` into `recv_into`) as the floor.
2. For 512- and 2048-token prompts on the `smollm-135m` preset (random weights, bfloat16): time from
   the start of the prefill step to the sequence admitted on a decode engine behind the `grpc`
   transport, shipping each layer as it finishes (layer-wise) and after the whole pass, beside the
   prefill pass alone. The share of the transfer hidden is
   (after-pass - layer-wise) / (after-pass - prefill alone).

Both processes share this machine's cores, so on a small CPU box the receiver's work competes with
the prefill compute it is meant to hide behind.

Prints a table and writes `benchmarks/results/kv_transfer.{json,png}`.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.config import CacheConfig, SchedulerConfig, TransferConfig  # noqa: E402
from cluster.engine.request import SamplingParams  # noqa: E402
from cluster.kv.collective import CollectiveGroups  # noqa: E402
from cluster.kv.grpc_transport import CollectiveSender, GrpcSender, serve  # noqa: E402
from cluster.kv.transport import NullReceiver, SendStream, TransferState  # noqa: E402
from cluster.kv.wire import KVHeader, make_chunk, model_fingerprint  # noqa: E402
from cluster.model.builder import init_model_folder  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402
from decode_worker.kv_intake import KVIntake  # noqa: E402
from prefill_worker.engine import PrefillEngine  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
PRESET = "smollm-135m"
MAX_PROMPT = 2048


class AdmitAndDrop:
    """A decode worker's intake that aborts each sequence once admitted, so the cache never fills."""

    def __init__(self, intake: KVIntake) -> None:
        self.intake = intake

    def reserve(self, header):  # type: ignore[no-untyped-def]
        return self.intake.reserve(header)

    def write(self, transfer, chunk) -> None:  # type: ignore[no-untyped-def]
        self.intake.write(transfer, chunk)

    def commit(self, transfer, first_token: int) -> int:  # type: ignore[no-untyped-def]
        n = self.intake.commit(transfer, first_token)
        self.intake.engine.abort(transfer.header.request_id)
        return n

    def fail(self, transfer, error) -> None:  # type: ignore[no-untyped-def]
        self.intake.fail(transfer, error)


class _NoText:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


class _Discard:
    """A sender whose streams drop every message: the prefill pass without a transfer."""

    def open(self, header: KVHeader) -> SendStream:
        return _Null(header)


class _Null(SendStream):
    def _run(self) -> int:
        for _ in self._messages():
            pass
        return 0


def model_folder(tmp: str) -> str:
    """The preset with random weights and a 4096-token context (a 2048-token prompt plus its outputs)."""
    init_model_folder(tmp, PRESET, dtype="bfloat16", seed=0)
    config = Path(tmp) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 4096}))
    return tmp


def cache_for(prompt_len: int) -> CacheConfig:
    return CacheConfig(block_size=16, num_blocks=prompt_len // 16 + 8, watermark=0.0, enable_prefix_caching=False)


# -- the receiving process -----------------------------------------------------------------------


def serve_receivers(threads: int) -> None:
    """Runs in the second process: a sink (gRPC + collective), a raw-socket drain, and a decode
    engine's intake; prints their ports as one JSON line, then serves until stdin closes."""
    torch.set_num_threads(threads)
    groups = CollectiveGroups("cpu", timeout_s=120)
    sink_server, sink_port = serve(NullReceiver(), groups=groups)
    drain = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_drain_forever, args=(drain,), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(model_folder(tmp), "bfloat16")
    decode = Engine(model, _NoText(), cache_for(MAX_PROMPT), SchedulerConfig(max_num_batched_tokens=MAX_PROMPT))
    intake = KVIntake(decode, model_fingerprint(model, model.arch), timeout_s=120)
    engine_server, engine_port = serve(AdmitAndDrop(intake))
    ports = {"sink": sink_port, "socket": drain.getsockname()[1], "engine": engine_port}
    print(json.dumps(ports), flush=True)
    sys.stdin.read()
    sink_server.stop(None)
    engine_server.stop(None)
    groups.close()


def _drain_forever(server: socket.socket) -> None:
    buffer = bytearray(4 << 20)
    while True:
        conn, _ = server.accept()
        total = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
        got = 0
        while got < total:
            n = conn.recv_into(buffer)
            if n == 0:
                break
            got += n
        conn.sendall(b"k")
        conn.close()


# -- measurements --------------------------------------------------------------------------------


def sink_header(tokens: int, layers: int, request_id: str) -> KVHeader:
    return KVHeader(request_id, b"fp", "bfloat16", layers, 8, 64, 16, tuple([1] * tokens), SamplingParams())


def time_transport(sender, chunks, header) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    stream = sender.open(header)
    for chunk in chunks:
        stream.send(chunk)
    stream.commit(0)
    assert stream.wait(120) is TransferState.DONE, stream.error
    return time.perf_counter() - start


def time_socket(port: int, payloads: list[memoryview]) -> float:
    total = sum(len(p) for p in payloads)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(total.to_bytes(8, "little"))
        for p in payloads:
            s.sendall(p)
        s.recv(1)
    return time.perf_counter() - start


def throughput(ports: dict, rounds: int, layers: int, tokens: int) -> dict:
    g = torch.Generator().manual_seed(0)
    shape = (1, tokens, 8, 64)
    chunks = [
        make_chunk(i, torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
        for i in range(layers)
    ]
    nbytes = sum(c.nbytes for c in chunks)
    payloads = [memoryview(t.view(-1).view(torch.uint8).numpy()) for c in chunks for t in (c.key, c.value)]
    target = f"127.0.0.1:{ports['sink']}"
    grpc_sender = GrpcSender(target, timeout_s=120)
    groups = CollectiveGroups("cpu", timeout_s=120)
    collective = CollectiveSender(target, groups, timeout_s=120)
    time_transport(collective, chunks[:1], sink_header(tokens, layers, "warm"))  # rendezvous outside the clock
    times: dict[str, list[float]] = {"socket": [], "grpc": [], "collective": []}
    for r in range(rounds):
        times["socket"].append(time_socket(ports["socket"], payloads))
        times["grpc"].append(time_transport(grpc_sender, chunks, sink_header(tokens, layers, f"g{r}")))
        times["collective"].append(time_transport(collective, chunks, sink_header(tokens, layers, f"c{r}")))
    grpc_sender.close()
    collective.close()
    groups.close()
    result: dict = {"bytes": nbytes, "rounds": rounds}
    for name, ts in times.items():
        med = statistics.median(ts)
        result[name] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "gb_per_s": nbytes / med / 1e9}
    for name in ("grpc", "collective"):
        result[name]["vs_socket"] = result[name]["gb_per_s"] / result["socket"]["gb_per_s"]
    return result


def times_to_admitted(shipping, vocab_size: int, prompt_len: int, rounds: int) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """For each mode's (prefill engine, sender): the seconds from a fresh random prompt's arrival
    to its KV admitted at the receiver, in `rounds` rounds taking the modes in turn (after one
    warm-up round, not counted)."""
    times: dict[str, list[float]] = {mode: [] for mode in shipping}
    g = torch.Generator().manual_seed(prompt_len)
    n = 0
    for r in range(rounds + 1):
        for mode, (engine, sender) in shipping.items():
            prompt = torch.randint(3, vocab_size, (prompt_len,), generator=g).tolist()
            n += 1
            start = time.perf_counter()
            engine.add_request(f"p{n}", prompt, SamplingParams(max_tokens=2), sender)
            (out,) = engine.step()
            assert out.transfer.wait(120) is TransferState.DONE, out.transfer.error
            elapsed = time.perf_counter() - start
            engine.poll_leases()
            if r:
                times[mode].append(elapsed)
    return times


def prefill_to_admitted(model, port: int, prompt_len: int, rounds: int) -> dict:  # type: ignore[no-untyped-def]
    cache = cache_for(prompt_len)
    budget = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=prompt_len)
    sender = GrpcSender(f"127.0.0.1:{port}", timeout_s=120)
    modes = ("prefill alone", "layerwise", "after-pass")
    engines = {
        mode: PrefillEngine(model, cache, budget, TransferConfig(layerwise=mode == "layerwise"), cache.num_blocks)
        for mode in modes
    }
    shipping = {mode: (engines[mode], _Discard() if mode == modes[0] else sender) for mode in modes}
    times = times_to_admitted(shipping, model.arch.vocab_size, prompt_len, rounds)
    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    sender.close()
    transfer = med["after-pass"] - med["prefill alone"]
    hidden = (med["after-pass"] - med["layerwise"]) / transfer if transfer > 0 else float("nan")
    arch = model.arch
    kv_bytes = 2 * arch.num_layers * prompt_len * arch.num_kv_heads * arch.head_dim * 2
    return {"prompt_tokens": prompt_len, "kv_bytes": kv_bytes, "median_s": med, "times_s": times, "hidden": hidden}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["socket", "grpc", "collective"]
    a.bar(names, [results["throughput"][n]["gb_per_s"] for n in names], color=["grey", "tab:blue", "tab:orange"])
    a.set_ylabel("GB/s over loopback")
    a.set_title("transport throughput (same bytes)")
    modes = ["prefill alone", "layerwise", "after-pass"]
    width = 0.25
    for i, mode in enumerate(modes):
        xs = [j + (i - 1) * width for j in range(len(results["prefill"]))]
        b.bar(xs, [r["median_s"][mode] * 1e3 for r in results["prefill"]], width, label=mode)
    b.set_xticks(range(len(results["prefill"])), [f"{r['prompt_tokens']} tokens" for r in results["prefill"]])
    b.set_ylabel("ms from prefill start to KV admitted")
    b.set_title(f"{PRESET} bf16, grpc transport")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results: dict) -> None:
    t = results["throughput"]
    print(f"transport throughput, {t['bytes'] / 1e6:.0f} MB per transfer, {t['rounds']} rounds (median):")
    print(f"{'transport':<12}{'GB/s':>8}{'vs socket':>11}")
    for name in ("socket", "grpc", "collective"):
        print(f"{name:<12}{t[name]['gb_per_s']:>8.2f}{t[name].get('vs_socket', 1.0):>10.0%}")
    print("\nprefill start -> KV admitted on the decode side (grpc, median ms):")
    print(f"{'prompt':>7}{'KV MB':>8}{'prefill alone':>15}{'layerwise':>11}{'after-pass':>12}{'hidden':>8}")
    for r in results["prefill"]:
        m = r["median_s"]
        print(
            f"{r['prompt_tokens']:>7}{r['kv_bytes'] / 1e6:>8.1f}{m['prefill alone'] * 1e3:>15.1f}"
            f"{m['layerwise'] * 1e3:>11.1f}{m['after-pass'] * 1e3:>12.1f}{r['hidden']:>8.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and only the 512-token prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each process")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the receiving process
    args = parser.parse_args()
    if args.serve:
        serve_receivers(args.threads)
        return
    torch.set_num_threads(args.threads)
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--threads", str(args.threads)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        ports = json.loads(receiver.stdout.readline())  # type: ignore[union-attr]
        rounds = 3 if args.quick else 7
        results: dict = {"threads_per_process": args.threads, "preset": PRESET}
        results["throughput"] = throughput(ports, rounds, layers=30, tokens=MAX_PROMPT)
        with tempfile.TemporaryDirectory() as tmp:
            model = load_model(model_folder(tmp), "bfloat16")
        lengths = [512] if args.quick else [512, MAX_PROMPT]
        results["prefill"] = [prefill_to_admitted(model, ports["engine"], n, 3 if args.quick else 5) for n in lengths]
    finally:
        receiver.stdin.close()  # type: ignore[union-attr]
        receiver.wait(30)
    report(results)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kv_transfer.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "kv_transfer.png")
    print(f"\nwrote {OUT / 'kv_transfer.json'} and {OUT / 'kv_transfer.png'}")


if __name__ == "__main__":
    main()
