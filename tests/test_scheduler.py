"""The scheduler, driven with hand-made model outputs: no torch, no model."""

from __future__ import annotations

import contextlib
import random
import zlib

import pytest

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, SamplingParams, Status, StepPlan
from decode_worker.scheduler import Scheduler

EOS = 0


def make(num_blocks=64, block_size=4, max_seqs=8, budget=64, chunk=32, watermark=0.0, max_len=None, apart=False):
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, long_prefill_chunk=chunk, prefill_apart=apart
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, watermark), [EOS], max_len)


def req(rid, prompt_len, max_tokens=8, **params):
    prompt = [100 + (zlib.crc32(rid.encode()) + i) % 50 for i in range(prompt_len)]  # the same in every run
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params))


def step(s: Scheduler, token=7) -> tuple[StepPlan, list[Request]]:
    plan = s.schedule()
    out = s.update(plan, {c.request.request_id: [token] for c in plan.chunks if c.samples})
    s.blocks.check_integrity()
    return plan, out


def shape(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_new) for c in plan.chunks]


def test_continuous_batching_admits_in_order_and_decodes_one_token_each():
    s = make()
    s.add(req("a", 5))
    plan, out = step(s)
    assert shape(plan) == [("a", 0, 5)] and [r.request_id for r in out] == ["a"]
    s.add(req("b", 3))
    s.add(req("c", 2))
    plan, _ = step(s)
    assert shape(plan) == [("a", 5, 1), ("b", 0, 3), ("c", 0, 2)]
    plan, _ = step(s)
    assert shape(plan) == [("a", 6, 1), ("b", 3, 1), ("c", 2, 1)]


def test_long_prompt_is_chunked_and_decodes_keep_running():
    s = make(chunk=8, budget=12)
    s.add(req("short", 2, max_tokens=20))
    step(s)
    s.add(req("long", 30))
    plans = [step(s)[0] for _ in range(4)]
    assert [shape(p) for p in plans] == [
        [("short", 2, 1), ("long", 0, 8)],
        [("short", 3, 1), ("long", 8, 8)],
        [("short", 4, 1), ("long", 16, 8)],
        [("short", 5, 1), ("long", 24, 6)],
    ]
    assert [c.samples for c in plans[2].chunks] == [True, False]
    assert s.requests["long"].output_token_ids == [7]  # sampled only once the prompt was done


def test_prefill_apart_runs_prompt_chunks_alone_and_decodes_every_other_step():
    s = make(chunk=8, budget=12, apart=True)
    s.add(req("short", 2, max_tokens=20))
    step(s)
    s.add(req("long", 30))
    plans = [step(s)[0] for _ in range(6)]
    assert [shape(p) for p in plans] == [
        [("long", 0, 8)],
        [("short", 2, 1), ("long", 8, 8)],
        [("long", 16, 8)],
        [("short", 3, 1), ("long", 24, 6)],
        [("short", 4, 1), ("long", 30, 1)],  # both decode now: one pass
        [("short", 5, 1), ("long", 31, 1)],
    ]
    s.add(req("blocked", 230))  # more blocks than the pool has free: it waits, and the decodes go on
    assert shape(step(s)[0]) == [("short", 6, 1), ("long", 32, 1)]


def test_budget_and_max_num_seqs_hold():
    s = make(max_seqs=2, budget=6)
    for rid in "abc":
        s.add(req(rid, 4))
    plan, _ = step(s)
    assert shape(plan) == [("a", 0, 4), ("b", 0, 2)]  # budget cut b's chunk
    plan, _ = step(s)
    assert shape(plan) == [("a", 4, 1), ("b", 2, 2)]  # c waits: two sequences max
    assert [r.request_id for r in s.waiting] == ["c"]


def test_stop_conditions():
    s = make()
    s.add(req("eos", 2, max_tokens=5))
    s.add(req("ignore", 2, max_tokens=3, ignore_eos=True))
    s.add(req("min", 2, max_tokens=5, min_tokens=2))
    s.add(req("stopid", 2, max_tokens=5, stop_token_ids=(9,), ignore_eos=True))
    step(s, token=EOS)
    assert s.requests.keys() == {"ignore", "min", "stopid"}
    step(s, token=EOS)  # "min" now has 2 tokens: stops
    assert s.requests.keys() == {"ignore", "stopid"}
    step(s, token=9)  # stop id; "ignore" reaches max_tokens=3
    assert not s.requests and s.stats.finished == {"stop": 3, "length": 1}
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_context_window_and_oversized_requests_are_refused():
    s = make(num_blocks=8, block_size=4, max_len=20)
    with pytest.raises(ValueError, match="exceeds the context window"):
        s.add(req("x", 15, max_tokens=6))
    with pytest.raises(ValueError, match="exceeds this worker's KV cache"):
        make(num_blocks=2, block_size=4).add(req("y", 5, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("z", 2))
        s.add(req("z", 2))


def test_preemption_recomputes_newest_and_loses_nothing():
    s = make(num_blocks=6, block_size=4, chunk=64)
    for rid in ("a", "b", "c"):
        s.add(req(rid, 8, max_tokens=6))
    step(s)  # each holds 2 blocks for its 8 prompt tokens: 6 of 6 used
    plan, _ = step(s)  # a's first decode token needs a third block: c, the newest, makes room
    assert "c" in plan.preempted
    assert s.waiting[0].request_id == "c" and s.waiting[0].num_computed_tokens == 0
    finished = {}
    for _ in range(40):
        _, out = step(s)
        finished.update({r.request_id: r for r in out if r.finished})
        if not s.has_work:
            break
    assert sorted(finished) == ["a", "b", "c"]
    assert all(len(r.output_token_ids) == 6 for r in finished.values())
    assert s.stats.num_preemptions >= 1 and s.blocks.num_free_blocks == 6


def test_abort_frees_blocks_at_once_and_ignores_unknown_ids():
    s = make()
    s.add(req("a", 9))
    s.add(req("w", 3))
    plan = s.schedule()
    assert s.abort("a").finish_reason == "abort"
    assert s.abort("w").status is Status.FINISHED  # waiting or running alike
    assert s.abort("nope") is None
    assert s.update(plan, {"a": [1], "w": [1]}) == []  # the in-flight step's output is dropped
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    s.blocks.check_integrity()


def test_shared_prompt_prefix_skips_computed_tokens():
    s = make(block_size=4)
    prompt = list(range(1, 11))
    s.add(Request("a", prompt, SamplingParams(max_tokens=4)))
    step(s)
    s.add(Request("b", prompt, SamplingParams(max_tokens=4)))
    plan, _ = step(s)
    assert ("b", 8, 2) in shape(plan) and s.requests["b"].num_cached_tokens == 8


@pytest.mark.parametrize("seed", range(12))
def test_random_mix_of_adds_aborts_preemptions_ends_clean(seed):
    rng = random.Random(seed)
    s = make(
        num_blocks=rng.randint(12, 30),
        block_size=4,
        max_seqs=rng.randint(1, 6),
        budget=rng.randint(8, 40),
        chunk=rng.randint(4, 16),
        watermark=rng.choice([0.0, 0.1]),
        apart=seed % 2 == 1,
    )
    done, next_id = {}, 0
    for _ in range(300):
        op = rng.random()
        if op < 0.2:
            with contextlib.suppress(ValueError):
                s.add(
                    req(f"r{next_id}", rng.randint(1, 20), max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
                )
            next_id += 1
        elif op < 0.25 and s.requests:
            s.abort(rng.choice(list(s.requests)))
        else:
            plan = s.schedule()
            sampled = {c.request.request_id: [rng.choice([EOS, 5, 6])] for c in plan.chunks if c.samples}
            for r in s.update(plan, sampled):
                if r.finished:
                    done[r.request_id] = r
        s.blocks.check_integrity()
        held = {b for r in s.running for b in s.blocks.block_table(r.request_id)}  # shared prefixes count once
        assert len(held) <= s.blocks.num_blocks
    while s.has_work:
        plan = s.schedule()
        assert not plan.empty, "work left but nothing schedulable"
        s.update(plan, {c.request.request_id: [5] for c in plan.chunks if c.samples})
        s.blocks.check_integrity()
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    assert all(r.finish_reason in {"stop", "length"} for r in done.values())


def test_token_slices_match_the_full_list():
    r = Request("x", [1, 2, 3, 4], SamplingParams())
    r.output_token_ids += [5, 6, 7]
    for start in range(8):
        for end in range(start, 8):
            assert r.token_ids(start, end) == r.all_token_ids[start:end]
