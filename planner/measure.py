"""`tandem profile`: this machine's costs for the configured model, dtype and transport.

For each torch thread count asked for, on the config's model (random inputs, greedy, no EOS):

- prefill: one pass of a prompt chunk of `n` new tokens on `c` cached prefix tokens (the prefix
  cache holds them from an earlier request), for a grid of (n, c), median of a few passes;
- decode: a step of `B` decode rows at context `L`, for a grid of (B, L), median over steps; and
  the same through the compiled graphs when the config has `compile_buckets`;
- KV transfer: `grpc` (a loopback `KVTransfer.Push` into a receiver that keeps nothing) and
  `local` (copying the tensors) for the model's KV shape at a few token counts;
- router: the in-process work per request (parse, placement) and per token (a response message
  encoded and decoded twice), plus two gRPC calls' set-up per request (from the transfer's fit).

Each grid is fitted to `planner.profile`'s formulas by non-negative least squares; the raw points
go into the profile beside the fit, with the fit's error. A progress bar counts the points; the
default grid takes a few minutes on two cores, `quick` well under one.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from cluster.config import CacheConfig, ClusterConfig, SchedulerConfig
from cluster.engine.request import SamplingParams
from cluster.model.gguf import model_folder
from cluster.model.loader import load_model
from decode_worker.engine import Engine
from planner.profile import DecodeCost, LinearCost, PrefillCost, Profile, StepCosts, fit_linear


class _NoText:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def grids(quick: bool) -> dict[str, Any]:
    if quick:
        return {"prefill": [(64, 0), (256, 0), (256, 256), (512, 0)], "decode": [(1, 64), (8, 64), (8, 512), (32, 64)]}
    prefill = [(n, c) for n in (32, 128, 512, 1024) for c in (0, 512)]
    decode = [(b, ctx) for b in (1, 4, 16, 32) for ctx in (64, 512)]
    return {"prefill": prefill, "decode": decode}


def profile(config: ClusterConfig, threads: list[int], quick: bool = False) -> Profile:
    m = config.model
    model = load_model(
        model_folder(m.path),
        m.dtype,
        m.device,
        m.weight_dtype,
        m.weight_group_size,
        m.quantize_lm_head,
        m.prepack_weights,
    )
    arch = model.arch
    grid = grids(quick)
    buckets = tuple(sorted(m.compile_buckets)) if not quick else ()
    n_points = len(threads) * (len(grid["prefill"]) + len(grid["decode"]) * (2 if buckets else 1)) + 8
    points: dict[str, Any] = {}
    costs = {}
    with tqdm(total=n_points, desc="profiling", unit="point") as bar:
        for t in threads:
            torch.set_num_threads(t)
            engine = _engine(model, config, ())
            pre = _prefill_points(engine, arch.vocab_size, grid["prefill"], 2 if quick else 3, bar)
            dec = _decode_points(engine, arch.vocab_size, grid["decode"], 6 if quick else 10, bar)
            compiled = None
            if buckets:
                cengine = _engine(model, config, buckets)
                cengine.warm_up()
                cdec = _decode_points(cengine, arch.vocab_size, grid["decode"], 10, bar)
                compiled = _fit_decode(cdec, buckets)
                points[f"decode_compiled_{t}"] = cdec
            points[f"prefill_{t}"], points[f"decode_{t}"] = pre, dec
            costs[t] = StepCosts(_fit_prefill(pre), _fit_decode(dec), compiled)
        torch.set_num_threads(max(threads))
        dtype_bytes = 2 if m.dtype == "bfloat16" else 4
        kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes
        transfer, points["transfer"] = _transfer(arch, dtype_bytes, kv_bytes_per_token, quick, bar)
        router = _router(transfer["grpc"].base_s, bar)
        tiers, points["tiers"] = _tiers(config, config.cache.block_size * kv_bytes_per_token, quick)
    return Profile(
        costs=costs,
        transfer=transfer,
        router=router,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size=config.cache.block_size,
        model=str(m.path),
        dtype=m.dtype,
        machine=f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        points=points,
        tiers=tiers,
    )


def _engine(model, config: ClusterConfig, buckets: tuple[int, ...]) -> Engine:  # type: ignore[no-untyped-def]
    cache = CacheConfig(block_size=config.cache.block_size, num_blocks=2048, watermark=0.0)
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, long_prefill_chunk=4096)
    return Engine(model, _NoText(), cache, sched, (), None, seed=0, compile_buckets=buckets)  # type: ignore[arg-type]


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _prefill_points(engine: Engine, vocab: int, grid: list, repeats: int, bar: tqdm) -> list[list[float]]:
    """[[new tokens, cached tokens, seconds], ...]: one pass of one prompt chunk."""
    rng, out, ids = random.Random(0), [], iter(range(10**9))
    for n, cached in grid:
        times = []
        prefix = _tokens(rng, vocab, cached)
        if cached:
            _drain(engine, [(f"warm{next(ids)}", prefix + _tokens(rng, vocab, 16), 1)])
        for _ in range(repeats + 1):
            engine.add_request(f"p{next(ids)}", prefix + _tokens(rng, vocab, n), _params(1))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            _drain(engine, [])
        out.append([n, cached, statistics.median(times[1:])])  # the first pass warms this shape up
        bar.update()
    return out


def _decode_points(engine: Engine, vocab: int, grid: list, steps: int, bar: tqdm) -> list[list[float]]:
    """[[rows, mean context, seconds], ...]: one step of decode rows alone."""
    rng, out = random.Random(1), []
    for b, ctx in grid:
        for i in range(b):
            engine.add_request(f"d{b}-{ctx}-{i}", _tokens(rng, vocab, ctx), _params(steps + 8))
        while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        out.append([b, ctx + steps / 2, statistics.median(times[1:])])
        for r in list(engine.scheduler.running):
            engine.abort(r.request_id)
        bar.update()
    return out


def _drain(engine: Engine, requests: list) -> None:
    for rid, prompt, n in requests:
        engine.add_request(rid, prompt, _params(n))
    while engine.has_unfinished:
        engine.step()


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _fit_prefill(points: list[list[float]]) -> PrefillCost:
    rows = [[1.0, n, n * (c + n / 2)] for n, c, _ in points]
    base, token, attn = fit_linear(rows, [t for *_, t in points])
    return PrefillCost(base, token, attn)


def _fit_decode(points: list[list[float]], buckets: tuple[int, ...] = ()) -> DecodeCost:
    rows = [[1.0, b, b * ctx] for b, ctx, _ in points]
    base, row, ctx = fit_linear(rows, [t for *_, t in points])
    return DecodeCost(base, row, ctx, buckets)


def _transfer(arch, dtype_bytes: int, per_token: int, quick: bool, bar: tqdm) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    from cluster.kv.grpc_transport import GrpcSender, serve
    from cluster.kv.transport import NullReceiver, TransferState
    from cluster.kv.wire import KVHeader, make_chunk

    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    server, port = serve(NullReceiver())
    sender = GrpcSender(f"127.0.0.1:{port}", timeout_s=120)
    raw: dict[str, list] = {"grpc": [], "local": []}
    try:
        for tokens in (16, 256, 1024) if quick else (16, 128, 512, 2048):
            shape = (1, tokens, arch.num_kv_heads, arch.head_dim)
            chunks = [
                make_chunk(i, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
                for i in range(arch.num_layers)
            ]
            header = KVHeader("t", b"fp", "bfloat16" if dtype_bytes == 2 else "float32", arch.num_layers,
                              arch.num_kv_heads, arch.head_dim, 16, tuple([1] * tokens), SamplingParams())  # fmt: skip
            grpc_t, local_t = [], []
            for _ in range(3 if quick else 5):
                start = time.perf_counter()
                stream = sender.open(header)
                for c in chunks:
                    stream.send(c)
                stream.commit(0)
                assert stream.wait(120) is TransferState.DONE, stream.error
                grpc_t.append(time.perf_counter() - start)
                start = time.perf_counter()
                _ = [(c.key.clone(), c.value.clone()) for c in chunks]
                local_t.append(time.perf_counter() - start)
            raw["grpc"].append([tokens * per_token, statistics.median(grpc_t)])
            raw["local"].append([tokens * per_token, statistics.median(local_t)])
            bar.update()
    finally:
        sender.close()
        server.stop(0)
    fits = {}
    for name, pts in raw.items():
        base, per = fit_linear([[1.0, b] for b, _ in pts], [t for _, t in pts])
        fits[name] = LinearCost(base, per)
    return fits, raw


def _tiers(config: ClusterConfig, block_bytes: int, quick: bool) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """Each KV tier `cache.tiers` names: how long a load of a run of blocks takes, by the bytes it
    reads (runs of 1, 8 and 32 blocks of this model's size, written first, then read back whole)."""
    from cluster.kv.tiering import open_stores
    from cluster.kv.tiers import Tiers

    if not config.cache.tiers.enabled:
        return {}, {}
    secret = config.auth.secret
    kv = torch.empty(1, 1, 1, 1, dtype=torch.uint8)  # the host tier profiled without its int8 codec
    rng = random.Random(0)
    raw: dict[str, list] = {}
    for store in open_stores(config.cache.tiers, secret, kv):
        tiers = Tiers([store], secret.encode(), b"profile")
        for run in (1, 8) if quick else (1, 8, 32):
            names = [rng.randbytes(16) for _ in range(run)]
            for name in names:
                tiers.offer(name, rng.randbytes(block_bytes))
            if not tiers.flush(60) or tiers.stats[store.kind].failures:
                raise RuntimeError(f"the {store.kind} KV tier failed while profiled; is it reachable?")
            times = []
            for _ in range(2 if quick else 3):
                start = time.perf_counter()
                loaded = tiers.fetch(names).result(60)
                times.append(time.perf_counter() - start)
                assert len(loaded.payloads) == run, f"the {store.kind} tier lost blocks while profiled"
            raw.setdefault(store.kind, []).append([run * block_bytes, statistics.median(times)])
        tiers.close()
    fits = {}
    for kind, pts in raw.items():
        base, per = fit_linear([[1.0, b] for b, _ in pts], [t for _, t in pts])
        fits[kind] = LinearCost(base, per)
    return fits, raw


def _router(grpc_call_s: float, bar: tqdm) -> LinearCost:
    from tandem.v1 import api_pb2, worker_pb2

    from router.placement import placement

    loads = {
        "decode-0": worker_pb2.WorkerLoad(role="decode", free_kv_blocks=500, total_kv_blocks=1000),
        "prefill-0": worker_pb2.WorkerLoad(role="prefill"),
    }
    wire = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=list(range(256)))).SerializeToString()
    message = api_pb2.GenerateResponse(request_id="r", token_ids=[7], text="ab").SerializeToString()
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        request = api_pb2.GenerateRequest.FromString(wire)
        placement.choose(list(request.token_ids.ids), 64, loads, 16, 64)
    per_request = (time.perf_counter() - start) / n + 2 * grpc_call_s
    start = time.perf_counter()
    for _ in range(n):
        api_pb2.GenerateResponse.FromString(api_pb2.GenerateResponse.FromString(message).SerializeToString())
    per_token = 2 * (time.perf_counter() - start) / n
    bar.update(bar.total - bar.n)
    return LinearCost(per_request, per_token)


def describe(profile: Profile) -> str:
    lines = [f"profile of {profile.model} ({profile.dtype}) on {profile.machine}"]
    for t, c in sorted(profile.costs.items()):
        p, d = c.prefill, c.decode
        lines.append(
            f"  {t} thread(s): prefill {p.base_s * 1e3:.2f} ms + {p.token_s * 1e6:.1f} us/token"
            f" + {p.attn_s * 1e9:.2f} ns/token/context; decode {d.base_s * 1e3:.2f} ms + {d.row_s * 1e3:.3f} ms/row"
            f" + {d.ctx_s * 1e9:.1f} ns/row/context"
        )
    for name, cost in sorted(profile.transfer.items()):
        lines.append(f"  transfer {name}: {cost.base_s * 1e3:.2f} ms + {1 / max(cost.per_s, 1e-15) / 1e9:.2f} GB/s")
    lines.append(f"  router: {profile.router.base_s * 1e3:.3f} ms/request + {profile.router.per_s * 1e6:.1f} us/token")
    return "\n".join(lines)
