"""The router's parts that need no servers: request validation, worker placement, the worker pool."""

from __future__ import annotations

import pytest
from tandem.v1 import api_pb2, worker_pb2

from router.placement.discovery import WorkerDiscovery
from router.placement.placement import NoCapacity, choose, choose_decode, ring_owner
from router.service.validate import InvalidRequest, Limits, validate

LIMITS = Limits(context_length=100, vocab_size=500, max_stop_strings=2)


class Words:
    vocab_size = 500

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def encode_chat(self, messages):
        return self.encode(" ".join(f"<{m['role']}> {m['content']}" for m in messages))


def request(**fields) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(**fields)


def test_valid_request_resolves_max_tokens_and_defaults():
    prompt, params = validate(request(text="aa bbb c"), LIMITS, Words())
    assert prompt == [2, 3, 1]
    assert params.max_tokens == 97 and params.temperature == 1.0 and params.top_k == -1
    chat = request(chat=api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="user", content="hi there")]))
    assert validate(chat, LIMITS, Words())[0] == [6, 2, 5]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(text=""), "text"),
        (dict(text="a", request_id="id with spaces"), "request_id"),
        (dict(text="a", request_id="\x1f"), "request_id"),
        (dict(), "prompt"),
        (dict(text="a " * 100), "text"),
        (dict(text="a", sampling=api_pb2.SamplingParams(max_tokens=100)), "sampling.max_tokens"),
        (dict(text="a", sampling=api_pb2.SamplingParams(temperature=-0.5)), "sampling.temperature"),
        (dict(text="a", sampling=api_pb2.SamplingParams(top_p=0)), "sampling.top_p"),
        (dict(text="a", sampling=api_pb2.SamplingParams(top_k=-2)), "sampling.top_k"),
        (dict(text="a", sampling=api_pb2.SamplingParams(min_p=2)), "sampling.min_p"),
        (dict(text="a", sampling=api_pb2.SamplingParams(max_tokens=3, min_tokens=4)), "sampling.min_tokens"),
        (dict(text="a", sampling=api_pb2.SamplingParams(stop=["x", "y", "z"])), "sampling.stop"),
        (dict(text="a", sampling=api_pb2.SamplingParams(stop=[""])), "sampling.stop"),
        (dict(text="a", sampling=api_pb2.SamplingParams(stop_token_ids=[500])), "sampling.stop_token_ids"),
        (dict(token_ids=api_pb2.TokenIds(ids=[1, 500])), "token_ids.ids"),
        (dict(chat=api_pb2.ChatPrompt()), "chat.messages"),
    ],
)
def test_each_bad_field_is_named(fields, field):
    with pytest.raises(InvalidRequest) as e:
        validate(request(**fields), LIMITS, Words())
    assert e.value.field == field


def load(role: str, free: int = 100, running: int = 0, queued: int = 0, draining: bool = False):
    return worker_pb2.WorkerLoad(
        role=role, free_kv_blocks=free, total_kv_blocks=100, running_seqs=running,
        queued_prompt_tokens=queued, draining=draining,
    )  # fmt: skip


def test_decode_choice_prefers_free_room_then_the_lightest():
    loads = {"decode-0": load("decode", free=3), "decode-1": load("decode", running=5), "decode-2": load("decode")}
    assert choose_decode(16 * 10, loads, 16) == "decode-2"
    assert choose_decode(16 * 2, {"decode-0": loads["decode-0"], "decode-1": loads["decode-1"]}, 16) == "decode-0"
    # No worker has the blocks free, but one can hold them: it queues or preempts rather than refusing.
    full = {"decode-0": load("decode", free=1, running=9), "decode-1": load("decode", free=2, running=3)}
    assert choose_decode(16 * 10, full, 16) == "decode-1"
    with pytest.raises(NoCapacity):
        choose_decode(16 * 200, loads, 16)
    with pytest.raises(NoCapacity):
        choose_decode(16, {"decode-0": load("decode", draining=True)}, 16)


def test_short_prompts_prefill_locally_and_long_ones_go_to_the_prefix_owner():
    loads = {"decode-0": load("decode"), "prefill-0": load("prefill"), "prefill-1": load("prefill")}
    assert choose([1, 2, 3], 5, loads, 16, local_prefill_max_tokens=8).reason == "local:short-prompt"
    prompt = list(range(40))
    first = choose(prompt, 5, loads, 16, local_prefill_max_tokens=8)
    assert first.reason == "remote:prefix-owner"
    # Another prompt with the same first block goes to the same worker.
    assert choose(prompt[:16] + [7] * 30, 5, loads, 16, 8).prefill == first.prefill
    # Unless that worker's queue is far longer than another's.
    busy = dict(loads, **{first.prefill: load("prefill", queued=10_000)})
    other = choose(prompt, 5, busy, 16, 8, queue_slack_tokens=100)
    assert other.prefill != first.prefill and other.reason == "remote:shortest-queue"
    assert choose(prompt, 5, {"decode-0": load("decode")}, 16, 8).reason == "local:no-prefill-worker"


def test_consistent_hashing_moves_few_keys_when_a_worker_joins():
    keys = [[i, i + 1] for i in range(400)]
    before = {tuple(k): ring_owner(k, ["a", "b", "c"]) for k in keys}
    after = {tuple(k): ring_owner(k, ["a", "b", "c", "d"]) for k in keys}
    moved = sum(before[k] != after[k] for k in before)
    assert all(after[k] == "d" for k in before if before[k] != after[k])
    assert moved < 0.4 * len(keys)
    assert len(set(before.values())) == 3


@pytest.mark.parametrize("boot_s", [0.5, 1e6], ids=["fresh-machine", "long-uptime"])
def test_pool_rediscovers_on_demand_between_refreshes(boot_s):
    """A router that finds no decode worker with room asks discovery again at once: a worker added
    since the last refresh is placed on instead of the request being refused. The clock is injected:
    a machine booted `boot_s` ago (monotonic time below `refresh_s`) refreshes on first use too."""
    now = [boot_s]
    found = {"decode-0": "127.0.0.1:1"}
    pool = WorkerDiscovery(lambda: dict(found), refresh_s=3600, clock=lambda: now[0])
    try:
        assert set(pool.workers()) == {"decode-0"}, "the first use discovers, whatever the clock reads"
        found["decode-1"] = "127.0.0.1:2"
        now[0] += 1
        assert set(pool.workers()) == {"decode-0"}, "within refresh_s the list is reused"
        pool.rediscover()
        assert set(pool.workers()) == {"decode-0", "decode-1"}
        found["decode-2"] = "127.0.0.1:3"
        now[0] += 3600
        assert set(pool.workers()) == {"decode-0", "decode-1", "decode-2"}, "refresh_s later it asks again"
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("resume", "field"),
    [
        (api_pb2.Resume(token_ids=[1]), "resume.request_id"),
        (api_pb2.Resume(request_id="r", token_ids=[500]), "resume.token_ids"),
        (api_pb2.Resume(request_id="r", token_ids=[1, 2, 3]), "resume.token_ids"),
    ],
)
def test_a_resume_needs_the_streams_id_and_tokens_that_leave_something_to_do(resume, field):
    fields = dict(text="a", sampling=api_pb2.SamplingParams(max_tokens=3), resume=resume)
    with pytest.raises(InvalidRequest) as e:
        validate(request(**fields), LIMITS, Words())
    assert e.value.field == field
    ok = request(text="a", sampling=api_pb2.SamplingParams(max_tokens=3), resume=api_pb2.Resume(request_id="r"))
    assert validate(ok, LIMITS, Words())[1].max_tokens == 3


def test_logprob_entries_carry_the_text_each_token_completes_and_its_bytes():
    """A character split across tokens goes with the token that ends it: the entries' texts join to
    the decoded text, their bytes to its UTF-8, however the tokens come in messages."""
    from pathlib import Path

    from cluster.model.tokenizer import Tokenizer
    from cluster.slo import Targets
    from router.service.stream import Stream

    tok = Tokenizer(Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code")
    text = 'print("héllo, 日本語 ✓")'
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.token_bytes(i) and not tok.token_bytes(i).decode(errors="ignore") for i in ids), "a split character"
    stream = Stream("r", [1, 2], 0.0, Targets(1.0, 1.0), token_bytes=tok.token_bytes)
    entries = []
    for start in range(0, len(ids), 3):  # three tokens a message
        part = ids[start : start + 3]
        msg = worker_pb2.WorkerTokens(token_ids=part, text=tok.decode(ids[: start + 3])[len(tok.decode(ids[:start])) :])
        msg.logprobs.extend(api_pb2.TokenLogprob(token_id=i, logprob=-0.5, top=[api_pb2.TopLogprob(token_id=i)])
                            for i in part)  # fmt: skip
        out = api_pb2.GenerateResponse.FromString(stream.response(msg))
        assert len(out.logprobs) == len(part), "rewritten, not appended"
        entries += out.logprobs
    assert "".join(e.token for e in entries) == text == tok.decode(ids)
    assert b"".join(e.token_bytes for e in entries) == text.encode()
    assert all(e.top[0].token_bytes == e.token_bytes for e in entries)
