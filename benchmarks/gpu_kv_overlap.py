"""Step 4 of the GPU check: layer-wise KV shipping with the copies on their own CUDA stream, and how
much of the transfer it hides behind the prefill pass.

    python benchmarks/gpu_kv_overlap.py --model DIR --result FILE [--dry-run]

A receiving process (a decode engine behind the `grpc` transport's KV intake, on the same GPU,
admitting then dropping each sequence) is started first. For each prompt length, interleaved
rounds, medians, each mode timed from the start of the prefill step to the sequence admitted on
the receiving side:

- `pass alone`: the prefill step with nothing shipped;
- `after pass`: every layer shipped once the pass is done (the engine with `layerwise` off);
- `engine hook`: the engine's own layer-wise shipping, which gathers each layer and copies it to
  the host on the compute stream as the layer finishes;
- `two streams`: `StreamedPrefillEngine` below: the pass stays on the compute stream; at each
  layer's end an event hands the layer to a copy stream, which gathers its rows into pinned host
  memory; a thread waits for each copy, checksums it and sends it over gRPC;
- the last two again into a sender that drops every chunk (`no network`): the copies alone.

The share hidden is (after pass - mode) / (after pass - pass alone), with the network or without.
`--dry-run` runs the same code on the CPU with tiny shapes (no streams there: the copies run inline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kv_transfer import AdmitAndDrop, _Discard, times_to_admitted  # noqa: E402

from cluster.config import CacheConfig, SchedulerConfig, TransferConfig  # noqa: E402
from cluster.engine.request import ScheduledChunk  # noqa: E402
from cluster.kv.grpc_transport import GrpcSender, serve  # noqa: E402
from cluster.kv.wire import make_chunk, model_fingerprint  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402
from decode_worker.kv_intake import KVIntake  # noqa: E402
from prefill_worker.engine import PrefillEngine  # noqa: E402

MODES = ("pass alone", "after pass", "engine hook", "two streams", "after pass, no network", "two streams, no network")


class StreamedPrefillEngine(PrefillEngine):
    """The prefill engine with its per-layer hook replaced: copies on a side stream, sends on a thread."""

    def _shipper(self, finishing: list[ScheduledChunk]) -> Callable[[int], None]:
        per_chunk, num_layers = self.transfer.layers_per_chunk, self.model.arch.num_layers
        device = self.runner.device
        cuda = device.type == "cuda"
        copies = torch.cuda.Stream(device) if cuda else None
        tables = [torch.tensor(c.block_table, dtype=torch.long, device=device) for c in finishing]
        pending: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        sender = threading.Thread(target=_send_copies, args=(pending, errors), daemon=True)
        sender.start()

        def ship(layer: int) -> None:
            if (layer + 1) % per_chunk and layer != num_layers - 1:
                return
            first = layer - (layer % per_chunk)
            if copies is not None:
                copies.wait_stream(torch.cuda.current_stream(device))  # the layers' KV is written
            for c, table in zip(finishing, tables, strict=True):
                n, skip = c.request.num_tokens, self._jobs[c.request.request_id].skip
                with torch.cuda.stream(copies) if copies is not None else contextlib.nullcontext():
                    parts = [self.runner.kv_cache[i] for i in range(first, layer + 1)]
                    keys = torch.stack([k[table].flatten(0, 1)[skip:n] for k, _ in parts])  # [L, n - skip, h, d]
                    values = torch.stack([v[table].flatten(0, 1)[skip:n] for _, v in parts])
                    host = [torch.empty(keys.shape, dtype=keys.dtype, pin_memory=cuda) for _ in range(2)]
                    host[0].copy_(keys, non_blocking=cuda)
                    host[1].copy_(values, non_blocking=cuda)
                    done = torch.cuda.Event() if cuda else None
                    if done is not None:
                        done.record(copies)
                # keys and values ride along: their memory must outlive the copies
                pending.put((done, first, host, self._jobs[c.request.request_id].stream, (keys, values)))
            if layer == num_layers - 1:
                pending.put(None)
                sender.join()
                if errors:
                    raise errors[0]

        return ship


def _send_copies(pending: queue.Queue, errors: list[BaseException]) -> None:
    while (item := pending.get()) is not None:
        done, first, (keys, values), stream, _ = item
        try:
            if done is not None:
                done.synchronize()
            stream.send(make_chunk(first, keys, values))
        except BaseException as e:  # reported by the hook's last call, on the engine's thread
            errors.append(e)


class _NoShipEngine(PrefillEngine):
    def _shipper(self, finishing: list[ScheduledChunk]) -> Callable[[int], None]:
        return lambda layer: None


class _NoText:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def cache_for(prompt_len: int) -> CacheConfig:
    return CacheConfig(block_size=16, num_blocks=prompt_len // 16 + 8, watermark=0.0, enable_prefix_caching=False)


def serve_receiver(folder: str, device: str, max_prompt: int) -> None:
    """The receiving process: prints its port as one line, then serves until stdin closes."""
    model = load_model(folder, "bfloat16", device)
    decode = Engine(model, _NoText(), cache_for(max_prompt), SchedulerConfig(max_num_batched_tokens=max_prompt))
    server, port = serve(AdmitAndDrop(KVIntake(decode, model_fingerprint(model, model.arch), timeout_s=120)))
    print(port, flush=True)
    sys.stdin.read()
    server.stop(None)


def engines(model, prompt_len: int) -> dict[str, tuple[PrefillEngine, bool]]:  # type: ignore[no-untyped-def]
    """Each mode's engine, and whether it ships over the network."""
    cache = cache_for(prompt_len)
    budget = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=prompt_len)

    def make(kind: type[PrefillEngine], layerwise: bool) -> PrefillEngine:
        return kind(model, cache, budget, TransferConfig(layerwise=layerwise), cache.num_blocks)

    return {
        "pass alone": (make(_NoShipEngine, True), False),
        "after pass": (make(PrefillEngine, False), True),
        "engine hook": (make(PrefillEngine, True), True),
        "two streams": (make(StreamedPrefillEngine, True), True),
        "after pass, no network": (make(PrefillEngine, False), False),
        "two streams, no network": (make(StreamedPrefillEngine, True), False),
    }


def overlap(model, port: int, prompt_len: int, rounds: int) -> dict:  # type: ignore[no-untyped-def]
    sender = GrpcSender(f"127.0.0.1:{port}", timeout_s=120)
    by_mode = engines(model, prompt_len)
    shipping = {mode: (by_mode[mode][0], sender if by_mode[mode][1] else _Discard()) for mode in MODES}
    times = times_to_admitted(shipping, model.arch.vocab_size, prompt_len, rounds)
    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    sender.close()

    def hidden(mode: str, after: str) -> float:
        transfer = med[after] - med["pass alone"]
        return (med[after] - med[mode]) / transfer if transfer > 0 else float("nan")

    arch = model.arch
    kv_bytes = 2 * arch.num_layers * prompt_len * arch.num_kv_heads * arch.head_dim * 2
    shares = {
        "engine hook": hidden("engine hook", "after pass"),
        "two streams": hidden("two streams", "after pass"),
        "two streams, no network": hidden("two streams, no network", "after pass, no network"),
    }
    result = {"prompt_tokens": prompt_len, "kv_bytes": kv_bytes, "median_s": med, "times_s": times, "hidden": shares}
    print(f"{prompt_len:>7}{kv_bytes / 1e6:>9.1f}" + "".join(f"{med[m] * 1e3:>13.2f}" for m in MODES)
          + "".join(f"{h:>9.0%}" for h in shares.values()), flush=True)  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder")
    parser.add_argument("--result", help="where the JSON goes")
    parser.add_argument("--dry-run", action="store_true", help="the CPU and tiny shapes")
    parser.add_argument("--serve", nargs=3, metavar=("FOLDER", "DEVICE", "MAX_PROMPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1 if args.dry_run else 8)
    if args.serve:
        serve_receiver(args.serve[0], args.serve[1], int(args.serve[2]))
        return
    device = "cpu" if args.dry_run else "cuda"
    lengths, rounds = ((32, 64), 2) if args.dry_run else ((2048, 8192), 5)
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--model", args.model, "--serve", args.model, device, str(max(lengths))]
        + (["--dry-run"] if args.dry_run else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(receiver.stdout.readline())  # type: ignore[union-attr]
        model = load_model(args.model, "bfloat16", device)
        print(f"prefill start -> KV admitted on the receiving side ({device}, grpc over loopback, median ms)")
        print(f"{'prompt':>7}{'KV MB':>9}" + "".join(f"{m[:12]:>13}" for m in MODES) + f"{'hook':>9}{'2 str':>9}"
              f"{'2s copy':>9}")  # fmt: skip
        rows = [overlap(model, port, n, rounds) for n in lengths]
    finally:
        receiver.stdin.close()  # type: ignore[union-attr]
        receiver.wait(60)
    result = {"device": device, "modes": list(MODES), "rows": rows, "goal_hidden": 0.7}
    if args.result:
        Path(args.result).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
