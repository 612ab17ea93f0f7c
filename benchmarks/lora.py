"""LoRA adapters mixed in one batch against the base model alone, side by side in one run.

    .venv/bin/python benchmarks/lora.py [--quick] [--model PATH] [--targets q_proj,v_proj]

The decode engine in this process on SmolLM2 (or the demo model with `--quick`), eager steps, 32
requests of 64 prompt and 64 output tokens (greedy, `ignore_eos`), rank-16 adapters with random
weights written in PEFT's format. Rows:

- base: the 32 requests through the base model, no LoRA configured;
- 1, 4, 16 adapters: the 32 requests spread evenly over that many adapters, one batch (16 slots);
- one at a time: the same 32 requests as the 16-adapter row, each adapter's requests in a batch of
  their own, one adapter after another (what a server without mixed batches does).

Per row: TPOT (the mean decode step while every request of the batch runs), output tokens/s over
the whole run, and the bytes a step reads: the weights, plus the slots' A and B (every slot's, as the
pass reads them). Goals: 16 adapters mixed cost <= 1.3x the base model's TPOT; mixed beats one at a
time on throughput by >= 3x. Prints a table and writes `benchmarks/results/lora.{json,png}` (an
`_avx2` suffix on an AVX2-only machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from cluster.config import CacheConfig, LoraConfig, SchedulerConfig  # noqa: E402
from cluster.engine.request import SamplingParams  # noqa: E402
from cluster.model.lora import CONFIG_FILE, WEIGHTS_FILE, read_adapter, shapes  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
DEMO = ROOT / "models" / "tandem-demo-code"
SMOLLM2 = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
REQUESTS, PROMPT, OUTPUT, RANK, SLOTS = 32, 64, 64, 16, 16


def write_adapters(folder: Path, arch, count: int, targets: tuple[str, ...]) -> list[Path]:  # type: ignore[no-untyped-def]
    """`count` rank-16 adapters with random weights, in PEFT's format."""
    io, paths = shapes(arch), []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(arch.num_layers):
            for target in targets:
                fan_in, fan_out = io[target]
                where = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{where}.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.02
        path = folder / f"adapter-{i}"
        path.mkdir()
        save_file(tensors, str(path / WEIGHTS_FILE))
        config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(targets)}
        (path / CONFIG_FILE).write_text(json.dumps(config))
        paths.append(path)
    return paths


def run(engine, groups: list[list[tuple[str, list[int], SamplingParams]]]) -> dict:  # type: ignore[no-untyped-def]
    """Each group of requests in a batch of its own, one group after another: TPOT over the steps where
    the whole group decodes, output tokens/s over everything."""
    full_steps, tokens, started = [], 0, time.perf_counter()
    for group in groups:
        for rid, prompt, params in group:
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished:
            t0 = time.perf_counter()
            outputs = engine.step()
            took = time.perf_counter() - t0
            tokens += sum(len(o.token_ids) for o in outputs)
            running = engine.scheduler.running
            if len(running) == len(group) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
                full_steps.append(took)
    wall = time.perf_counter() - started
    steady = full_steps[2:] or full_steps  # the first steps after prefill warm the caches
    return {"tpot_ms": 1e3 * sum(steady) / len(steady), "tokens_per_s": tokens / wall, "steps": len(full_steps)}


def requests(adapters: list[str]) -> list[tuple[str, list[int], SamplingParams]]:
    """32 requests, spread evenly over `adapters` ("" is the base model)."""
    out = []
    for i in range(REQUESTS):
        prompt = [(17 * i + 5 * j) % 1000 + 10 for j in range(PROMPT)]
        params = SamplingParams(
            max_tokens=OUTPUT, temperature=0.0, ignore_eos=True, adapter=adapters[i % len(adapters)]
        )
        out.append((f"r{i}", prompt, params))
    return out


def measure(model_path: Path, targets: tuple[str, ...]) -> dict:  # type: ignore[type-arg]
    from cluster.model.loader import load_model
    from decode_worker.engine import Engine

    class NoText:
        def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
            return ""

    model = load_model(model_path, "float32")
    cache = CacheConfig(block_size=16, num_blocks=REQUESTS * (PROMPT + OUTPUT) // 16 + 64)
    batching = SchedulerConfig(max_num_seqs=REQUESTS, max_num_batched_tokens=4096)
    lora = LoraConfig(max_loras=SLOTS, max_rank=RANK, targets=targets)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp), model.arch, SLOTS, targets)
        adapters = [read_adapter(p, model.arch, RANK, targets) for p in paths]
        names = [a.name for a in adapters]

        def engine(with_lora: bool) -> Engine:
            e = Engine(model, NoText(), cache, batching, lora=lora if with_lora else None)
            for adapter in adapters if with_lora else ():
                e.load_adapter(adapter)
            return e

        run(engine(False), [requests([""])[:4]])  # warm-up: the first passes of a process are slow
        rows["base"] = run(engine(False), [requests([""])])
        for n in (1, 4, 16):
            rows[f"{n} adapters mixed"] = run(engine(True), [requests(names[:n])])
        mixed = requests(names)
        by_adapter = [[r for r in mixed if r[2].adapter == name] for name in names]
        rows["16 adapters, one at a time"] = run(engine(True), by_adapter)
        slots = engine(True).adapters
        assert slots is not None
        weights = sum(p.nbytes for p in model.parameters())
        lora_bytes = slots.slots.nbytes
    for name, row in rows.items():
        row["bytes_per_step"] = weights + (0 if name == "base" else lora_bytes)
        row["tpot_vs_base"] = row["tpot_ms"] / rows["base"]["tpot_ms"]
    return {"rows": rows, "weight_bytes": weights, "lora_slot_bytes": lora_bytes}


def plot(results: dict, path: Path) -> None:  # type: ignore[type-arg]
    from benchmarks.plots import Panel, bar_panels

    rows = results["rows"]
    names = list(rows)
    bar_panels(path, names, [
        Panel([rows[n]["tpot_ms"] for n in names], "TPOT (ms)", f"batch {REQUESTS}: TPOT"),
        Panel([rows[n]["tokens_per_s"] for n in names], "output tokens/s", "throughput"),
    ])  # fmt: skip


def main() -> None:
    from cluster.cpu import cpu_kind, results_suffix

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo model")
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2, else the demo model)")
    parser.add_argument("--targets", default="q_proj,v_proj", help="the projections each adapter updates")
    args = parser.parse_args()
    model = Path(args.model) if args.model else DEMO if args.quick or not SMOLLM2.exists() else SMOLLM2
    targets = tuple(args.targets.split(","))
    results = measure(model, targets)
    kind = cpu_kind()
    results.update(model=model.name, cpu=kind, targets=list(targets), rank=RANK, slots=SLOTS, requests=REQUESTS)
    rows = results["rows"]
    mixed, one = rows["16 adapters mixed"], rows["16 adapters, one at a time"]
    results["goals"] = {
        "TPOT, 16 adapters mixed / base": (round(mixed["tpot_vs_base"], 2), "<= 1.3", mixed["tpot_vs_base"] <= 1.3),
        "tokens/s, mixed / one at a time": (
            round(mixed["tokens_per_s"] / one["tokens_per_s"], 2),
            ">= 3",
            mixed["tokens_per_s"] / one["tokens_per_s"] >= 3,
        ),
    }
    print(f"\nLoRA, {model.name} float32, batch {REQUESTS}, rank {RANK}, targets {','.join(targets)}, "
          f"{SLOTS} slots ({kind})")  # fmt: skip
    print(
        f"weights {results['weight_bytes'] / 1e6:.0f} MB; the slots' A and B {results['lora_slot_bytes'] / 1e6:.1f} MB"
    )
    print(f"{'row':<30}{'TPOT ms':>9}{'x base':>8}{'tok/s':>9}{'MB/step':>9}")
    for name, r in rows.items():
        mb = r["bytes_per_step"] / 1e6
        print(f"{name:<30}{r['tpot_ms']:>9.1f}{r['tpot_vs_base']:>8.2f}{r['tokens_per_s']:>9.0f}{mb:>9.0f}")
    print("\ngoals")
    for name, (value, goal, met) in results["goals"].items():
        print(f"  {name}: {value} (goal {goal}) {'met' if met else 'MISSED'}")
    suffix = results_suffix()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"lora{suffix}.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / f"lora{suffix}.png")
    print(f"\nwrote {OUT / f'lora{suffix}.json'} and {OUT / f'lora{suffix}.png'}")


if __name__ == "__main__":
    main()
