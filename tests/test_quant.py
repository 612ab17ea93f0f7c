"""Quantisation: int8 / int4 weights and the int8 KV cache — the modules read the small weights,
quantised folders round-trip, and the quality cost stays within bounds on the demo model and a
random-weight model; an int8 cache serves a disaggregated request like a colocated one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cluster.config import CacheConfig, SchedulerConfig, TransferConfig
from cluster.engine.request import SamplingParams
from cluster.kv.transport import LocalSender, TransferState
from cluster.kv.wire import model_fingerprint
from cluster.model.arch import ModelFormatError
from cluster.model.builder import init_model_folder
from cluster.model.loader import load_model, save_quantized
from cluster.model.quality import agreement, heldout_windows, random_windows, score
from cluster.model.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8, weight_bytes
from cluster.model.tokenizer import Tokenizer
from decode_worker.engine import Engine
from decode_worker.kv_intake import KVIntake
from prefill_worker.engine import PrefillEngine

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantised_linears_compute_with_their_own_weights(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(5, 256, dtype=dtype)
    q8 = Int8Linear.from_linear(linear)
    assert q8.weight.dtype == torch.int8 and q8.weight.shape == (96, 256)
    w8, s8 = quantize_int8(linear.weight)
    ref8 = x.float() @ (w8.float() * s8[:, None]).T + linear.bias.float()
    assert torch.allclose(q8(x).float(), ref8, rtol=2e-2, atol=2e-2)
    q4 = Int4Linear.from_linear(linear, group_size=64)
    assert q4.nibbles.dtype == torch.uint8 and q4.nibbles.shape == (96, 128)  # two weights a byte
    v4, s4, low = quantize_int4(linear.weight, 64)
    assert torch.equal(q4.values(), v4)
    w4 = (low[..., None] + v4.view(96, 4, 64).float() * s4[..., None]).view(96, 256)
    assert torch.allclose(q4(x).float(), x.float() @ w4.T + linear.bias.float(), rtol=2e-2, atol=2e-2)
    err8 = (w8.float() * s8[:, None] - linear.weight.float()).abs().max()
    assert err8 <= linear.weight.float().abs().max() / 127  # half a step, with room for rounding
    assert (w4 - linear.weight.float()).abs().max() <= s4.max() * 0.51


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_run_dense_on_the_same_weights_as_the_kernel(dtype, monkeypatch):
    """A prompt's chunk dequantises the weights once and runs the dense product: the same weights as
    the weight-only kernel reads (exactly in float32; within bfloat16's rounding of each weight)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(300, 256, dtype=dtype)
    for q in (Int8Linear.from_linear(linear), Int4Linear.from_linear(linear, group_size=64)):
        assert len(x) >= q.dense_from_rows > 1
        w = q.dense()
        assert w.dtype == dtype and w.shape == (96, 256)
        dense = q(x)  # dense: as many rows as a prompt's chunk
        monkeypatch.setattr(type(q), "dense_from_rows", len(x) + 1)
        kernel = q(x)  # the weight-only kernel, the same rows
        monkeypatch.undo()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(dense.float(), kernel.float(), rtol=tol, atol=tol), type(q).__name__
        assert torch.allclose(dense.float(), x.float() @ w.float().T + linear.bias.float(), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def demo():
    tok = Tokenizer(DEMO)
    return heldout_windows(DEMO, tok, length=256, count=8)


# (weights, int4 group, KV cache) -> (largest loss increase, least top-1 agreement) on the demo model
BOUNDS = {
    ("int8", 128, "auto"): (0.01, 0.95),
    ("int4", 32, "auto"): (0.02, 0.85),
    ("int4", 128, "auto"): (0.02, 0.85),
    ("auto", 128, "int8"): (0.01, 0.95),
    ("int8", 128, "int8"): (0.01, 0.95),
}


@pytest.mark.parametrize("setting", list(BOUNDS), ids=lambda s: f"w-{s[0]}-g{s[1]}-kv-{s[2]}")
def test_quality_on_the_demo_model(demo, setting):
    weights, group, kv = setting
    max_loss, min_agree = BOUNDS[setting]
    reference = score(load_model(DEMO, "bfloat16"), demo)
    quantised = score(load_model(DEMO, "bfloat16", weight_dtype=weights, group_size=group), demo, kv)
    assert quantised.loss <= reference.loss * (1 + max_loss)
    assert agreement(quantised, reference) >= min_agree


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return init_model_folder(tmp_path_factory.mktemp("tiny"), "tiny", dtype="bfloat16", seed=0)


@pytest.mark.parametrize("setting", [("int8", "auto", 0.95), ("int4", "auto", 0.75), ("auto", "int8", 0.95)])
def test_quality_on_a_random_weight_model(random_model, setting):
    """Random weights have no text of their own: the windows are random tokens, and the check is
    that the quantised model predicts what the unquantised one does."""
    weights, kv, min_agree = setting
    windows = random_windows(512, length=256, count=4)
    reference = score(load_model(random_model, "bfloat16"), windows)
    quantised = score(load_model(random_model, "bfloat16", weight_dtype=weights, group_size=32), windows, kv)
    assert agreement(quantised, reference) >= min_agree
    assert abs(quantised.loss - reference.loss) <= 0.02 * reference.loss


@pytest.mark.parametrize(("kv", "min_agree"), [("float16", 0.99), ("bfloat16", 0.95)])
def test_a_16_bit_cache_under_a_float32_model_predicts_what_the_float32_cache_does(random_model, kv, min_agree):
    windows = random_windows(512, length=256, count=4)
    model = load_model(random_model, "float32")
    reference, half = score(model, windows), score(model, windows, kv)
    assert agreement(half, reference) >= min_agree
    assert abs(half.loss - reference.loss) <= 0.005 * reference.loss
    with pytest.raises(ValueError, match="holds a float32 or float16 model's KV"):
        score(load_model(random_model, "bfloat16"), windows, "float16")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_quantised_folder_loads_as_it_was_saved(tmp_path, weights):
    model = load_model(DEMO, "bfloat16", weight_dtype=weights, group_size=32)
    full = load_model(DEMO, "bfloat16")
    assert weight_bytes(model) < (0.55 if weights == "int8" else 0.35) * weight_bytes(full)
    save_quantized(model, DEMO, tmp_path / "q")
    again = load_model(tmp_path / "q", "bfloat16")
    assert model_fingerprint(again, again.arch) == model_fingerprint(model, model.arch)
    assert model_fingerprint(again, again.arch) != model_fingerprint(full, full.arch)
    windows = heldout_windows(DEMO, Tokenizer(DEMO), length=64, count=2)
    assert torch.equal(score(again, windows).predictions, score(model, windows).predictions)
    size = (tmp_path / "q" / "model.safetensors").stat().st_size  # with the bfloat16 embedding table kept
    assert size < (0.75 if weights == "int8" else 0.5) * (DEMO / "model.safetensors").stat().st_size
    with pytest.raises(ValueError, match="cannot load as"):
        load_model(tmp_path / "q", "bfloat16", weight_dtype="int4" if weights == "int8" else "int8")


def test_a_damaged_quantised_folder_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_quantized(load_model(DEMO, "bfloat16", weight_dtype="int8"), DEMO, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.0.mlp.down_proj.scales"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"layers\.0\.mlp\.down_proj\.scales"):
        load_model(tmp_path, "bfloat16")


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.parametrize(("dtype", "weights", "kv"), [("bfloat16", "int8", "int8"), ("float32", "auto", "float16")])
def test_a_quantised_or_16_bit_cache_prefilled_elsewhere_decodes_like_one_engine(dtype, weights, kv):
    """The KV crosses from a prefill worker's pool to a decode worker's as it is stored: int8 rows with
    their scales, or a float32 model's keys and values in float16."""
    model = load_model(DEMO, dtype, weight_dtype=weights)
    cache = CacheConfig(block_size=16, num_blocks=128, kv_dtype=kv)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = Tokenizer(DEMO).encode("class Stack:\n    def __init__(self):\n        self.items = []\n")
    alone = Engine(model, NoText(), cache, SchedulerConfig())
    alone.add_request("a", prompt, params)
    want = []
    while alone.has_unfinished:
        want += [t for out in alone.step() for t in out.token_ids]
    decode = Engine(model, NoText(), cache, SchedulerConfig())
    intake = KVIntake(decode, model_fingerprint(model, model.arch))
    prefill = PrefillEngine(model, cache, SchedulerConfig(), TransferConfig(), num_blocks=128)
    prefill.add_request("a", prompt, params, LocalSender(intake))
    (out,) = prefill.step()
    assert out.transfer.wait(10) is TransferState.DONE
    got = []
    while decode.has_unfinished:
        got += [t for o in decode.step() for t in o.token_ids]
    assert got == want
