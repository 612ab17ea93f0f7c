"""Structured output through a cluster: the router, a prefill worker and two decode workers serving
real gRPC on loopback in this process, KV shipped over `grpc`, one decode worker speculating with
n-gram lookup and the other with the draft model. Every kind of constraint, with local and remote
prefill, greedy and seeded: every output validates and equals one plain engine's; a decode
worker stopped mid-stream loses nothing (the matcher is replayed where the requests move); bad
constraints are refused before any worker reserves a block."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.config import parse_config
from cluster.engine.request import SamplingParams
from cluster.engine.structured import for_tokenizer
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from decode_worker import service as decode_service
from decode_worker.engine import Engine
from prefill_worker import service as prefill_service
from router.sdk.client import Choice, Client, Grammar, InvalidArgument, JsonObject, JsonSchema, Regex
from router.service import server as router_server
from tests.test_structured import CHOICES, CONSTRAINTS, DEMO, DRAFT, LARK, REGEX, SCHEMA, check

LOCAL_MAX = 8  # prompts up to this many tokens are prefilled on the decode worker
TIGHT_BLOCKS = 10  # of 16 tokens: the 16 requests need up to 8 each
TYPED = {
    "json_schema": JsonSchema(SCHEMA),
    "json_object": JsonObject(),
    "regex": Regex(REGEX),
    "grammar": Grammar(LARK),
    "choice": Choice(CHOICES),
}
# Short prompts (local prefill) and long ones (remote prefill); json_object is left out: it has no
# bound on its length, and the demo model can ramble inside one (tests/test_structured.py).
KINDS = ["json_schema", "regex", "grammar", "choice"]
PROMPTS = ["x = ", "def parse(text):\n    # returns the config as a dict\n    result = {}\n    for line in text:\n"]


def config(speculative: dict | None = None):  # type: ignore[no-untyped-def,type-arg]
    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 256},
            # The engine on the worker's thread: the core process is test_engine_core.py's and the Ray modules'.
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 256, "engine_core": "thread"},
            "router": {"local_prefill_max_tokens": LOCAL_MAX, "migration_limit": 3, "prefix_routing": "random"},
            "speculative": speculative or {},
        }
    )


# decode-0 speculates with n-gram lookup, decode-1 with the draft model; the reference does not.
SPECULATIVE = [
    {"method": "ngram", "num_tokens": 4},
    {"method": "draft", "num_tokens": 4, "draft_model": str(DRAFT), "draft_memory_gib": 0.02},
]


@pytest.fixture(scope="module")
def cluster():
    cfg = config()
    decodes = {f"decode-{i}": decode_service.from_config(config(s), f"decode-{i}") for i, s in enumerate(SPECULATIVE)}
    prefill = prefill_service.from_config(cfg, "prefill-0")
    workers = {name: w.start() for name, w in decodes.items()} | {"prefill-0": prefill.start()}
    live = dict(workers)
    router = router_server.from_config(cfg, lambda: live)
    address = router.start()
    yield address, router, decodes, prefill, live
    router.stop()
    prefill.stop()
    for w in decodes.values():
        w.stop()


def requests():  # type: ignore[no-untyped-def]
    """{id: (prompt, kind, sampling)}: every kind on each prompt, greedy and seeded."""
    out = {}
    for p, prompt in enumerate(PROMPTS):
        for kind in KINDS:
            out[f"{kind}-{p}-g"] = (prompt, kind, {"temperature": 0.0})
            out[f"{kind}-{p}-s"] = (prompt, kind, {"temperature": 0.8, "seed": 100 * p + len(kind)})
    return out


@pytest.fixture(scope="module")
def reference():
    """Every request alone in one engine in this process."""
    model, tok = load_model(DEMO, "float32"), Tokenizer(DEMO)
    cfg = config()
    grammars = for_tokenizer(tok, model.arch.vocab_size, tok.eos_token_ids)
    engine = Engine(model, tok, cfg.cache, cfg.scheduler, tok.eos_token_ids, grammars=grammars)
    for rid, (prompt, kind, sampling) in requests().items():
        params = SamplingParams(max_tokens=96, structured=CONSTRAINTS[kind], **sampling)  # type: ignore[arg-type]
        engine.add_request(rid, tok.encode(prompt), params)
    out: dict[str, list[int]] = {rid: [] for rid in requests()}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


def run_all(address: str, progress: dict[str, int] | None = None):  # type: ignore[no-untyped-def]
    results, errors = {}, []

    def one(rid: str, prompt: str, kind: str, sampling: dict) -> None:  # type: ignore[type-arg]
        tokens, text, placement = [], "", ""
        try:
            with Client(address, timeout=300, retries=0) as client:
                for delta in client.stream(prompt, max_tokens=96, structured=TYPED[kind], **sampling):
                    tokens += delta.token_ids
                    text += delta.text
                    if progress is not None:
                        progress[rid] = len(tokens)
                placement = client.generate(prompt, max_tokens=1, **sampling).metadata["tandem-prefill"]
        except Exception as e:  # reported below: no request may fail
            errors.append((rid, e))
        results[rid] = (tokens, text, placement)

    threads = [threading.Thread(target=one, args=(rid, *r)) for rid, r in requests().items()]
    for t in threads:
        t.start()
    return threads, results, errors


def assert_undisturbed(threads, results, errors, reference) -> None:  # type: ignore[no-untyped-def]
    """Once every request ended: none failed, and each output validates and equals one engine's."""
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    for rid, (_, kind, _) in requests().items():
        tokens, text, _ = results[rid]
        check(kind, text)
        assert tokens == reference[rid], rid


def test_every_kind_validates_with_local_and_remote_prefill_and_equals_one_engine(cluster, reference):
    address, _, decodes, _, _ = cluster
    threads, results, errors = run_all(address)
    assert_undisturbed(threads, results, errors, reference)
    placements = {r[2].split(":")[0] for r in results.values()}
    assert placements == {"local", "remote"}, placements
    # Speculation kept drafts of constrained requests (how many land on each worker is placement's
    # draw, and n-gram lookup finds little to propose in short structured outputs).
    accepted = {n: w.telemetry.metrics.spec_accepted_tokens._value.get() for n, w in decodes.items()}
    assert sum(accepted.values()) > 0, accepted


@pytest.fixture
def tight():
    """A router, a prefill worker and one decode worker, speculating with the draft model, whose
    KV cache holds about half of what the load needs: it preempts (and recomputes) sequences."""
    cfg = config(SPECULATIVE[1])
    cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"num_blocks": TIGHT_BLOCKS, "watermark": 0.0})})
    decode = decode_service.from_config(cfg, "decode-0")
    prefill = prefill_service.from_config(config(), "prefill-0")
    workers = {"decode-0": decode.start(), "prefill-0": prefill.start()}
    router = router_server.from_config(config(), lambda: workers)
    yield router.start(), decode, prefill
    router.stop()
    prefill.stop()
    decode.stop()


def test_under_preemption_every_kind_validates_and_equals_one_engine(tight, reference):
    address, decode, prefill = tight
    assert_undisturbed(*run_all(address), reference)
    assert decode.engine.occupancy.preemptions > 0, "the KV budget should force preemptions"
    assert decode.engine.occupancy.free_blocks == decode.engine.occupancy.total_blocks
    deadline = time.monotonic() + 10
    while prefill.engine.engine.scheduler.held:  # each transfer's answer releases the prefill worker's blocks
        assert time.monotonic() < deadline, "the prefill worker still holds sent KV"
        time.sleep(0.05)


def test_bad_constraints_are_refused_and_nothing_is_reserved(cluster):
    address, _, decodes, prefill, _ = cluster
    deadline = time.monotonic() + 30
    while prefill.engine.engine.scheduler.held or any(w.engine.has_unfinished for w in decodes.values()):
        assert time.monotonic() < deadline, "the cluster never went idle"
        time.sleep(0.05)
    bad = [
        JsonSchema('{"type": "objectx"}'), Regex("a(b"), Grammar("start: foo"), JsonSchema({"if": {}}),
        Regex("(a{1000}){1000}"),  # small, but past the matcher's limits
    ]  # fmt: skip
    with Client(address, timeout=60) as client:
        for constraint in bad:
            for prompt in PROMPTS:  # local and remote prefill alike
                with pytest.raises(InvalidArgument, match="structured"):
                    client.generate(prompt, max_tokens=8, structured=constraint)
        with pytest.raises(InvalidArgument, match="beam search"):
            client.generate(PROMPTS[0], max_tokens=8, num_beams=2, structured=Regex("a+"))
    for w in decodes.values():
        assert w.engine.occupancy.free_blocks == w.engine.occupancy.total_blocks
        assert w.engine.occupancy.running == w.engine.occupancy.waiting == 0
    assert not prefill.engine.engine.scheduler.held and not prefill.engine.engine.scheduler.has_work


def test_a_decode_worker_stopped_mid_stream_loses_nothing(cluster, reference):
    """The broken requests move to the other decode worker with the tokens they streamed; its
    matcher replays them, and every output is the undisturbed one."""
    address, router, decodes, _, live = cluster
    progress: dict[str, int] = {}
    threads, results, errors = run_all(address, progress)
    victim = decodes["decode-0"]
    deadline = time.monotonic() + 120
    while sum(1 for n in progress.values() if n >= 3) < 4 or not victim.engine.occupancy.running:
        assert time.monotonic() < deadline, "the load never got going on decode-0"
        time.sleep(0.01)
    before = router.telemetry.metrics.migrations.labels("decode")._value.get()
    del live["decode-0"]
    victim.stop()
    assert_undisturbed(threads, results, errors, reference)
    assert router.telemetry.metrics.migrations.labels("decode")._value.get() > before
