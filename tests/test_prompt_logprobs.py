"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) from both engines' prefill: each
prompt token's, after the first, equals transformers' log-softmax on the same weights, in chunks,
under preemption, and past a prefix cache that would have skipped the prompt's head."""

from __future__ import annotations

import random

import pytest
import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.request import SamplingParams
from cluster.model.loader import load_model
from decode_worker.engine import Engine
from tests.test_engine import BATCHING, BIG_CACHE, SMALL_CACHE, NoText

CHUNKED = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=32, long_prefill_chunk=7)


@pytest.fixture(scope="module")
def llama(hf_models):
    folder, hf = hf_models["llama"]
    return load_model(folder, "float32"), hf


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at each prompt position but the last [len - 1, vocab]."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def outputs(engine: Engine) -> dict[str, list]:
    got: dict[str, list] = {}
    while engine.has_unfinished:
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    return got


def check(entries: list, prompt: list[int], expected: torch.Tensor, top_n: int) -> None:
    assert [token for token, _ in entries] == prompt[1:]
    for i, (token, (lp, top)) in enumerate(entries):
        assert lp == pytest.approx(expected[i, token].item(), abs=1e-4), i
        assert [t for t, _ in top] == expected[i].topk(top_n).indices.tolist(), i


def test_prompt_logprobs_match_transformers_in_chunks_and_past_a_warm_prefix_cache(llama):
    model, hf = llama
    rng = random.Random(3)
    prompt = [rng.randrange(3, 320) for _ in range(30)]
    engine = Engine(model, NoText(), CacheConfig(block_size=4, num_blocks=80, watermark=0.0), CHUNKED)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2, temperature=0))
    outputs(engine)  # the prompt's blocks are now in the prefix cache
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
    engine.add_request("b", prompt, SamplingParams(max_tokens=3, temperature=0))
    got = outputs(engine)
    first, *rest = got["a"]
    check(first.prompt_logprobs, prompt, reference(hf, prompt), 2)
    assert all(not out.prompt_logprobs for out in rest), "the prompt's logprobs come once, with the first token"
    assert first.num_cached_tokens == 0, "a request scoring its prompt does not start from the cache"
    assert got["b"][0].num_cached_tokens > 0 and not got["b"][0].prompt_logprobs
    assert [t for out in got["a"] for t in out.token_ids] == [t for out in got["b"] for t in out.token_ids]
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks


def test_prompt_logprobs_under_preemption_come_once_and_match_transformers(llama):
    model, hf = llama
    rng = random.Random(7)
    requests = {
        f"r{i}": ([rng.randrange(3, 320) for _ in range(rng.randint(2, 40))], SamplingParams(
            max_tokens=rng.randint(1, 20), temperature=0, prompt_logprobs=i % 3))
        for i in range(20)
    }  # fmt: skip
    engine = Engine(model, NoText(), SMALL_CACHE, BATCHING)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got = outputs(engine)
    assert engine.scheduler.stats.num_preemptions > 0, "the KV budget should force preemptions"
    for rid, (prompt, params) in requests.items():
        entries = [e for out in got[rid] for e in out.prompt_logprobs]
        check(entries, prompt, reference(hf, prompt), params.prompt_logprobs or 0)  # each token once


def test_a_one_token_prompt_has_no_prompt_logprobs_and_beam_search_refuses_them(llama):
    model, _ = llama
    engine = Engine(model, NoText(), BIG_CACHE, BATCHING)
    engine.add_request("a", [17], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert [list(out.prompt_logprobs) for out in outputs(engine)["a"]] == [[], []]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(num_beams=2, prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
