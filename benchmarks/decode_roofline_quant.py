"""Section 4 of `decode_roofline.py`: fewer bytes per token. The same model with int8 and int4
weights and an int8 KV cache (and, for a GGUF file of Q4 blocks, those blocks kept as int4), each
setting's decode step against bfloat16's in the same run, transformers' bfloat16 step beside."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from decode_roofline_measure import CONTEXT, _NoText, hf_token_time, measure_bandwidth, tandem_step_time

from cluster.config import CacheConfig, SchedulerConfig
from cluster.model.loader import load_model
from decode_worker.engine import Engine

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
    activations: str = "bfloat16",
) -> list[dict]:
    """Section 4: each setting's compiled decode step against the unquantised one (`activations`,
    the model's dtype: bfloat16, or float32 as `dtype: auto` gives a CPU without native bfloat16
    products), same run; `kept`: a folder of int4 weights kept from a GGUF file's Q4 blocks, run as
    one more setting; `chosen`: the labels to run (None: all); `eager`: steps not compiled (minutes
    of compilation saved per setting where inductor is slow)."""
    from cluster.model.attention import kv_row_bytes
    from cluster.model.quant import weight_bytes

    mode = "eager" if eager else "compiled"
    print(f"\nfewer bytes per token ({activations} activations, {mode} decode, {CONTEXT}-token context)")
    print(f"{'setting':<22}{'batch':>6}{'ms/step':>10}{'MB/step':>10}{'GB/s':>8}{'bw GB/s':>8}{'roofline':>10}"
          f"{'vs base':>9}")  # fmt: skip
    rows: list[dict] = []
    base_label = QUANT_SETTINGS[0][0]  # the unquantised setting, named by its dtype
    settings = [(activations if label == base_label else label, weights, kv, folder)
                for label, weights, kv in QUANT_SETTINGS]  # fmt: skip
    settings += [("int4 kept (file's Q4)", "int4", "auto", kept)] if kept is not None else []
    if chosen is not None:
        unknown = chosen - {label for label, *_ in settings}
        if unknown:
            raise SystemExit(f"unknown settings {sorted(unknown)}; known: {[label for label, *_ in settings]}")
        settings = [s for s in settings if s[0] in chosen]
    for label, weights, kv, source in settings:
        torch._dynamo.reset()  # each setting compiles its own graphs
        quantise = weights if source == folder else "auto"  # a kept folder loads as it was written
        model = load_model(source, activations, "cpu", weight_dtype=quantise, group_size=128)
        arch = model.arch
        cache = CacheConfig(block_size=16, num_blocks=max(batches) * (768 // 16 + 2), kv_dtype=kv)
        buckets = () if eager else batches
        engine = Engine(model, _NoText(), cache, SchedulerConfig(max_num_seqs=64), compile_buckets=buckets)
        start = time.perf_counter()
        if not eager:
            engine.runner.compiled.warm_up(engine.runner.kv_cache)
        compile_s = time.perf_counter() - start
        row_bytes = kv_row_bytes(arch.head_dim, model.embed_tokens.weight.element_size(), kv)
        for batch in batches:
            t, bw, _ = tandem_step_time(engine, batch, "cpu", repeat, matmul=False)  # section 4 needs bandwidth only
            kv_bytes = batch * CONTEXT * arch.num_layers * 2 * arch.num_kv_heads * row_bytes
            nbytes = weight_bytes(model) + kv_bytes
            base = next((r["step_s"] for r in rows if r["batch"] == batch and r["setting"] == activations), t)
            rows.append({"setting": label, "weights": weights, "kv": kv, "batch": batch, "step_s": t,
                         "bytes": nbytes, "weight_bytes": weight_bytes(model), "kv_bytes": kv_bytes,
                         "GBps": nbytes / t / 1e9, "bandwidth_GBps": bw / 1e9, "roofline_frac": nbytes / t / bw,
                         "speedup_vs_bf16": base / t, "activations": activations, "compile_s": compile_s})  # fmt: skip
            print(f"{label:<22}{batch:>6}{t * 1e3:>10.2f}{nbytes / 1e6:>10.1f}{nbytes / t / 1e9:>8.1f}"
                  f"{bw / 1e9:>8.1f}{nbytes / t / bw:>9.0%}{base / t:>8.2f}x")  # fmt: skip
        del model, engine
    rows += transformers_rows(folder, batches, rows) if activations == "bfloat16" else []
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
