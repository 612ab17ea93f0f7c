"""Speculative decoding and beam search through the public API: the router, a prefill and a decode
worker in this process on loopback, reached with the client SDK. The counts reach the final
message, the decode worker's metrics and the trace."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tandem.v1 import api_pb2

from cluster.config import CacheConfig, SchedulerConfig, parse_config
from cluster.engine.request import SamplingParams
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from decode_worker import service as decode_service
from decode_worker.engine import Engine
from prefill_worker import service as prefill_service
from router.sdk.client import Client, InvalidArgument
from router.service import server as router_server

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
DRAFT = ROOT / "models" / "tandem-demo-code-draft"
PROMPT = "    def __init__(self, x):\n        self.x = x\n\n    def __init__(self, "


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spans = tmp_path_factory.mktemp("spans")
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": "thread"},  # the core process: test_engine_core.py, the Ray modules
            "cache": {"block_size": 16, "num_blocks": 256},
            "speculative": {"method": "draft", "draft_model": str(DRAFT), "num_tokens": 4, "draft_memory_gib": 0.02},
            "router": {"local_prefill_max_tokens": 8},
            "telemetry": {"exporter": "console", "console_dir": str(spans)},
        }
    )
    decode = decode_service.from_config(config, "decode-0")
    prefill = prefill_service.from_config(config, "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = router_server.from_config(config, lambda: workers)
    client = Client(router.start(), timeout=120)
    yield client, decode, spans
    client.close()
    router.stop()
    prefill.stop()
    decode.stop()


def plain_engine() -> Engine:
    tok = Tokenizer(DEMO)
    cache = CacheConfig(block_size=16, num_blocks=256)
    return Engine(load_model(DEMO, "float32"), tok, cache, SchedulerConfig(), tok.eos_token_ids)


def run_alone(engine: Engine, prompt: list[int], params: SamplingParams):
    engine.add_request("x", prompt, params)
    tokens, last = [], None
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.token_ids
            last = out
    return tokens, last


def test_speculative_greedy_output_is_plain_output_and_its_counts_are_reported(cluster):
    client, decode, spans = cluster
    tok = Tokenizer(DEMO)
    prompt = tok.encode(PROMPT)
    want, _ = run_alone(plain_engine(), prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    done = client.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
    assert done.token_ids == want
    spec = done.speculation
    assert spec is not None and spec.draft_tokens > 0 and 0 < spec.accepted_tokens <= spec.draft_tokens
    assert spec.target_passes + spec.accepted_tokens == 40
    assert spec.tokens_per_pass == pytest.approx(40 / spec.target_passes)
    assert spec.acceptance_rate == pytest.approx(spec.accepted_tokens / spec.draft_tokens)
    off = client.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True, speculative_tokens=0)
    assert off.token_ids == want and off.speculation is None
    registry = decode.telemetry.metrics.registry
    assert registry.get_sample_value("tandem_spec_draft_tokens_total") >= spec.draft_tokens
    assert registry.get_sample_value("tandem_spec_accepted_tokens_total") >= spec.accepted_tokens
    assert registry.get_sample_value("tandem_spec_tokens_per_pass_count") >= 1
    deadline, decode_spans = time.monotonic() + 10, []
    while not decode_spans and time.monotonic() < deadline:
        lines = [json.loads(line) for f in spans.glob("*.jsonl") for line in f.read_text().splitlines()]
        decode_spans = [s for s in lines if s["name"] == "decode" and "tandem.spec.draft_tokens" in s["attributes"]]
        time.sleep(0.1)
    assert decode_spans, "the decode span carries the speculation counts"
    roots = [s for s in lines if s["name"] == "router.generate" and "tandem.spec.tokens_per_pass" in s["attributes"]]
    assert roots and roots[0]["attributes"]["tandem.spec.accepted_tokens"] == spec.accepted_tokens


def test_beam_search_through_the_router_returns_every_beam(cluster):
    client, _, _ = cluster
    tok = Tokenizer(DEMO)
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(")  # longer than local_prefill_max_tokens
    params = SamplingParams(max_tokens=12, num_beams=3, length_penalty=0.5, early_stopping="never")
    _, want = run_alone(plain_engine(), prompt, params)
    done = client.generate(
        prompt, max_tokens=12, num_beams=3, length_penalty=0.5, early_stopping=api_pb2.EARLY_STOPPING_NEVER
    )
    assert done.metadata["tandem-prefill"].startswith("local")  # the prompt's logits are needed on the decode worker
    assert [b.token_ids for b in done.beams] == [b.token_ids for b in want.beams]
    assert [b.score for b in done.beams] == pytest.approx([b.score for b in want.beams], abs=1e-5)
    assert done.token_ids == done.beams[0].token_ids and done.text == done.beams[0].text
    assert done.beams[0].score >= done.beams[1].score >= done.beams[2].score


@pytest.mark.parametrize(
    "sampling, field",
    [
        (dict(num_beams=2, stop=["x"]), "sampling"),
        (dict(num_beams=2, logprobs=1), "sampling"),
        (dict(num_beams=17), "sampling.num_beams"),
        (dict(num_beams=2, speculative_tokens=3), "sampling"),
    ],
)
def test_unsupported_combinations_are_invalid_argument(cluster, sampling, field):
    client, _, _ = cluster
    with pytest.raises(InvalidArgument, match=field):
        client.generate("def f(", max_tokens=4, **sampling)
