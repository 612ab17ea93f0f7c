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

The measurements live in `decode_roofline_measure.py` (`gpu_steps.py` uses them too), section 4 in
`decode_roofline_quant.py`, the records, printed rows and figure in `decode_roofline_report.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_roofline_measure import (  # noqa: E402
    CONTEXT,
    _NoText,
    engine_throughput,
    hf_static_throughput,
    hf_token_time,
    measure_bandwidth,
    measure_matmul,
    mixed_requests,
    step_bytes,
    tandem_step_time,
)
from decode_roofline_quant import quantised  # noqa: E402
from decode_roofline_report import _plot, _record, _row  # noqa: E402

from cluster.config import CacheConfig, SchedulerConfig  # noqa: E402
from cluster.model.builder import init_model_folder  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from cluster.model.weights import DTYPES  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)


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
    parser.add_argument(
        "--activations", default="bfloat16", choices=["bfloat16", "float32"],
        help="section 4's model dtype (float32: what `dtype: auto` runs on a CPU without native bfloat16 products)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device
    folder, kept = bench_model(args.model, args.quick, args.activations)
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
        chosen = None if args.settings is None else {args.activations, *args.settings.split(",")}
        results["quantised"] = quantised(folder, quant_batches, repeat, kept, chosen, args.eager, args.activations)
        results["quantised_activations"] = args.activations
        results["quantised_mode"] = "eager" if args.eager else "compiled"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "decode_roofline" + ("_quick" if args.quick else "") + ("_cuda" if device == "cuda" else "")
    name += "_quant" if args.quant_only else ""
    name += "_float32" if args.activations == "float32" else ""
    name += f"_{Path(args.model).stem}" if args.model else ""  # the file or folder it was given
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / f"{name}.png")
    print(f"\nwrote {out / name}.json and .png")


def bench_model(model: str | None, quick: bool, dtype: str = "bfloat16") -> tuple[Path, Path | None]:
    """The model folder to run, and for a GGUF file of Q4 blocks its folder with them kept as int4
    (its other tensors in `dtype`: a quantised folder loads in the dtype it was written in)."""
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
    kept = ROOT / ".cache" / "bench" / (f"{folder.name}-int4-kept" + ("" if dtype == "bfloat16" else f"-{dtype}"))
    if not (kept / "config.json").exists():
        try:
            import_gguf(model, kept, keep_quantized=True, dtype=dtype)
        except ModelFormatError as e:  # not Q4 blocks: nothing to keep
            print(f"the file's weights cannot be kept as int4: {e}")
            return folder, None
    return folder, kept


if __name__ == "__main__":
    main()
