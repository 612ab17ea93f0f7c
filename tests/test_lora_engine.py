"""LoRA through the decode engine: requests of three adapters and of the base model in one continuous
batch give PEFT's greedy tokens; more adapters than slots are written over least recently used first;
an adapter unloaded under load lets its running requests finish and refuses new ones by name; and two
requests with the same prompt through different adapters share no KV block."""

from __future__ import annotations

import pytest

from cluster.config import CacheConfig, LoraConfig, SchedulerConfig
from cluster.engine.request import SamplingParams, UnknownAdapter
from cluster.model.loader import load_model
from cluster.model.lora import read_adapter
from decode_worker.engine import Engine
from tests.conftest import drive
from tests.lora_adapters import ADAPTERS, peft_greedy

CACHE = CacheConfig(block_size=4, num_blocks=200, watermark=0.0)
BATCHING = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, long_prefill_chunk=16)
NEW = 10


class NoText:
    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def engine_with(lora_models, max_loras: int = 3, names=tuple(ADAPTERS), **kwargs) -> Engine:  # type: ignore[no-untyped-def]
    base, folders, _ = lora_models
    model = load_model(base, "float32")
    engine = Engine(model, NoText(), CACHE, BATCHING, lora=LoraConfig(max_loras=max_loras, max_rank=8), **kwargs)
    for name in names:
        engine.load_adapter(read_adapter(folders[name], model.arch, max_rank=8))
    return engine


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 5 for j in range(9 + 3 * i)] for i in range(n)]


def greedy(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, adapter=adapter or "")


def test_a_batch_of_three_adapters_and_the_base_model_gives_peft_greedy_tokens(lora_models):
    reference = lora_models[2]
    which = [None, *ADAPTERS, *ADAPTERS, None]
    requests = {f"r{i}": (p, greedy(w)) for i, (p, w) in enumerate(zip(prompts(len(which)), which, strict=True))}
    engine = engine_with(lora_models)
    batch_sizes: list[int] = []
    streamed, _ = drive(engine, requests, after_step=lambda: batch_sizes.append(len(engine.scheduler.running)))
    assert max(batch_sizes) == len(which), "every request ran in one batch"
    for (rid, (prompt, _)), name in zip(requests.items(), which, strict=True):
        assert streamed[rid] == peft_greedy(reference, name, prompt, NEW), f"{rid} through {name}"
    assert engine.adapters is not None and engine.adapters.evictions == 0


def test_more_adapters_than_slots_take_turns_least_recently_used_out(lora_models):
    reference = lora_models[2]
    engine = engine_with(lora_models, max_loras=2)
    which = [*ADAPTERS, *reversed(ADAPTERS), None]
    requests = {f"r{i}": (p, greedy(w)) for i, (p, w) in enumerate(zip(prompts(len(which)), which, strict=True))}
    most: list[int] = []

    def distinct_adapters() -> None:
        most.append(len({r.params.adapter for r in engine.scheduler.running} - {""}))

    streamed, _ = drive(engine, requests, after_step=distinct_adapters)
    assert max(most) == 2, "never more adapters in a batch than slots"
    assert engine.adapters is not None and engine.adapters.evictions >= 1
    for (rid, (prompt, _)), name in zip(requests.items(), which, strict=True):
        assert streamed[rid] == peft_greedy(reference, name, prompt, NEW), f"{rid} through {name}"
    assert engine.occupancy.free_blocks == engine.occupancy.total_blocks, "no KV block leaked"


def test_the_least_recently_used_slot_is_written_over(lora_models):
    engine = engine_with(lora_models, max_loras=2)
    adapters = engine.adapters
    assert adapters is not None
    a, b, c = ADAPTERS
    adapters._place({a})
    adapters._place({b})
    adapters._place({a})  # b is now the least recently used
    adapters._place({c})
    assert set(adapters.resident) == {a, c} and adapters.evictions == 1
    with pytest.raises(RuntimeError, match="3 adapters in one pass"):
        adapters._place({a, b, c})


def test_an_adapter_unloaded_under_load_finishes_its_requests_and_refuses_new_ones(lora_models):
    reference = lora_models[2]
    engine = engine_with(lora_models)
    assert engine.adapters is not None
    engine.adapters.retire_grace_s = 0.0  # no transfer is in flight here
    name = "all-r8"
    requests = {f"r{i}": (p, greedy(name if i % 2 else None)) for i, p in enumerate(prompts(6))}
    unloaded: list[bool] = []

    def unload_once() -> None:
        if not unloaded and any(r.output_token_ids for r in engine.scheduler.running):
            engine.unload_adapter(name)
            unloaded.append(True)
            with pytest.raises(UnknownAdapter, match=f"adapter '{name}' is not loaded"):
                engine.add_request("late", [5, 6, 7], greedy(name))
            assert engine.adapters is not None and name in engine.adapters.resident, "kept while requests run"

    streamed, finals = drive(engine, requests, after_step=unload_once)
    assert unloaded and len(finals) == len(requests)
    for rid, (prompt, params) in requests.items():
        assert streamed[rid] == peft_greedy(reference, params.adapter or None, prompt, NEW), rid
    assert engine.adapters is not None and name not in engine.adapters.resident, "its slot emptied at the end"
    assert engine.occupancy.free_blocks == engine.occupancy.total_blocks, "no KV block leaked"


def test_an_unloaded_adapter_still_takes_transfers_of_requests_prefilled_before(lora_models):
    """A prefill worker may have taken a request before the adapter was unloaded there: its KV
    transfer is admitted for a while after the unload here; a new request is refused at once."""
    engine = engine_with(lora_models)
    engine.unload_adapter("attn-r4")
    with pytest.raises(UnknownAdapter):
        engine.add_request("new", [5, 6, 7], greedy("attn-r4"))
    table, cached = engine.reserve("moved", list(range(5, 14)), greedy("attn-r4"))
    assert len(table) == 3 and cached == 0
    assert engine.adapters is not None and [(a.name, a.retiring) for a in engine.occupancy.adapters if a.retiring] == [
        ("attn-r4", True)
    ]
    engine.release("moved")
    engine.adapters.retire_grace_s = 0.0
    engine.unload_adapter("all-r8")  # sweeps both: nothing holds either now
    assert not engine.adapters.retiring
    with pytest.raises(UnknownAdapter):
        engine.reserve("late", list(range(5, 14)), greedy("attn-r4"))


def test_the_same_prompt_through_different_adapters_shares_no_kv_block(lora_models):
    engine = engine_with(lora_models)
    prompt = list(range(10, 42))  # eight full blocks
    cached = {}
    for rid, adapter in [("a1", "attn-r4"), ("b1", "all-r8"), ("base", None), ("a2", "attn-r4"), ("b2", "all-r8")]:
        _, finals = drive(engine, {rid: (prompt, greedy(adapter))})
        cached[rid] = finals[rid].num_cached_tokens
    assert cached == {"a1": 0, "b1": 0, "base": 0, "a2": 28, "b2": 28}


def test_unknown_adapters_are_refused_by_name(lora_models):
    engine = engine_with(lora_models)
    with pytest.raises(UnknownAdapter, match="adapter 'nope' is not loaded"):
        engine.add_request("r", [1, 2, 3], greedy("nope"))
    with pytest.raises(UnknownAdapter, match="adapter 'nope' is not loaded"):
        engine.reserve("t", [1, 2, 3], greedy("nope"))
    plain = Engine(load_model(lora_models[0], "float32"), NoText(), CACHE, BATCHING)
    with pytest.raises(UnknownAdapter, match="adapter 'attn-r4' is not loaded"):
        plain.add_request("r", [1, 2, 3], greedy("attn-r4"))
    assert not engine.has_unfinished and not plain.has_unfinished


@pytest.mark.slow
def test_compiled_decode_steps_mix_adapters_as_eager_ones_do(lora_models):
    """The compiled graphs (one per bucket for base-only steps, one with adapter rows) give the
    same tokens as PEFT, with padding rows in the bucket."""
    reference = lora_models[2]
    engine = engine_with(lora_models, compile_buckets=(8,))
    engine.warm_up()
    which = [None, *ADAPTERS, "all-r8"]
    requests = {f"r{i}": (p, greedy(w)) for i, (p, w) in enumerate(zip(prompts(len(which)), which, strict=True))}
    streamed, _ = drive(engine, requests)
    assert engine.runner.compiled is not None and engine.runner.compiled.steps >= NEW - 1
    for (rid, (prompt, _)), name in zip(requests.items(), which, strict=True):
        assert streamed[rid] == peft_greedy(reference, name, prompt, NEW), f"{rid} through {name}"


def test_a_request_moved_mid_stream_continues_through_its_adapter_greedy_and_seeded(lora_models):
    """A request that moves to another worker with the output it already has goes on as if it had
    never moved, through the same adapter (greedy, and seeded sampling by output index)."""
    prompt = prompts(3)[2]
    for params in (greedy("all-r8"), SamplingParams(max_tokens=NEW, temperature=1.0, seed=7, adapter="mlp-r2")):
        whole, _ = drive(engine_with(lora_models), {"r": (prompt, params)})
        moved = engine_with(lora_models)
        moved.add_request("r", prompt, params, output_token_ids=whole["r"][:4])
        rest: list[int] = []
        while moved.has_unfinished:
            rest += [t for out in moved.step() for t in out.token_ids]
        assert whole["r"][:4] + rest == whole["r"], params


def test_speculation_verifies_drafts_through_the_adapter(lora_models):
    """n-gram drafts (which know no adapter) are verified by the target through each row's adapter:
    greedy tokens equal PEFT's, drafts accepted."""
    from cluster.config import SpeculativeConfig
    from cluster.engine.speculative import build_proposer

    reference = lora_models[2]
    repetitive = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [12, 13] * 10]
    which = ["all-r8", "attn-r4", None]
    plain = engine_with(lora_models)
    proposer = build_proposer(SpeculativeConfig(method="ngram", num_tokens=3), plain.runner.model, CACHE.block_size)
    engine = engine_with(lora_models, proposer=proposer, num_speculative_tokens=3)
    requests = {f"r{i}": (p, greedy(w)) for i, (p, w) in enumerate(zip(repetitive, which, strict=True))}
    streamed, finals = drive(engine, requests)
    for (rid, (prompt, _)), name in zip(requests.items(), which, strict=True):
        assert streamed[rid] == peft_greedy(reference, name, prompt, NEW), f"{rid} through {name}"
    assert sum(f.num_draft_tokens for f in finals.values()) > 0
