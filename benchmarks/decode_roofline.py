"""Decode against the memory roofline, with transformers measured side by side in the same run.

    .venv/bin/python benchmarks/decode_roofline.py [--quick] [--device cuda] [--model DIR|FILE.gguf]

1. Floors of this machine, measured now: memory read bandwidth (a large float32 `sum`) and the
   matrix-multiply rate in the model's dtype. Both drift during a run on a shared machine, so they
   are measured again between the repeats of every step timed, and each row's rooflines are the
   floors measured beside it.
2. For the `smollm-135m` preset (random weights) in float32 and bfloat16, with a 512-token context:
   Tandem's decode step at batch 1, 4, 16 and 64 — bytes each step must read (weights + KV cache),
   achieved bandwidth and fraction of the roofline — and transformers' `generate` per-token time at
   batch 1 and at static batch 16.
3. A mixed workload of 64 requests (prompts 32-512 tokens, outputs 16-256): Tandem's engine
   (continuous batching) against transformers' static batches of 16, output tokens per second.
4. Fewer bytes per token: the same preset in bfloat16 with int8 and int4 weights and an int8 KV
   cache (compiled decode, batch 1 and 16): bytes each step reads, step time, fraction of the
   roofline and speed-up over bfloat16, all in this run, with transformers' bfloat16 step beside.
   `--quant-only` runs the floors and this section alone.

`--model` runs a real model instead of the random preset: a model folder, or a GGUF file (imported
once); for a GGUF file whose linear weights are Q4_0/Q4_1 blocks, section 4 adds those blocks kept
as Tandem's int4 weights (the file's own weights, not quantised again).

Prints a table and writes `benchmarks/results/decode_roofline.{json,png}` (with `--quant-only`:
`decode_roofline_quant.{json,png}`; with `--model`, the model folder's name is appended).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.config import CacheConfig, SchedulerConfig  # noqa: E402
from cluster.engine.request import Request, SamplingParams, ScheduledChunk, StepPlan  # noqa: E402
from cluster.engine.sampler import SampleRow  # noqa: E402
from cluster.model.builder import init_model_folder  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from cluster.model.weights import DTYPES  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402

CONTEXT = 512
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)


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
    """A float32 tensor far larger than the caches, summed to measure memory read bandwidth."""
    if device not in _PROBES:
        _PROBES[device] = torch.ones(256 * 2**20 // 4 * (8 if device == "cuda" else 1), device=device)
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
    rows = [SampleRow(c.request.params, c.request.prompt_token_ids, c.request.output_token_ids) for c in plan.chunks]
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


def dtype_section(
    folder: Path,
    dtype_name: str,
    device: str,
    batches: list[int],
    repeat: int,
    quick: bool,
    results: dict,
) -> list[dict]:
    """Sections 2 and 3 for one dtype: Tandem's steps (eager, compiled) and transformers' beside
    them, then the mixed workload; records the dtype's matmul rate and compile time in `results`."""
    from transformers import AutoModelForCausalLM

    runs: list[dict] = []
    dtype = DTYPES[dtype_name]
    matmul = measure_matmul(dtype, device)
    model = load_model(folder, dtype_name, device)
    cache = CacheConfig(block_size=16, num_blocks=64 * (768 // 16 + 2))
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    eager = Engine(model, _NoText(), cache, sched)
    compiled = Engine(model, _NoText(), cache, sched, compile_buckets=BUCKETS)
    start = time.perf_counter()
    compiled.runner.compiled.warm_up(compiled.runner.kv_cache)
    compile_s = time.perf_counter() - start
    results[f"compile_s_{dtype_name}"] = compile_s
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    print(
        f"\n{dtype_name}: matmul {matmul / 1e9:.0f} GFLOP/s; compiling {len(BUCKETS)} decode buckets took "
        f"{compile_s:.0f} s"
    )
    print(
        f"{'what':<28}{'batch':>6}{'ms/step':>10}{'MB/step':>10}{'GB/s':>8}{'bw GB/s':>8}{'roofline':>10}{'GFLOP/s':>9}"
        f"{'mm GF/s':>8}{'of matmul':>10}"
    )
    for batch in batches:
        nbytes, flops = step_bytes(model, batch, CONTEXT)
        for name, engine in (("tandem eager", eager), ("tandem compiled", compiled)):
            t, bw, mm = tandem_step_time(engine, batch, device, repeat)
            runs.append(_record(name, dtype_name, batch, t, nbytes, flops, bw, mm))
            _row(f"{name} decode step", batch, t, nbytes, flops, bw, mm)
    for batch in [1, 16] if not quick else [1]:
        t = hf_token_time(hf, batch, device, new_tokens=8 if quick else 16)
        bw = measure_bandwidth(device)
        nbytes, flops = step_bytes(model, batch, CONTEXT)
        runs.append(_record("transformers", dtype_name, batch, t, nbytes, flops, bw, matmul))
        _row("transformers generate", batch, t, nbytes, flops, bw, matmul)
    requests = mixed_requests(16 if quick else 64, model.arch.vocab_size, scale=0.25 if quick else 1.0)
    ours = engine_throughput(compiled, requests)
    theirs = hf_static_throughput(hf, requests, device)
    runs.append({"engine": "mixed", "dtype": dtype_name, "tandem_tok_s": ours,
                 "transformers_tok_s": theirs, "ratio": ours / theirs})  # fmt: skip
    print(
        f"mixed workload ({len(requests)} requests): tandem {ours:.1f} tok/s, transformers static batch "
        f"{theirs:.1f} tok/s, ratio {ours / theirs:.2f}x"
    )
    results[f"matmul_GFLOPs_{dtype_name}"] = matmul / 1e9
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset and short runs (a smoke test)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--quant-only", action="store_true", help="the floors and the quantised settings only")
    parser.add_argument("--model", default=None, help="a model folder or GGUF file (default: the random preset)")
    parser.add_argument(
        "--settings", default=None,
        help="section 4's settings to run, comma-separated labels (default: all; bfloat16 always runs first)",
    )  # fmt: skip
    parser.add_argument("--batches", default=None, help="section 4's batch sizes, comma-separated (default: 1,16)")
    parser.add_argument("--eager", action="store_true", help="section 4's steps not compiled")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device
    folder, kept = bench_model(args.model, args.quick)
    preset = folder.name
    batches = [1, 4] if args.quick else [1, 4, 16, 64]
    repeat = 3 if args.quick else 10

    bandwidth = measure_bandwidth(device)
    results: dict = {"device": device, "threads": args.threads, "preset": preset, "context": CONTEXT,
                     "bandwidth_GBps": bandwidth / 1e9, "runs": []}  # fmt: skip
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s ({device}, {args.threads} threads)")
    for dtype_name in [] if args.quant_only else args.dtypes.split(","):
        results["runs"] += dtype_section(folder, dtype_name, device, batches, repeat, args.quick, results)

    if device == "cpu":
        quant_batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 4] if args.quick else [1, 16]
        chosen = None if args.settings is None else {"bfloat16", *args.settings.split(",")}
        results["quantised"] = quantised(folder, quant_batches, repeat, kept, chosen, args.eager)
        results["quantised_mode"] = "eager" if args.eager else "compiled"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "decode_roofline" + ("_quick" if args.quick else "") + ("_cuda" if device == "cuda" else "")
    name += "_quant" if args.quant_only else ""
    name += f"_{Path(args.model).stem}" if args.model else ""  # the file or folder it was given
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / f"{name}.png")
    print(f"\nwrote {out / name}.json and .png")


def bench_model(model: str | None, quick: bool) -> tuple[Path, Path | None]:
    """The model folder to run, and for a GGUF file of Q4 blocks its folder with them kept as int4."""
    from cluster.model.arch import ModelFormatError
    from cluster.model.gguf import import_gguf, model_folder

    if model is None:
        preset = "tiny" if quick else "smollm-135m"
        folder = ROOT / ".cache" / "bench" / preset
        if not (folder / "config.json").exists():
            init_model_folder(folder, preset, dtype="bfloat16", seed=0)
        return folder, None
    folder = model_folder(model)
    if Path(model).suffix.lower() != ".gguf":
        return folder, None
    kept = ROOT / ".cache" / "bench" / f"{folder.name}-int4-kept"
    if not (kept / "config.json").exists():
        try:
            import_gguf(model, kept, keep_quantized=True, dtype="bfloat16")
        except ModelFormatError as e:  # not Q4 blocks: nothing to keep
            print(f"the file's weights cannot be kept as int4: {e}")
            return folder, None
    return folder, kept


QUANT_SETTINGS = (  # (label, weight dtype, KV cache dtype)
    ("bfloat16", "auto", "auto"),
    ("int8 weights", "int8", "auto"),
    ("int4 weights", "int4", "auto"),
    ("int8 KV", "auto", "int8"),
    ("int8 weights + KV", "int8", "int8"),
)


def quantised(
    folder: Path,
    batches: list[int],
    repeat: int,
    kept: Path | None = None,
    chosen: set[str] | None = None,
    eager: bool = False,
) -> list[dict]:
    """Section 4: each setting's compiled decode step against the bfloat16 one, same run; `kept`: a
    folder of int4 weights kept from a GGUF file's Q4 blocks, run as one more setting; `chosen`:
    the labels to run (None: all); `eager`: steps not compiled (minutes of compilation saved per
    setting where inductor is slow)."""
    from cluster.model.attention import kv_row_bytes
    from cluster.model.quant import weight_bytes

    mode = "eager" if eager else "compiled"
    print(f"\nfewer bytes per token (bfloat16 activations, {mode} decode, {CONTEXT}-token context)")
    print(f"{'setting':<22}{'batch':>6}{'ms/step':>10}{'MB/step':>10}{'GB/s':>8}{'bw GB/s':>8}{'roofline':>10}"
          f"{'vs bf16':>9}")  # fmt: skip
    rows: list[dict] = []
    settings = [(label, weights, kv, folder) for label, weights, kv in QUANT_SETTINGS]
    settings += [("int4 kept (file's Q4)", "int4", "auto", kept)] if kept is not None else []
    if chosen is not None:
        unknown = chosen - {label for label, *_ in settings}
        if unknown:
            raise SystemExit(f"unknown settings {sorted(unknown)}; known: {[label for label, *_ in settings]}")
        settings = [s for s in settings if s[0] in chosen]
    for label, weights, kv, source in settings:
        torch._dynamo.reset()  # each setting compiles its own graphs
        quantise = weights if source == folder else "auto"  # a kept folder loads as it was written
        model = load_model(source, "bfloat16", "cpu", weight_dtype=quantise, group_size=128)
        arch = model.arch
        cache = CacheConfig(block_size=16, num_blocks=max(batches) * (768 // 16 + 2), kv_dtype=kv)
        buckets = () if eager else batches
        engine = Engine(model, _NoText(), cache, SchedulerConfig(max_num_seqs=64), compile_buckets=buckets)
        start = time.perf_counter()
        if not eager:
            engine.runner.compiled.warm_up(engine.runner.kv_cache)
        compile_s = time.perf_counter() - start
        row_bytes = kv_row_bytes(arch.head_dim, 2, kv)
        for batch in batches:
            t, bw, _ = tandem_step_time(engine, batch, "cpu", repeat, matmul=False)  # section 4 needs bandwidth only
            kv_bytes = batch * CONTEXT * arch.num_layers * 2 * arch.num_kv_heads * row_bytes
            nbytes = weight_bytes(model) + kv_bytes
            base = next((r["step_s"] for r in rows if r["batch"] == batch and r["setting"] == "bfloat16"), t)
            rows.append({"setting": label, "weights": weights, "kv": kv, "batch": batch, "step_s": t,
                         "bytes": nbytes, "weight_bytes": weight_bytes(model), "kv_bytes": kv_bytes,
                         "GBps": nbytes / t / 1e9, "bandwidth_GBps": bw / 1e9, "roofline_frac": nbytes / t / bw,
                         "speedup_vs_bf16": base / t, "compile_s": compile_s})  # fmt: skip
            print(f"{label:<22}{batch:>6}{t * 1e3:>10.2f}{nbytes / 1e6:>10.1f}{nbytes / t / 1e9:>8.1f}"
                  f"{bw / 1e9:>8.1f}{nbytes / t / bw:>9.0%}{base / t:>8.2f}x")  # fmt: skip
        del model, engine
    rows += transformers_rows(folder, batches, rows)
    return rows


def transformers_rows(folder: Path, batches: list[int], rows: list[dict]) -> list[dict]:
    """transformers' bfloat16 decode step on the same weights, beside section 4's settings."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    out = []
    for batch in batches:
        t = hf_token_time(hf, batch, "cpu", new_tokens=16)
        bw = measure_bandwidth("cpu")
        nbytes = next(r["bytes"] for r in rows if r["batch"] == batch and r["setting"] == "bfloat16")
        base = next(r["step_s"] for r in rows if r["batch"] == batch and r["setting"] == "bfloat16")
        out.append({"setting": "transformers bfloat16", "weights": "auto", "kv": "auto", "batch": batch,
                    "step_s": t, "bytes": nbytes, "GBps": nbytes / t / 1e9, "bandwidth_GBps": bw / 1e9,
                    "roofline_frac": nbytes / t / bw, "speedup_vs_bf16": base / t})  # fmt: skip
        print(f"{'transformers bfloat16':<22}{batch:>6}{t * 1e3:>10.2f}{nbytes / 1e6:>10.1f}{nbytes / t / 1e9:>8.1f}"
              f"{bw / 1e9:>8.1f}{nbytes / t / bw:>9.0%}{base / t:>8.2f}x")  # fmt: skip
    return out


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _record(engine: str, dtype: str, batch: int, t: float, nbytes: int, flops: int, bandwidth: float,
            matmul: float) -> dict:  # fmt: skip
    return {
        "engine": engine,
        "dtype": dtype,
        "batch": batch,
        "step_s": t,
        "bytes": nbytes,
        "flops": flops,
        "GBps": nbytes / t / 1e9,
        "bandwidth_GBps": bandwidth / 1e9,
        "roofline_frac": nbytes / t / bandwidth,
        "matmul_GFLOPs": matmul / 1e9,
        "compute_frac": flops / t / matmul,
    }


def _row(what: str, batch: int, t: float, nbytes: int, flops: int, bandwidth: float, matmul: float) -> None:
    print(f"{what:<28}{batch:>6}{t * 1e3:>10.2f}{nbytes / 1e6:>10.1f}{nbytes / t / 1e9:>8.1f}{bandwidth / 1e9:>8.1f}"
          f"{nbytes / t / bandwidth:>9.0%}{flops / t / 1e9:>9.1f}{matmul / 1e9:>8.0f}"
          f"{flops / t / matmul:>10.0%}")  # fmt: skip


def _plot_roofline(results: dict, ax) -> None:  # type: ignore[no-untyped-def]
    for engine, marker in (("tandem compiled", "o-"), ("tandem eager", "^:"), ("transformers", "s--")):
        for dtype in DTYPES:
            runs = [r for r in results["runs"] if r["engine"] == engine and r["dtype"] == dtype]
            if runs:
                ax.plot([r["batch"] for r in runs], [100 * r["roofline_frac"] for r in runs], marker,
                        label=f"{engine} {dtype}")  # fmt: skip
    ax.axhline(100, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences per decode step)")
    ax.set_ylabel("% of memory-bandwidth roofline")
    ax.set_title(f"{results['preset']} decode, {results['context']}-token context, {results['device']}")
    ax.legend()


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quant = results.get("quantised", [])
    panels = int(bool(results["runs"])) + int(bool(quant))
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4), squeeze=False)
    if results["runs"]:
        _plot_roofline(results, axes[0][0])
    if quant:
        qa = axes[0][-1]
        settings = list(dict.fromkeys(r["setting"] for r in quant))
        batches = sorted({r["batch"] for r in quant})
        for j, batch in enumerate(batches):
            runs = {r["setting"]: r for r in quant if r["batch"] == batch}
            xs = [i + (j - (len(batches) - 1) / 2) * 0.35 for i in range(len(settings))]
            qa.bar(xs, [runs[s]["speedup_vs_bf16"] for s in settings], 0.35, label=f"batch {batch}")
        qa.axhline(1.0, color="grey", lw=0.8)
        qa.set_xticks(range(len(settings)), settings, rotation=20, ha="right")
        qa.set_ylabel("decode step speed-up over bfloat16")
        qa.set_title(f"fewer bytes per token ({results.get('quantised_mode', 'compiled')} decode)")
        qa.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
