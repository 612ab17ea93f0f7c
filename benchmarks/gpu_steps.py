"""Steps 2 and 3 of the GPU check (`benchmarks/gpu_check.py` runs them): decode against the HBM
roofline and prefill against the matrix-multiply rate, each against floors measured in this run.

    python benchmarks/gpu_steps.py decode|prefill --model NAME=DIR ... --result FILE [--dry-run]

decode: for each model, bfloat16, every batch of `BATCHES` at each context of `CONTEXTS`: the median
time of Tandem's decode step (eager: one forward pass over the paged cache and the sampler, logits
to the host included), the bytes it must read (weights, and every sequence's KV cache), and the
fraction of the memory bandwidth measured beside each row: the larger of a float32 `sum` (bytes
read) and a device-to-device copy (bytes read + written). transformers' `generate` on the same
weights at batch 1 and 16 (512-token context) is measured beside the last model.

prefill: one prompt of each length of `PROMPTS` through the engine's forward pass: FLOPs (the matrix
products, causal attention counted once, the LM head for the one sampled row), the bfloat16
matrix-multiply rate measured beside each row (a square product), and MFU = achieved / measured.

`--dry-run` runs the same code on the CPU with tiny shapes. Writes one JSON object to `--result`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_roofline_measure import _NoText, decode_plan, hf_token_time, step_bytes  # noqa: E402
from decode_roofline_measure import timed as roofline_timed  # noqa: E402

from cluster.config import CacheConfig, SchedulerConfig  # noqa: E402
from cluster.engine.request import Request, SamplingParams, ScheduledChunk, StepPlan  # noqa: E402
from cluster.engine.sampler import SampleRow  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (512, 4096)
PROMPTS = (512, 2048, 8192)
HF_BATCHES = (1, 16)
BLOCK = 16


class Shapes:
    """What a run measures: the GPU's shapes, or the dry run's tiny ones on the CPU."""

    def __init__(self, dry_run: bool) -> None:
        self.device = "cpu" if dry_run else "cuda"
        self.batches = (1, 2) if dry_run else BATCHES
        self.contexts = (32, 64) if dry_run else CONTEXTS
        self.prompts = (32, 64) if dry_run else PROMPTS
        self.hf_context = 32 if dry_run else 512
        self.repeat = 2 if dry_run else 5
        self.probe_bytes = (16 if dry_run else 2048) << 20
        self.matmul_n = 256 if dry_run else 8192


def timed(fn: Callable[[], object], device: str, repeat: int) -> list[float]:
    return roofline_timed(fn, device, repeat, warmup=1)  # one warm-up: the GPU loan's budget is tight


class Floors:
    """The device's memory bandwidth and bfloat16 matrix-multiply rate, measured again beside each row."""

    def __init__(self, shapes: Shapes) -> None:
        self.device = shapes.device
        self.probe = torch.ones(shapes.probe_bytes // 4, device=self.device)
        self.copy = torch.empty_like(self.probe)
        self.a = torch.randn(shapes.matmul_n, shapes.matmul_n, dtype=torch.bfloat16, device=self.device)

    def bandwidth(self) -> dict[str, float]:
        """Bytes per second: read (a float32 sum) and copy (read + written), and the larger."""
        nbytes = self.probe.numel() * 4
        read = nbytes / statistics.median(timed(lambda: self.probe.sum(), self.device, 3))
        copy = 2 * nbytes / statistics.median(timed(lambda: self.copy.copy_(self.probe), self.device, 3))
        return {"read": read, "copy": copy, "floor": max(read, copy)}

    def matmul(self) -> float:
        """FLOP per second of one square bfloat16 product."""
        n = self.a.shape[0]
        return 2 * n**3 / statistics.median(timed(lambda: self.a @ self.a, self.device, 3))


def engine_for(model, num_blocks: int, max_tokens: int) -> Engine:  # type: ignore[no-untyped-def]
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, watermark=0.0, enable_prefix_caching=False)
    return Engine(model, _NoText(), cache, SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=max_tokens))


def decode_rows(name: str, model, shapes: Shapes, floors: Floors) -> list[dict]:  # type: ignore[no-untyped-def]
    rows = []
    for context in shapes.contexts:
        rows += context_rows(name, model, context, shapes, floors)
        if shapes.device == "cuda":
            torch.cuda.empty_cache()  # the context's cache is gone: its memory goes back before the next one
    return rows


def context_rows(name: str, model, context: int, shapes: Shapes, floors: Floors) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every batch at one context, on an engine whose cache holds the largest batch."""
    engine = engine_for(model, max(shapes.batches) * -(-(context + 1) // BLOCK), max(shapes.batches))
    rows = []
    for batch in shapes.batches:
        plan = decode_plan(batch, context, BLOCK)
        sample = [SampleRow(c.request.params, c.request.prompt_token_ids, c.request.output_token_ids)
                  for c in plan.chunks]  # fmt: skip
        steps, bandwidths = [], []
        for _ in range(shapes.repeat):
            steps += timed(lambda: engine.runner.execute(plan, sample), shapes.device, 2)  # noqa: B023
            bandwidths.append(floors.bandwidth())
        t = statistics.median(steps)
        bw = {k: statistics.median(b[k] for b in bandwidths) for k in ("read", "copy", "floor")}
        nbytes, flops = step_bytes(model, batch, context)
        rows.append({
            "model": name, "engine": "tandem eager", "batch": batch, "context": context, "step_s": t,
            "bytes": nbytes, "flops": flops, "GBps": nbytes / t / 1e9, "read_GBps": bw["read"] / 1e9,
            "copy_GBps": bw["copy"] / 1e9, "roofline_frac": nbytes / t / bw["floor"],
        })  # fmt: skip
        print(f"{name:<10}{context:>8}{batch:>6}{t * 1e3:>10.3f}{nbytes / 1e6:>10.1f}{nbytes / t / 1e9:>9.1f}"
              f"{bw['floor'] / 1e9:>9.1f}{nbytes / t / bw['floor']:>9.1%}", flush=True)  # fmt: skip
    return rows


def hf_rows(name: str, folder: Path, model, shapes: Shapes, floors: Floors) -> list[dict]:  # type: ignore[no-untyped-def]
    """transformers' decode step on the same weights, beside Tandem's (its prefill excluded)."""
    import decode_roofline_measure
    from transformers import AutoModelForCausalLM

    decode_roofline_measure.CONTEXT = shapes.hf_context  # hf_token_time's prompt length
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(shapes.device).eval()
    rows = []
    for batch in HF_BATCHES:
        t = hf_token_time(hf, batch, shapes.device, new_tokens=4 if shapes.device == "cpu" else 16)
        bw = floors.bandwidth()["floor"]
        nbytes, flops = step_bytes(model, batch, shapes.hf_context)
        rows.append({"model": name, "engine": "transformers", "batch": batch, "context": shapes.hf_context,
                     "step_s": t, "bytes": nbytes, "flops": flops, "GBps": nbytes / t / 1e9,
                     "read_GBps": None, "copy_GBps": None, "roofline_frac": nbytes / t / bw})  # fmt: skip
        print(f"{name + ' (hf)':<10}{shapes.hf_context:>8}{batch:>6}{t * 1e3:>10.3f}{nbytes / 1e6:>10.1f}"
              f"{nbytes / t / 1e9:>9.1f}{bw / 1e9:>9.1f}{nbytes / t / bw:>9.1%}", flush=True)  # fmt: skip
    del hf
    return rows


def decode(models: dict[str, Path], shapes: Shapes) -> dict:
    floors = Floors(shapes)
    first = floors.bandwidth()
    read, copy = first["read"] / 1e9, first["copy"] / 1e9
    print(f"memory bandwidth: read {read:.1f} GB/s, copy {copy:.1f} GB/s ({shapes.device})")
    print(
        f"{'model':<10}{'context':>8}{'batch':>6}{'ms/step':>10}{'MB/step':>10}{'GB/s':>9}{'floor':>9}{'roofline':>9}"
    )
    rows: list[dict] = []
    for name, folder in models.items():
        model = load_model(folder, "bfloat16", shapes.device)
        rows += decode_rows(name, model, shapes, floors)
        if name == list(models)[-1]:
            rows += hf_rows(name, folder, model, shapes, floors)
        del model
    return {"bandwidth_GBps": {k: v / 1e9 for k, v in first.items()}, "rows": rows}


def prefill_flops(model, length: int) -> int:  # type: ignore[no-untyped-def]
    """Matrix-product FLOPs of one prompt's pass: every layer's weights for each token, causal
    attention (QK^T and PV over the token pairs at or before each query), the LM head for one row."""
    arch = model.arch
    layers = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    attention = 2 * 2 * arch.num_layers * arch.num_heads * arch.head_dim * length * (length + 1) // 2
    return 2 * layers * length + attention + 2 * arch.vocab_size * arch.hidden_size


def prefill(models: dict[str, Path], shapes: Shapes) -> dict:
    floors = Floors(shapes)
    print(f"{'model':<10}{'prompt':>8}{'ms':>10}{'TFLOP/s':>10}{'matmul':>10}{'MFU':>8}")
    rows = []
    for name, folder in models.items():
        rows += prefill_rows(name, load_model(folder, "bfloat16", shapes.device), shapes, floors)
    return {"rows": rows}


def prefill_rows(name: str, model, shapes: Shapes, floors: Floors) -> list[dict]:  # type: ignore[no-untyped-def]
    longest = max(shapes.prompts)
    engine = engine_for(model, -(-longest // BLOCK) + 1, longest)
    rows = []
    for length in shapes.prompts:
        request = Request("p", list(range(3, 3 + length)), SamplingParams(max_tokens=1, temperature=0))
        plan = StepPlan((ScheduledChunk(request, 0, length, tuple(range(-(-length // BLOCK))), samples=True),))
        times, rates = [], []
        for _ in range(shapes.repeat):
            times += timed(lambda: engine.runner.logits(plan), shapes.device, 2)  # noqa: B023
            rates.append(floors.matmul())
        t, rate = statistics.median(times), statistics.median(rates)
        flops = prefill_flops(model, length)
        rows.append({"model": name, "prompt_tokens": length, "pass_s": t, "flops": flops,
                     "TFLOPs": flops / t / 1e12, "matmul_TFLOPs": rate / 1e12, "mfu": flops / t / rate})  # fmt: skip
        print(f"{name:<10}{length:>8}{t * 1e3:>10.2f}{flops / t / 1e12:>10.2f}{rate / 1e12:>10.1f}"
              f"{flops / t / rate:>8.1%}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["decode", "prefill"])
    parser.add_argument("--model", action="append", required=True, help="NAME=DIR, once per model")
    parser.add_argument("--result", required=True, help="where the step's JSON goes")
    parser.add_argument("--dry-run", action="store_true", help="the CPU and tiny shapes")
    args = parser.parse_args()
    shapes = Shapes(args.dry_run)
    torch.set_num_threads(1 if args.dry_run else 8)
    models = {name: Path(folder) for name, folder in (m.split("=", 1) for m in args.model)}
    with torch.inference_mode():
        result = decode(models, shapes) if args.step == "decode" else prefill(models, shapes)
    Path(args.result).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
