"""A GPU-shaped engine behind the real serving path: can the decode worker's front and the router keep
up with an engine whose step costs the CPU nothing?

    .venv/bin/python benchmarks/gpu_shaped.py [--batch 256] [--step-ms 10] [--tokens 64] [--paths ...]

The engine core is a stand-in (`StandInEngine`): each step sleeps `--step-ms` (as a GPU step leaves the
CPU free) and gives every running request its next token, up to `--batch` requests at once, each
`--tokens` long. It runs as a real engine core does: in a process of its own under the real
`EngineLoop`, one `Frame` per step to the real decode worker's front (`decode_worker.service`, in
this process), which detokenises and streams every request. Two client processes keep `--batch`
requests in flight (closed loop), by one of these paths (`--paths`, one row each):

    front submit   straight to the worker, a `Worker.Submit` call per request (a message per token)
    front steps    straight to the worker, each client one `Worker.Steps` stream (a frame per step)
    routers N      through N real router processes (`tandem bench`'s async client, the SDK)
    routers N interval K   the same, the routers sending a client message per K tokens (`stream_interval`)

Each stream's first request is shortened by its place (`gpu_shaped_clients.staggered`), so requests
end a few a step, as in a served cluster. By default the engine core has the first CPU to itself and
every other process shares the rest (`--no-pin`: all share all), as a GPU server gives its engine core
a core of its own.

Per row: the engine's steps/s against its ideal (1 / step time), over the whole run (its ramp up and
down included) and sustained (the middle 60 % of it), the mean batch, the output tokens/s the clients
received against the ideal (batch / step time), and each process's CPU per engine step: the engine
core (all outside the model, which costs nothing here), the worker's front, the routers, the
clients. Goals (the serving-path issue): ≥ 0.95 of the ideal steps/s at batch 256; the core ≤ 1 ms
and the front ≤ 5 ms of CPU per step. The row also says how many cores were busy. Prints a table,
writes `benchmarks/results/gpu_shaped.{json,png}` (`gpu_shaped_avx2.*` on a CPU without AVX-512).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_shaped_clients import run_clients, run_front_clients  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "models" / "tandem-demo-code"


class StandInEngine:
    """The decode engine's face to `EngineLoop` with no model behind it: a step sleeps `step_s` and
    gives each running request one token (cycling through `tokens`, real text of the model's
    vocabulary, so the front detokenises what a real engine would send). Local prefill only: the
    prompt costs nothing, and a KV transfer is refused."""

    def __init__(self, step_s: float, max_num_seqs: int, tokens: list[int], total_blocks: int) -> None:
        from cluster.engine.changes import Changes, Occupancy
        from cluster.engine.kv_events import KVJournal

        self.step_s, self.max_num_seqs, self.tokens = step_s, max_num_seqs, tokens
        self.changes, self.kv_journal = Changes(), KVJournal()
        self.total_blocks = total_blocks
        self.occupancy = Occupancy(free_blocks=total_blocks, total_blocks=total_blocks)
        self.waiting: collections.deque[tuple[str, int, int]] = collections.deque()  # (id, prompt length, max tokens)
        self.running: dict[str, list[int]] = {}  # id -> [tokens made, max tokens, prompt length]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request_id, prompt_token_ids, params, output_token_ids=()) -> None:  # type: ignore[no-untyped-def]
        self.waiting.append((request_id, len(prompt_token_ids), params.max_tokens - len(output_token_ids)))
        self._publish()

    def abort(self, request_id: str) -> bool:
        found = self.running.pop(request_id, None) is not None
        for entry in [e for e in self.waiting if e[0] == request_id]:
            self.waiting.remove(entry)
            found = True
        self._publish()
        return found

    def reserve(self, *args):  # type: ignore[no-untyped-def]
        raise ValueError("the stand-in engine prefills locally only")

    release = admit = reserve

    def step(self):  # type: ignore[no-untyped-def]
        from decode_worker.text import RequestOutput

        while self.waiting and len(self.running) < self.max_num_seqs:
            rid, prompt, max_tokens = self.waiting.popleft()
            self.running[rid] = [0, max_tokens, prompt]
        time.sleep(self.step_s)
        outputs = []
        for rid, state in list(self.running.items()):
            state[0] += 1
            done = state[0] >= state[1]
            token = self.tokens[(state[0] + len(rid)) % len(self.tokens)]
            outputs.append(
                RequestOutput(rid, [token], finished=done, finish_reason="length" if done else None,
                              num_prompt_tokens=state[2], num_output_tokens=state[0], num_passes=state[0])
            )  # fmt: skip
            if done:
                del self.running[rid]
        self._publish()
        return outputs

    def _publish(self) -> None:
        from cluster.engine.changes import Occupancy

        used = min(len(self.running), self.total_blocks)
        self.occupancy = Occupancy(len(self.running), len(self.waiting), 0, self.total_blocks - used, self.total_blocks)
        self.changes.bump()


def stand_in_main(commands, events, config_json: str, step_s: float = 0.01) -> None:  # type: ignore[no-untyped-def]
    """The stand-in engine core's process: `decode_worker.engine_loop.core_main` with no model."""
    import torch

    from cluster.config import ClusterConfig
    from cluster.engine.core_process import say_hello
    from cluster.model.arch import ModelArch
    from cluster.model.tokenizer import Tokenizer
    from decode_worker.engine_loop import CoreInfo, EngineLoop

    config = ClusterConfig.model_validate_json(config_json)
    arch = ModelArch.from_folder(config.model.path)
    tokens = Tokenizer(config.model.path).encode(Path(__file__).read_text())
    engine = StandInEngine(step_s, config.scheduler.max_num_seqs, tokens, config.cache.num_blocks)
    shape = (1, config.cache.block_size, arch.num_kv_heads, arch.head_dim)  # no transfer lands: one block a layer
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
    say_hello(events, CoreInfo(arch, config.cache.block_size, kv, b"stand-in", engine.occupancy))
    EngineLoop(engine, commands, events).run()


def bench_config(batch: int):  # type: ignore[no-untyped-def]
    from cluster.config import parse_config

    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 4096},
            "scheduler": {"max_num_seqs": batch, "max_waiting": 4 * batch},
            "router": {"max_queued_requests": 4 * batch, "local_prefill_max_tokens": 1 << 20},
        }
    )


def serve_router(config_json: str, decode_address: str, conn) -> None:  # type: ignore[no-untyped-def]
    """A router process in front of the one decode worker; sends its address, serves until told."""
    from cluster.config import ClusterConfig
    from router.service.server import from_config

    router = from_config(ClusterConfig.model_validate_json(config_json), lambda: {"decode-0": decode_address})
    conn.send(router.start())
    conn.recv()
    router.stop()


def start_routers(ctx, config, decode_address: str, n: int) -> tuple[list, list[str]]:  # type: ignore[no-untyped-def]
    """`n` router processes in front of the decode worker: (process, pipe) each, and their addresses."""
    procs, targets = [], []
    for _ in range(n):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=serve_router, args=(config.model_dump_json(), decode_address, theirs))
        proc.start()
        targets.append(mine.recv())
        procs.append((proc, mine))
    return procs, targets


def start_clients(ctx, worker, targets: list[str], how: str, n: int, args: argparse.Namespace) -> list:  # type: ignore[no-untyped-def]
    """Two client processes, `args.batch` streams in all, `n` requests each: through the routers at
    `targets`, or (none) straight to the worker by `how` ("submit" or "steps")."""
    started = []
    for i in range(2):
        mine, theirs = ctx.Pipe()
        if targets:
            client = (run_clients, (targets[i % len(targets)], n, args.batch // 2, args.tokens, theirs))
        else:
            client = (run_front_clients, (worker.server.address, how, n, args.batch // 2, args.tokens, theirs))
        proc = ctx.Process(target=client[0], args=client[1])
        proc.start()
        started.append((proc, mine))
    return started


def go(clients: list, mark=None) -> list[dict]:  # type: ignore[no-untyped-def]
    """Starts the clients together once all are ready and collects their reports; `mark("before")` runs
    just before they start, `mark("after")` once they all reported (while they still live)."""
    for _, mine in clients:
        assert mine.recv() == "ready"  # their imports are not serving
    if mark is not None:
        mark("before")
    for _, mine in clients:
        mine.send("go")
    reports = [mine.recv() for _, mine in clients]
    if mark is not None:
        mark("after")
    for proc, _ in clients:
        proc.join()
    return reports


def measure(worker, config, path: str, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """One row: `path` is "routers N" (clients through N router processes) or "front submit" / "front
    steps" (clients speaking to the worker itself, a call per request or one step stream each)."""
    import os

    from serving_path import cpu_s

    ctx = multiprocessing.get_context("spawn")
    kind, how, *interval = path.split()  # "routers N interval K": the routers' stream_interval is K
    if interval:
        router = config.router.model_copy(update={"stream_interval": int(interval[-1])})
        config = config.model_copy(update={"router": router})
    router_procs, targets = start_routers(ctx, config, worker.server.address, int(how) if kind == "routers" else 0)
    pids = {"engine core": [worker.engine.process.pid], "worker front": [os.getpid()]}
    if router_procs:
        pids["routers"] = [proc.pid for proc, _ in router_procs]
    marks: dict[str, tuple] = {}
    samples: list[tuple[float, int]] = []  # (time, engine steps) every 50 ms between the marks
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            samples.append((time.perf_counter(), worker.engine.steps))

    def mark(name: str) -> None:
        marks[name] = ({n: sum(cpu_s(pid) for pid in ids) for n, ids in pids.items()}, worker.engine.steps,
                       time.perf_counter())  # fmt: skip
        if name == "before":
            threading.Thread(target=sample, daemon=True).start()
        else:
            sampling.set()

    try:
        go(start_clients(ctx, worker, targets, how, args.batch // 2, args))  # a warm-up round: a request a stream
        measured = start_clients(ctx, worker, targets, how, args.batch // 2 * args.rounds, args)
        pids["clients"] = [proc.pid for proc, _ in measured]
        reports = go(measured, mark)
    finally:
        for proc, mine in router_procs:
            mine.send("stop")
            proc.join(30)
    (cpu0, steps0, t0), (cpu1, steps1, t1) = marks["before"], marks["after"]
    wall, steps, tokens = t1 - t0, steps1 - steps0, sum(r["tokens"] for r in reports)
    ideal_steps = 1 / (args.step_ms / 1e3)
    (t_a, s_a), (t_b, s_b) = samples[len(samples) // 5], samples[len(samples) * 4 // 5]  # the middle 60 %
    return {
        "path": path,
        "failed": sum(r["failed"] for r in reports),
        "steps_per_s": steps / wall,
        "steps_fraction_of_ideal": steps / wall / ideal_steps,
        "sustained_steps_fraction_of_ideal": (s_b - s_a) / (t_b - t_a) / ideal_steps,
        "mean_batch": tokens / steps if steps else 0.0,
        "tokens_per_s": tokens / wall,
        "tokens_fraction_of_ideal": tokens / wall / (args.batch * ideal_steps),
        "cpu_ms_per_step": {name: (cpu1[name] - cpu0[name]) / steps * 1e3 for name in pids},
        "cpu_cores_busy": sum(cpu1[name] - cpu0[name] for name in pids) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=4, help="requests per client stream in the measured part")
    parser.add_argument(
        "--paths", default="front submit,front steps,routers 1,routers 2,routers 1 interval 4",
        help="rows: clients on the worker itself (`front submit`: a call per request, `front steps`: one step "
        "stream per client) or through N router processes (`routers N`, with `interval K` the routers' "
        "stream_interval)",
    )  # fmt: skip
    parser.add_argument(
        "--no-pin", action="store_true",
        help="let every process share every core (by default the engine core has CPU 0 to itself and the "
        "front, routers and clients share the rest, as a GPU server gives its engine core a core of its own)",
    )  # fmt: skip
    args = parser.parse_args()

    import functools
    import os

    from cluster.cpu import cpu_kind, results_suffix
    from decode_worker import service as decode_service
    from decode_worker.core import ProcessCore

    config = bench_config(args.batch)
    main_fn = functools.partial(stand_in_main, step_s=args.step_ms / 1e3)
    core = ProcessCore.spawn(config, "decode-0", main=main_fn)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = not args.no_pin and len(cpus) > 1
    if pinned:  # the core (its threads too) on the first CPU; this process and all it starts on the others
        time.sleep(0.5)  # its loop's threads are up
        for thread in os.listdir(f"/proc/{core.process.pid}/task"):
            os.sched_setaffinity(int(thread), cpus[:1])
        os.sched_setaffinity(0, cpus[1:])
    worker = decode_service.around(config, "decode-0", core, core.info.fingerprint)
    worker.start()
    rows = []
    try:
        for path in args.paths.split(","):
            rows.append(measure(worker, config, path, args))
            print_row(rows[-1])
    finally:
        worker.stop()
    out = {"cpu": cpu_kind(), "cores": multiprocessing.cpu_count(), "batch": args.batch, "step_ms": args.step_ms,
           "tokens": args.tokens, "pinned": {"engine core": cpus[:1], "the rest": cpus[1:]} if pinned else None,
           "rows": rows}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / ("gpu_shaped" + results_suffix())  # each kind of CPU its own
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2))
    plot(out, stem.with_suffix(".png"))
    print(f"\n{out['cpu']}, {out['cores']} cores; wrote {stem}.json and .png")


def print_row(row: dict) -> None:
    cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in row["cpu_ms_per_step"].items())
    print(
        f"{row['path']}: {row['steps_per_s']:.1f} steps/s ({row['steps_fraction_of_ideal']:.2f} of ideal, "
        f"{row['sustained_steps_fraction_of_ideal']:.2f} sustained: the middle 60 % of the run), "
        f"mean batch {row['mean_batch']:.0f}, {row['tokens_per_s']:,.0f} tok/s at the clients "
        f"({row['tokens_fraction_of_ideal']:.2f} of ideal), {row['failed']} failed; CPU ms per step: {cpu}; "
        f"{row['cpu_cores_busy']:.2f} cores busy"
    )


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    names = list(dict.fromkeys(name for r in rows for name in r["cpu_ms_per_step"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["path"] for r in rows]
    a.bar(labels, [r["tokens_fraction_of_ideal"] for r in rows], label="tokens at the clients")
    a.axhline(0.95, color="k", linestyle="--", label="goal 0.95")
    a.set_ylabel("fraction of the ideal")
    a.set_title(f"batch {out['batch']}, {out['step_ms']:g} ms steps")
    a.legend()
    bottom = [0.0] * len(rows)
    for name in names:
        values = [r["cpu_ms_per_step"].get(name, 0.0) for r in rows]
        b.bar(labels, values, bottom=bottom, label=name)
        bottom = [x + y for x, y in zip(bottom, values, strict=True)]
    b.axhline(out["step_ms"] * out["cores"], color="k", linestyle="--", label="the cores' CPU per step")
    b.set_ylabel("CPU ms per engine step")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
