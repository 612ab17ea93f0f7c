"""The decode engine end to end on tiny models: continuous batching with preemption gives every
request exactly its solo output, which equals transformers' greedy output."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.request import SamplingParams
from cluster.generate import generate
from cluster.model.builder import init_model_folder, train_tokenizer
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from decode_worker.async_engine import AsyncEngine
from decode_worker.engine import Engine
from tests.conftest import drive

SMALL_CACHE = CacheConfig(block_size=4, num_blocks=60, watermark=0.0)
BIG_CACHE = CacheConfig(block_size=4, num_blocks=400, watermark=0.0)
BATCHING = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=96, long_prefill_chunk=24)


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    return drive(engine, requests)[0]


@pytest.fixture(scope="module")
def llama(hf_models):
    folder, hf = hf_models["llama"]
    return load_model(folder, "float32"), hf


def mixed_requests(n: int, seed: int = 0) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(1, 40))]
        out[f"r{i}"] = (prompt, SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0))
    return out


def test_32_concurrent_requests_under_preemption_match_solo_and_transformers(llama):
    model, hf = llama
    requests = mixed_requests(32)
    engine = Engine(model, NoText(), SMALL_CACHE, BATCHING)
    batched = run(engine, requests)
    assert engine.scheduler.stats.num_preemptions > 0, "the KV budget should force preemptions"
    for rid, (prompt, params) in requests.items():
        solo = run(Engine(model, NoText(), BIG_CACHE, BATCHING), {rid: (prompt, params)})[rid]
        assert batched[rid] == solo, rid
        assert len(solo) == params.max_tokens
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False)
        assert solo == ref[0, len(prompt) :].tolist(), rid


def test_prompt_chunks_apart_from_decode_rows_give_the_same_tokens(llama):
    """`scheduler.prefill_apart`: greedy and seeded requests arriving while others decode get the tokens
    they get when one pass holds both, under preemption (the scheduler's own tests hold the order of
    passes)."""
    model, _ = llama
    requests = mixed_requests(24, seed=1)
    for i in range(4):
        requests[f"s{i}"] = ([7 + i] * (30 + i), SamplingParams(max_tokens=12, temperature=0.8, seed=i))
    together = run(Engine(model, NoText(), SMALL_CACHE, BATCHING), requests)
    engine = Engine(model, NoText(), SMALL_CACHE, BATCHING.model_copy(update={"prefill_apart": True}))
    apart, schedule = [], engine.scheduler.schedule

    def recorded():  # type: ignore[no-untyped-def]
        decoding = {
            r.request_id
            for r in engine.scheduler.running
            if r.output_token_ids and r.num_tokens - r.num_computed_tokens == 1
        }
        plan = schedule()
        apart.append(
            bool(decoding) and bool(plan.chunks) and not decoding & {c.request.request_id for c in plan.chunks}
        )
        return plan

    engine.scheduler.schedule = recorded
    assert run(engine, requests) == together
    assert any(apart), "no pass ran prompt chunks apart from the decode rows"
    assert engine.scheduler.stats.num_preemptions > 0


def test_seeded_sampling_does_not_depend_on_the_batch(llama):
    model, _ = llama
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    target = ([5, 6, 7, 8, 9], params)
    alone = run(Engine(model, NoText(), BIG_CACHE, BATCHING), {"t": target})["t"]
    others = {f"o{i}": ([10 + i] * (i + 2), SamplingParams(max_tokens=10, temperature=1.0)) for i in range(6)}
    crowded = run(Engine(model, NoText(), SMALL_CACHE, BATCHING, seed=99), {**others, "t": target})["t"]
    assert crowded == alone
    unseeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=4321)
    assert run(Engine(model, NoText(), BIG_CACHE, BATCHING), {"t": ([5, 6, 7, 8, 9], unseeded)})["t"] != alone


def test_min_and_max_tokens(llama):
    model, _ = llama
    prompt = [11, 12, 13]
    first = run(
        Engine(model, NoText(), BIG_CACHE, BATCHING), {"a": (prompt, SamplingParams(max_tokens=1, temperature=0))}
    )
    eos = first["a"][0]
    stops = Engine(model, NoText(), BIG_CACHE, BATCHING, eos_token_ids=[eos])
    assert run(stops, {"a": (prompt, SamplingParams(max_tokens=8, temperature=0))})["a"] == [eos]
    held = Engine(model, NoText(), BIG_CACHE, BATCHING, eos_token_ids=[eos])
    out = run(held, {"a": (prompt, SamplingParams(max_tokens=8, min_tokens=4, temperature=0))})["a"]
    assert len(out) >= 4 and eos not in out[:4]
    ignoring = Engine(model, NoText(), BIG_CACHE, BATCHING, eos_token_ids=[eos])
    assert len(run(ignoring, {"a": (prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))})["a"]) == 8


def test_logprobs_are_the_models_distribution(llama):
    model, _ = llama
    prompt = [40, 41, 42, 43]
    engine = Engine(model, NoText(), BIG_CACHE, BATCHING)
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=3))
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    ref = generate(model, [prompt], 5, keep_logits=True)[0]
    for out, logits in zip(outs, ref.logits, strict=True):
        expected = torch.log_softmax(logits, -1)
        ((chosen, top),) = out.logprobs
        assert chosen == pytest.approx(expected[out.token_ids[0]].item(), abs=1e-5)
        assert [t for t, _ in top] == expected.topk(3).indices.tolist()
        assert top[0][1] == pytest.approx(chosen, abs=1e-6)  # greedy picks the top token


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    folder = init_model_folder(
        tmp_path_factory.mktemp("textmodel"), "tiny", dtype="float32", seed=5, tokenizer=train_tokenizer(512)
    )
    return load_model(folder, "float32"), Tokenizer(folder)


def test_stop_strings_cut_text_across_token_boundaries(text_model):
    model, tok = text_model
    prompt = tok.encode("def main():\n")
    free = Engine(model, tok, BIG_CACHE, BATCHING)
    free.add_request("a", prompt, SamplingParams(max_tokens=24, temperature=0))
    text, tokens = "", []
    while free.has_unfinished:
        for out in free.step():
            text += out.text
            tokens += out.token_ids
    assert text == tok.decode(tokens)
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    engine = Engine(model, tok, BIG_CACHE, BATCHING)
    engine.add_request("a", prompt, SamplingParams(max_tokens=24, temperature=0, stop=(stop,)))
    got, last = "", None
    while engine.has_unfinished:
        for last in engine.step():
            got += last.text
    assert got == text[: text.find(stop)]
    assert last.finish_reason == "stop"
    assert engine.scheduler.blocks.num_free_blocks == engine.num_blocks


def test_async_front_streams_and_cancellation_frees_blocks(llama):
    model, _ = llama
    engine = Engine(model, NoText(), BIG_CACHE, BATCHING)
    front = AsyncEngine(engine)

    async def collect(rid, prompt, n):
        return [
            t
            async for out in front.generate(rid, prompt, SamplingParams(max_tokens=n, temperature=0))
            for t in out.token_ids
        ]

    async def cancel_early():
        async for out in front.generate("c", [1, 2, 3], SamplingParams(max_tokens=200, temperature=0)):
            if out.num_output_tokens == 3:
                break

    async def main():
        results = await asyncio.gather(collect("a", [5, 6], 6), collect("b", [7, 8, 9], 4), cancel_early())
        for _ in range(100):
            if not engine.has_unfinished:
                break
            await asyncio.sleep(0.01)
        await front.close()
        return results

    a, b, _ = asyncio.run(main())
    assert a == generate(model, [[5, 6]], 6)[0].tokens
    assert b == generate(model, [[7, 8, 9]], 4)[0].tokens
    assert not engine.has_unfinished
    assert engine.scheduler.blocks.num_free_blocks == engine.num_blocks


def test_bad_requests_are_refused_without_side_effects(llama):
    model, _ = llama
    engine = Engine(model, NoText(), SMALL_CACHE, BATCHING)
    with pytest.raises(ValueError, match="exceeds this worker's KV cache"):
        engine.add_request("big", [1] * 151, SamplingParams(max_tokens=90))  # 241 tokens > 60 blocks x 4
    with pytest.raises(ValueError, match="context window"):
        engine.add_request("long", [1] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert not engine.has_unfinished and engine.scheduler.blocks.num_free_blocks == engine.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "float16"])
def test_compiled_decode_matches_eager(llama, kv_dtype):
    """torch.compile'd decode steps (padded to batch buckets, warmed up so that only the guards
    telling buckets apart run) give the eager path's tokens and logprobs, with either KV cache."""
    model, _ = llama
    cache = BIG_CACHE.model_copy(update={"kv_dtype": kv_dtype})
    requests = {
        f"r{i}": (list(range(3, 3 + 5 * (i + 1))), SamplingParams(max_tokens=12, temperature=0, logprobs=0))
        for i in range(5)
    }

    def collect(engine):
        out = {}
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished:
            for o in engine.step():
                out.setdefault(o.request_id, []).append((o.token_ids[0], o.logprobs[0][0]))
        return out

    eager = collect(Engine(model, NoText(), cache, BATCHING))
    compiled_engine = Engine(model, NoText(), cache, BATCHING, compile_buckets=(2, 8))
    compiled_engine.runner.compiled.warm_up(compiled_engine.kv_cache)
    compiled = collect(compiled_engine)
    assert compiled_engine.runner.compiled.steps > 0
    # An int8 cache rounds each key to a step of max|row| / 127: a last-bit difference in a key
    # before rounding can move it a whole step, so its logprobs agree less closely.
    tol = 1e-3 if kv_dtype == "int8" else 1e-4
    for rid in requests:
        assert [t for t, _ in compiled[rid]] == [t for t, _ in eager[rid]], rid
        for (_, a), (_, b) in zip(compiled[rid], eager[rid], strict=True):
            assert a == pytest.approx(b, abs=tol)
    assert compiled_engine.scheduler.blocks.num_free_blocks == compiled_engine.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["auto", "int8", "int4"])
def test_compiled_bfloat16_decode_step_matches_eager(hf_models, weights):
    """A compiled bfloat16 decode step (its graph driven from C++ on CPU) gives the eager step's logits,
    with plain, int8 and int4 weights: the kernels' calls inside the graph take the eager calls' inputs."""
    from cluster.engine.compiled import CompiledDecode
    from cluster.model.attention import SeqChunk, allocate_kv_cache, build_attention_metadata

    folder, _ = hf_models["llama"]
    model = load_model(folder, "bfloat16", weight_dtype=weights, group_size=32)
    arch, block_size = model.arch, 4
    torch.manual_seed(0)
    kv = allocate_kv_cache(arch.num_layers, 24, block_size, arch.num_kv_heads, arch.head_dim, torch.bfloat16)
    for k, v in kv:  # cached context the new tokens attend to
        k.normal_(), v.normal_()
    chunks = [SeqChunk(tuple(range(4 * i, 4 * i + 4)), 5 + 3 * i, 1) for i in range(3)]
    ids = [7, 100, 250]
    compiled = CompiledDecode(model, (4,), block_size, scratch_block=23)
    got = compiled(ids, chunks, kv)
    meta = build_attention_metadata(chunks, block_size, model.windows, "cpu")
    with torch.inference_mode():
        want = model.compute_logits(model(torch.tensor(ids), meta.positions, kv, meta))
    assert compiled.steps == 1
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
