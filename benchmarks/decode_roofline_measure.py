"""The measurements of `decode_roofline.py` (`gpu_steps.py` uses them too): this machine's floors
(memory read bandwidth, matrix-multiply rate), the bytes and FLOPs one decode step must move, Tandem's
step time beside the floors measured between its repeats, transformers' `generate` per-token time, and
the mixed workload's throughput on each. `CONTEXT` is the context every decode step is measured at."""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable

import torch

from cluster.engine.request import Request, SamplingParams, ScheduledChunk, StepPlan
from cluster.engine.sampler import SampleRow
from cluster.model import hugepages
from decode_worker.engine import Engine

CONTEXT = 512


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeat: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


_PROBES: dict[str, torch.Tensor] = {}


def _probe(device: str) -> torch.Tensor:
    """A float32 tensor far larger than the caches, summed to measure memory read bandwidth. On a CPU
    it lies on huge pages where the kernel offers them, as a served model's weights do
    (`cluster.model.hugepages`): through 4 KB pages the same sum reads 20-25 % slower."""
    if device not in _PROBES:
        numel = 256 * 2**20 // 4 * (8 if device == "cuda" else 1)
        if device == "cpu" and hugepages.available():
            _PROBES[device] = hugepages.empty(numel * 4).view(torch.float32).fill_(1.0)
        else:
            _PROBES[device] = torch.ones(numel, device=device)
    return _PROBES[device]


def measure_bandwidth(device: str) -> float:
    x = _probe(device)
    times = timed(lambda: x.sum(), device, repeat=15)
    return x.numel() * 4 / statistics.median(times)


def _matmul_operand(dtype: torch.dtype, device: str) -> torch.Tensor:
    """A square matrix whose product with itself measures the matrix-multiply rate."""
    key = f"{device}:{dtype}"
    if key not in _PROBES:
        n = 2048 if device == "cpu" else 8192
        _PROBES[key] = torch.randn(n, n, dtype=dtype, device=device)
    return _PROBES[key]


def matmul_rate(times: list[float], a: torch.Tensor) -> float:
    return 2 * a.shape[0] ** 3 / statistics.median(times)


def measure_matmul(dtype: torch.dtype, device: str) -> float:
    a = _matmul_operand(dtype, device)
    return matmul_rate(timed(lambda: a @ a, device, repeat=5), a)


def step_bytes(model, batch: int, context: int) -> tuple[int, int]:
    """Bytes one decode step must read: every weight except the embedding table (only `batch`
    rows of it), plus the KV cache of every sequence; and the step's matmul FLOPs."""
    arch = model.arch
    elt = model.embed_tokens.weight.element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    if arch.tie_word_embeddings:
        weights += model.embed_tokens.weight.numel()  # the LM head reads the shared matrix
    kv = batch * context * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim
    flops = 2 * weights * batch + 4 * batch * context * arch.num_layers * arch.num_heads * arch.head_dim
    return (weights + kv) * elt + batch * arch.hidden_size * elt, flops


def decode_plan(batch: int, context: int, block_size: int) -> StepPlan:
    per_seq = -(-(context + 1) // block_size)
    chunks = []
    for i in range(batch):
        req = Request(f"b{i}", [1] * context, SamplingParams(max_tokens=1, temperature=0))
        req.output_token_ids.append(2)
        table = tuple(range(i * per_seq, (i + 1) * per_seq))
        chunks.append(ScheduledChunk(req, context, 1, table, samples=True))
    return StepPlan(tuple(chunks))


def sample_rows(plan: StepPlan) -> list[SampleRow]:
    """The sampling rows of `plan`'s chunks, as the engine hands them to `ModelRunner.execute`."""
    return [SampleRow(c.request.params, c.request.prompt_token_ids, c.request.output_token_ids) for c in plan.chunks]


def paired_steps(engines: dict[str, Engine], context: int, turns: int, warm: int = 5, steps: int = 20) -> dict:
    """Each engine's decode step at batch 1 after `context` tokens, the engines taking turns in this one
    process: per turn, `warm` steps to bring its weights back into cache, then `steps` back to back, timed
    one by one. Per engine: its step (the median over turns of each turn's median) and its speed-up over
    the first engine (each turn's step against the first engine's of the same turn: the median over
    turns, and their range)."""
    steps_of = {}
    for name, engine in engines.items():
        plan = decode_plan(1, context, engine.runner.block_size)
        steps_of[name] = functools.partial(engine.runner.execute, plan, sample_rows(plan))
    per_turn: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(turns):
        for name, step in steps_of.items():
            per_turn[name].append(statistics.median(timed(step, "cpu", steps, warm)))
    first = per_turn[next(iter(engines))]
    out = {}
    for name, times in per_turn.items():
        speedups = [a / b for a, b in zip(first, times, strict=True)]
        out[name] = {
            "step_ms": statistics.median(times) * 1e3,
            "speedup": statistics.median(speedups),
            "speedup_range": [min(speedups), max(speedups)],
        }
    return out


def tandem_step_time(
    engine: Engine, batch: int, device: str, repeat: int, matmul: bool = True
) -> tuple[float, float, float]:
    """The median decode step time, and this row's rooflines: the median memory read bandwidth and
    matrix-multiply rate (in the model's dtype) measured between runs of steps. This shared machine's
    bandwidth drifts during a run, from 25 to 80 GB/s, and its matmul rate dips when other work
    shares the cores, so each row is compared with the floors measured beside it. Steps are timed
    back to back, as a decode loop runs them. The first step after the floors is not timed: it pays
    for the probe's 256 MB sweep through the caches and the TLB (about 0.4 ms at batch 1 here),
    which a decode loop never makes. Without `matmul` the matrix-multiply rate is not measured
    (nan): a bfloat16 product takes seconds on a CPU without native bfloat16 arithmetic."""
    plan = decode_plan(batch, CONTEXT, engine.runner.block_size)
    rows = sample_rows(plan)
    probe = _probe(device)
    a = _matmul_operand(engine.runner.model.embed_tokens.weight.dtype, device)
    steps: list[float] = []
    sums: list[float] = []
    products: list[float] = []
    for _ in range(repeat):
        steps += timed(lambda: engine.runner.execute(plan, rows), device, repeat=2, warmup=1)
        sums += timed(lambda: probe.sum(), device, repeat=1, warmup=0)
        if matmul:
            products += timed(lambda: a @ a, device, repeat=1, warmup=0)
    rate = matmul_rate(products, a) if matmul else float("nan")
    return statistics.median(steps), probe.numel() * 4 / statistics.median(sums), rate


_PRODUCTS = ("skinny_linear", "_weight_int", "linear", "aten::mm", "aten::addmm")


def _kind(name: str) -> str | None:
    """What a decode step's profiled event is, by its name: a weight product (Tandem's kernels, torch's,
    a GEMM inductor generated), the attention kernel, one of the compiled graph's fused element-wise
    loops (named `graph_*` where `cpp.enable_kernel_profile` is set when compiling), or none of them."""
    if name.startswith("graph_"):  # `graph_0_cpp_fused_*` loops; GEMM templates: `graph_0_gemm_*`, `graph_0_kernel`
        return "elementwise" if "cpp_fused" in name and "_gemm_" not in name else "products"
    if "decode_attention" in name:
        return "attention"
    return "products" if any(k in name for k in _PRODUCTS) else None


def step_breakdown(engine: Engine, batch: int, weight_bytes: int, kv_bytes: int, step_s: float) -> dict[str, float]:
    """Where one decode step's `step_s` goes, from the self times torch's profiler records over steps
    like `tandem_step_time`'s: the weight products and the attention kernel (each with the bytes it
    reads per second), the graph's fused element-wise loops, and the rest (launching them, the
    graph's wrapper, metadata, sampling), which is the step's unprofiled time less the three, as the
    profiler's own cost per event would inflate it."""
    from torch.profiler import profile

    plan = decode_plan(batch, CONTEXT, engine.runner.block_size)
    rows = sample_rows(plan)
    steps = 20
    engine.runner.execute(plan, rows)
    with profile() as prof:
        for _ in range(steps):
            engine.runner.execute(plan, rows)
    spent = {"products": 0.0, "attention": 0.0, "elementwise": 0.0}
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for event in events:
        kind = _kind(event.key)
        if kind is not None:
            spent[kind] += event.self_cpu_time_total / 1e6 / steps
    return {
        **{f"{k}_ms": v * 1e3 for k, v in spent.items()},
        "rest_ms": max(0.0, step_s - sum(spent.values())) * 1e3,
        "products_gbps": weight_bytes / spent["products"] / 1e9 if spent["products"] else float("nan"),
        "attention_gbps": kv_bytes / spent["attention"] / 1e9 if spent["attention"] else float("nan"),
        "events_ms": {e.key: e.self_cpu_time_total / 1e3 / steps for e in events[:12]},  # the largest, by self time
    }


def eager_breakdown(engine: Engine, batch: int, kv_bytes: int, steps: int = 40) -> dict[str, float]:
    """Where an eager decode step goes, timed around the model's two calls over `steps` steps like
    `tandem_step_time`'s: the decoder layers' pass (`CausalLM.decode_natively`: every layer's products,
    attention and the row-wise steps between, in one call where the kernels take it), the LM head's
    product, each with the bytes it reads per second, and the rest of the step (the embedding, the
    attention metadata, the final norm, sampling and the Python around them; the layers too, where
    they run as modules)."""
    from cluster.model.quant import weight_bytes

    model = engine.runner.model
    head = sum(t.numel() * t.element_size() for t in [*model.lm_head.parameters(), *model.lm_head.buffers()])
    plan = decode_plan(batch, CONTEXT, engine.runner.block_size)
    rows = sample_rows(plan)
    spent = {"layers": 0.0, "lm_head": 0.0}

    def timing(key: str, call: Callable) -> Callable:
        def timed_call(*args):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            out = call(*args)
            spent[key] += time.perf_counter() - start
            return out

        return timed_call

    model.decode_natively = timing("layers", model.decode_natively)
    model.compute_logits = timing("lm_head", model.compute_logits)
    try:
        engine.runner.execute(plan, rows)
        spent.update(layers=0.0, lm_head=0.0)
        start = time.perf_counter()
        for _ in range(steps):
            engine.runner.execute(plan, rows)
        step = (time.perf_counter() - start) / steps
    finally:
        del model.decode_natively, model.compute_logits
    layers, lm_head = spent["layers"] / steps, spent["lm_head"] / steps
    return {
        "step_ms": step * 1e3,
        "layers_ms": layers * 1e3,
        "layers_gbps": (weight_bytes(model) - head + kv_bytes) / layers / 1e9,
        "lm_head_ms": lm_head * 1e3,
        "lm_head_gbps": head / lm_head / 1e9,
        "rest_ms": (step - layers - lm_head) * 1e3,
    }


class _TokenClock:
    """A generate() streamer that timestamps each token step as transformers emits it."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:  # type: ignore[no-untyped-def]
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_token_time(hf, batch: int, device: str, new_tokens: int) -> float:
    """Median time between successive decode steps of transformers' generate (prefill excluded)."""
    prompt = torch.randint(3, hf.config.vocab_size, (batch, CONTEXT), device=device)
    clock = _TokenClock()
    with torch.inference_mode():
        hf.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        hf.generate(prompt, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False,
                    eos_token_id=None, pad_token_id=0, streamer=clock)  # fmt: skip
    # stamps: the prompt, then one per generated token; the gaps after the first token are decode steps
    return statistics.median(b - a for a, b in zip(clock.stamps[2:], clock.stamps[3:], strict=False))


def mixed_requests(n: int, vocab: int, seed: int = 0, scale: float = 1.0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(int(rng.randint(32, 512) * scale) or 1)],
         int(rng.randint(16, 256) * scale) or 1)
        for _ in range(n)
    ]  # fmt: skip


def engine_throughput(engine: Engine, requests: list[tuple[list[int], int]]) -> float:
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"m{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished:
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def hf_static_throughput(hf, requests: list[tuple[list[int], int]], device: str, batch: int = 16) -> float:
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(requests), batch):
        group = requests[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(group):  # left padding, as decoder-only generation needs
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        longest = max(n for _, n in group)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                        do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        produced += sum(n for _, n in group)  # tokens each request asked for; the rest is padding
    return produced / (time.perf_counter() - start)


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""
