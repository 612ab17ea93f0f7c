"""Speculative decoding: proposers, the acceptance rule, and the engine with drafts in the batch.

Greedy speculation must give exactly the tokens of plain decoding; sampled speculation must keep
the target model's distribution."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cluster.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from cluster.engine.request import Request, SamplingParams
from cluster.engine.sampler import Draft, Sampler, SampleRow
from cluster.engine.speculative import DraftProposer, NgramProposer, build_proposer, lookup
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from decode_worker.engine import Engine
from tests.conftest import drive

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
DRAFT = ROOT / "models" / "tandem-demo-code-draft"
TIGHT = CacheConfig(block_size=4, num_blocks=90, watermark=0.0)
ROOMY = CacheConfig(block_size=4, num_blocks=2000, watermark=0.0)
BATCHING = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, long_prefill_chunk=64)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]):  # type: ignore[no-untyped-def]
    """`drive`, also checking the draft model's blocks when there is one: (tokens, final outputs)."""
    draft = engine.proposer.blocks if isinstance(engine.proposer, DraftProposer) else None
    streamed, finals = drive(engine, requests, draft.check_integrity if draft else None)
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks, "draft KV blocks leaked"
    return streamed, finals


def test_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(tokens, 2, max_n=3, min_n=2) == [7, 8]  # the later "1 2 3" wins over the first
    assert lookup(tokens, 10, max_n=3, min_n=2) == [7, 8, 5, 1, 2, 3]
    assert lookup([4, 5, 6, 7], 3, max_n=3, min_n=1) == []
    assert lookup([4, 5, 4], 3, max_n=3, min_n=1) == [5, 4]
    assert lookup(tokens, 0, max_n=3, min_n=2) == []


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO, "float32"), Tokenizer(DEMO)


def demo_requests(
    tok: Tokenizer, n: int, seed: int = 0, temperature: float = 0.0
) -> dict[str, tuple[list[int], SamplingParams]]:
    """Snippets of held-out Python, half of them with their own text repeated (output that copies
    from the prompt), mixed speculation settings and lengths; sampled ones (`temperature` > 0)
    each with its own seed."""
    rng = random.Random(seed)
    ids = tok.encode((DEMO / "heldout_eval.txt").read_text(encoding="utf-8"))
    out = {}
    for i in range(n):
        start = rng.randrange(0, len(ids) - 200)
        prompt = ids[start : start + rng.randint(8, 48)]
        if i % 2:
            prompt = prompt + prompt[: len(prompt) // 2]
        k = [None, 0, 1, 2, 4][i % 5]
        params = SamplingParams(
            max_tokens=rng.randint(4, 40), temperature=temperature, speculative_tokens=k, ignore_eos=True,
            seed=1000 + i if temperature else None,
        )  # fmt: skip
        out[f"r{i}"] = (prompt, params)
    return out


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_equals_plain_decoding_in_a_mixed_batch_under_preemption(demo, method):
    model, tok = demo
    requests = demo_requests(tok, 24)
    plain, _ = run(Engine(model, tok, ROOMY, BATCHING), requests)
    config = SpeculativeConfig(method=method, num_tokens=4, draft_model=DRAFT, draft_memory_gib=0.01)
    proposer = build_proposer(config, model, TIGHT.block_size)
    engine = Engine(model, tok, TIGHT, BATCHING, proposer=proposer, num_speculative_tokens=config.num_tokens)
    tokens, finals = run(engine, requests)
    assert tokens == plain
    assert engine.scheduler.stats.num_preemptions > 0, "the KV budget should force preemptions while speculating"
    accepted = sum(f.num_accepted_tokens for f in finals.values())
    assert accepted > 20, "drafts should be accepted often on this workload"
    for rid, (_, params) in requests.items():
        f = finals[rid]
        assert f.num_output_tokens == params.max_tokens
        if params.speculative_tokens == 0:
            assert f.num_draft_tokens == 0 and f.num_passes == params.max_tokens
        assert f.num_passes + f.num_accepted_tokens == f.num_output_tokens  # each pass: accepted drafts + 1
        assert f.num_accepted_tokens <= f.num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_speculation_equals_plain_seeded_decoding_under_preemption(demo, method):
    """A seeded sampled request's tokens are plain seeded decoding's, whatever was drafted,
    accepted or rolled back, and whatever preemption recomputed."""
    model, tok = demo
    requests = demo_requests(tok, 12, seed=2, temperature=0.5)
    plain, _ = run(Engine(model, tok, ROOMY, BATCHING), requests)
    config = SpeculativeConfig(method=method, num_tokens=4, draft_model=DRAFT, draft_memory_gib=0.01)
    proposer = build_proposer(config, model, TIGHT.block_size)
    tight = CacheConfig(block_size=4, num_blocks=60, watermark=0.0)
    engine = Engine(model, tok, tight, BATCHING, seed=7, proposer=proposer, num_speculative_tokens=4)
    tokens, finals = run(engine, requests)
    assert tokens == plain
    assert engine.scheduler.stats.num_preemptions > 0
    assert sum(f.num_accepted_tokens for f in finals.values()) > 0, "some drafts should be kept"
    assert any(f.num_accepted_tokens < f.num_draft_tokens for f in finals.values()), "and some rejected"


@pytest.mark.slow
def test_compiled_speculation_equals_plain_decoding(demo):
    """Verification passes and the draft model's passes through compiled graphs (each new token a
    decode row), under preemption: the tokens of eager plain decoding."""
    model, tok = demo
    requests = demo_requests(tok, 12, seed=5)
    plain, _ = run(Engine(model, tok, ROOMY, BATCHING), requests)
    config = SpeculativeConfig(method="draft", num_tokens=4, draft_model=DRAFT, draft_memory_gib=0.01)
    proposer = build_proposer(config, model, TIGHT.block_size, compile_buckets=(8,))
    engine = Engine(
        model, tok, TIGHT, BATCHING, compile_buckets=(8, 24), proposer=proposer, num_speculative_tokens=4
    )  # fmt: skip
    tokens, finals = run(engine, requests)
    assert tokens == plain
    assert engine.scheduler.stats.num_preemptions > 0
    assert sum(f.num_accepted_tokens for f in finals.values()) > 10
    assert isinstance(proposer, DraftProposer) and proposer.compiled is not None
    assert engine.runner.compiled.steps > 0 and proposer.compiled.steps > 0


@pytest.mark.slow
def test_a_decode_worker_with_compile_buckets_compiles_them_before_serving(demo):
    """`model.compile_buckets` in a deployment's config: the decode worker's target and draft graphs
    are compiled when the worker is built, and its steps then run through them."""
    from cluster.config import parse_config
    from decode_worker import service

    config = parse_config({
        "model": {"path": str(DEMO), "dtype": "float32", "compile_buckets": [8]},
        "cache": {"block_size": 4, "num_blocks": 400},
        "speculative": {"method": "draft", "draft_model": str(DRAFT), "draft_memory_gib": 0.01, "num_tokens": 3},
        "scheduler": {"engine_core": "thread"},  # its engine is stepped and inspected here
    })  # fmt: skip
    worker = service.from_config(config, "decode-0")
    try:
        engine = worker.engine.engine
        proposer = engine.proposer
        assert isinstance(proposer, DraftProposer) and proposer.compiled is not None
        assert engine.runner.compiled is not None and engine.runner.compiled.buckets == [8]
        warm_steps = engine.runner.compiled.steps, proposer.compiled.steps
        assert warm_steps == (1, 1), "one warm-up step per bucket, before any request"
        model, tok = demo
        requests = demo_requests(tok, 4, seed=9)
        plain, _ = run(Engine(model, tok, ROOMY, BATCHING), requests)
        assert run(engine, requests)[0] == plain
        assert engine.runner.compiled.steps > warm_steps[0] and proposer.compiled.steps > warm_steps[1]
    finally:
        worker.telemetry.shutdown()


def test_draft_proposer_frees_its_blocks_and_the_engine_trims_rejected_ones(demo):
    model, tok = demo
    requests = demo_requests(tok, 8, seed=3)
    plain, _ = run(Engine(model, tok, ROOMY, BATCHING), requests)
    proposer = build_proposer(SpeculativeConfig(method="draft", draft_model=DRAFT, draft_memory_gib=0.01), model, 4)
    assert run(Engine(model, tok, ROOMY, BATCHING, proposer=proposer, num_speculative_tokens=3), requests)[0] == plain


def test_speculation_stops_at_stop_strings_and_max_tokens_like_plain_decoding(demo):
    model, tok = demo
    ids = tok.encode("    def __init__(self, x):\n        self.x = x\n\n    def __init__(self, ")
    cases = {
        "stop": (ids, SamplingParams(max_tokens=30, temperature=0.0, stop=("\n",), ignore_eos=True)),
        "length": (ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
        "min": (ids, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)),
    }

    def texts(engine: Engine) -> dict[str, tuple[str, str | None, list[int]]]:
        for rid, (prompt, params) in cases.items():
            engine.add_request(rid, prompt, params)
        got: dict[str, list] = {rid: ["", None, []] for rid in cases}
        while engine.has_unfinished:
            for out in engine.step():
                got[out.request_id][0] += out.text
                got[out.request_id][1] = out.finish_reason
                got[out.request_id][2] += out.token_ids
        return {rid: tuple(v) for rid, v in got.items()}  # type: ignore[misc]

    plain = texts(Engine(model, tok, ROOMY, BATCHING))
    spec = texts(Engine(model, tok, ROOMY, BATCHING, proposer=NgramProposer(), num_speculative_tokens=6))
    assert spec == plain
    assert plain["stop"][1] == "stop" and "\n" not in plain["stop"][0]


# -- the acceptance rule keeps the target distribution ---------------------------------------------


def row(temperature: float = 1.0, seed: int | None = None) -> SampleRow:
    return SampleRow(SamplingParams(temperature=temperature, seed=seed), [1], [])


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-probs", "point-mass"])
def test_acceptance_rule_reproduces_the_target_distribution(deterministic):
    torch.manual_seed(0)
    vocab, n = 6, 20000
    p = torch.softmax(torch.randn(vocab) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab) * 1.5, -1)
    assert tv(p, q) > 0.2, "the draft must differ from the target for the test to mean anything"
    sampler = Sampler(vocab, seed=1)
    logits = torch.stack([p.log(), p.log()])  # target rows before and after the draft token
    rows = [row(), row()]
    draws = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(2)).tolist()
    counts = torch.zeros(vocab)
    kept = 0
    for x in draws:
        x = 3 if deterministic else x
        draft = Draft((x,)) if deterministic else Draft((x,), q[None, :])
        result = sampler.verify(logits, rows, [draft])
        counts[result.token_ids[0][0]] += 1
        kept += result.accepted[0]
    assert tv(counts / n, p) < 0.02
    expected = float(p[3]) if deterministic else float(torch.minimum(p, q).sum())  # P(accept)
    assert abs(kept / n - expected) < 0.02


def test_greedy_verification_keeps_the_agreeing_prefix_then_corrects():
    sampler = Sampler(5)
    logits = torch.full((4, 5), -5.0)
    for i, best in enumerate([2, 4, 1, 3]):
        logits[i, best] = 5.0
    rows = [row(temperature=0.0)] * 4
    assert sampler.verify(logits, rows, [Draft((2, 4, 0))]).token_ids == [[2, 4, 1]]
    assert sampler.verify(logits, rows, [Draft((2, 4, 1))]).token_ids == [[2, 4, 1, 3]]  # all kept + bonus
    assert sampler.verify(logits[:1], rows[:1], [Draft(())]).token_ids == [[2]]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target with an 8-token vocabulary, and a draft: the target with noise on every weight."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=8, max_position_embeddings=64, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    target = tmp_path_factory.mktemp("vocab8-target")
    model.save_pretrained(target)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn_like(w) * 0.3)
    draft = tmp_path_factory.mktemp("vocab8-draft")
    model.save_pretrained(draft)
    return load_model(target, "float32"), load_model(draft, "float32")


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.slow
def test_speculative_sampling_keeps_the_models_distribution_end_to_end(tiny_pair):
    """3000 seeded requests sample three tokens each through the engine with the draft model
    proposing two; the distribution of the first two tokens must fit the target model's exact one
    (chi-square, 63 degrees of freedom), while the draft's own distribution clearly would not."""
    target, draft = tiny_pair
    prompt, n, vocab = [1, 5, 2], 3000, 8
    with torch.inference_mode():
        exact = torch.zeros(vocab, vocab)
        draft_exact = torch.zeros(vocab, vocab)
        for model, table in ((target, exact), (draft, draft_exact)):
            engine = Engine(model, NoText(), ROOMY, BATCHING)
            first = torch.softmax(_next_logits(engine, prompt), -1)
            for t in range(vocab):
                table[t] = first[t] * torch.softmax(_next_logits(engine, [*prompt, t]), -1)
    cache = CacheConfig(block_size=4, num_blocks=4000, watermark=0.0)
    batching = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096)
    engine = Engine(
        target, NoText(), cache, batching,
        proposer=DraftProposer(draft, 4000, 4, Sampler(vocab)), num_speculative_tokens=2,
    )  # fmt: skip
    for i in range(n):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=i))
    tokens: dict[str, list[int]] = {}
    accepted = 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            accepted += out.num_accepted_tokens if out.finished else 0
    assert engine.scheduler.blocks.num_free_blocks == engine.num_blocks
    assert 0.1 * n < accepted < 2 * n, "some drafts kept, some rejected"
    counts = torch.zeros(vocab, vocab)
    for out in tokens.values():
        assert len(out) == 3
        counts[out[0], out[1]] += 1
    expected = exact.flatten() * n
    chi2 = float(((counts.flatten() - expected) ** 2 / expected).sum())
    chi2_draft = float(((counts.flatten() - draft_exact.flatten() * n) ** 2 / (draft_exact.flatten() * n)).sum())
    assert chi2 < 103.4, f"chi-square {chi2:.1f} above the 0.1 % critical value for 63 degrees of freedom"
    assert chi2_draft > 1000, "the draft's distribution should be far from the output's"
    assert tv(exact.flatten(), draft_exact.flatten()) > 0.2


def _next_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The model's next-token logits after `prompt` (one pass through the engine's runner)."""
    engine.scheduler.add(Request("probe", list(prompt), SamplingParams(max_tokens=1)))
    logits = engine.runner.logits(engine.scheduler.schedule())
    engine.scheduler.abort("probe")
    assert logits is not None
    return logits[0]


def test_speculative_logprobs_equal_plain_logprobs(demo):
    model, tok = demo
    prompt = tok.encode("    def __init__(self, x):\n        self.x = x\n\n    def __init__(self, ")
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)

    def logprobs(engine: Engine) -> tuple[list[tuple[int, float, list[int]]], int]:
        engine.add_request("lp", prompt, params)
        got, accepted = [], 0
        while engine.has_unfinished:
            for out in engine.step():
                assert len(out.logprobs) == len(out.token_ids)
                got += [(t, lp, [i for i, _ in top]) for t, (lp, top) in zip(out.token_ids, out.logprobs, strict=True)]
                accepted = out.num_accepted_tokens
        return got, accepted

    plain, _ = logprobs(Engine(model, tok, ROOMY, BATCHING))
    spec, accepted = logprobs(Engine(model, tok, ROOMY, BATCHING, proposer=NgramProposer(), num_speculative_tokens=4))
    assert accepted > 0, "some steps should have kept draft tokens"
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain] and len(plain) == 20
    assert [top for _, _, top in spec] == [top for _, _, top in plain]
    assert [lp for _, lp, _ in spec] == pytest.approx([lp for _, lp, _ in plain], abs=1e-4)
