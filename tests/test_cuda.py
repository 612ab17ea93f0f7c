"""The same model and engine on CUDA. Skipped without a GPU; the CPU twins are test_model_vs_hf.py,
test_engine.py and test_engine.py's compiled-decode tests, which run the identical code on the CPU.
benchmarks/gpu_check.sh runs this file on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.request import SamplingParams
from cluster.generate import generate
from cluster.model.loader import load_model
from decode_worker.engine import Engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_cuda_logits_match_cpu(hf_models):
    folder, _ = hf_models["llama"]
    prompt = list(range(3, 40))
    cpu = generate(load_model(folder, "float32"), [prompt], 16, keep_logits=True)[0]
    gpu = generate(load_model(folder, "float32", "cuda"), [prompt], 16, keep_logits=True)[0]
    assert gpu.tokens == cpu.tokens
    for a, b in zip(gpu.logits, cpu.logits, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-3


def test_cuda_engine_matches_cpu_engine(hf_models):
    folder, _ = hf_models["qwen2"]
    cache = CacheConfig(block_size=16, num_blocks=64)
    sched = SchedulerConfig(max_num_seqs=8)

    def run(device):
        engine = Engine(load_model(folder, "float32", device), NoText(), cache, sched)
        for i in range(4):
            engine.add_request(f"r{i}", list(range(5, 12 + 3 * i)), SamplingParams(max_tokens=10, temperature=0))
        out = {}
        while engine.has_unfinished:
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return out

    assert run("cuda") == run("cpu")


def test_cuda_compiled_decode_matches_cpu_engine(hf_models):
    """Decode steps through the compiled graphs (one bucket of four rows, padded as rows finish) on
    CUDA give the CPU engine's greedy tokens."""
    folder, _ = hf_models["llama"]
    cache = CacheConfig(block_size=16, num_blocks=64)

    def run(device, buckets):
        model = load_model(folder, "float32", device)
        engine = Engine(model, NoText(), cache, SchedulerConfig(), compile_buckets=buckets)
        for i in range(4):
            engine.add_request(f"r{i}", list(range(5, 9 + 4 * i)), SamplingParams(max_tokens=8 + i, temperature=0))
        out = {}
        while engine.has_unfinished:
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return out, engine.runner.compiled.steps if engine.runner.compiled is not None else 0

    gpu, compiled_steps = run("cuda", (4,))
    assert compiled_steps > 0
    assert gpu == run("cpu", ())[0]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices (it refuses two ranks on one GPU)"
)
def test_kv_moves_between_two_cuda_processes_over_nccl_bit_for_bit():
    """The CPU twins: the Gloo path of the same code in test_disaggregated.py and test_kv_transport.py."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kv_nccl.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK:"), result.stdout
