"""A stop string split by a move: a request that continues on another worker (after its worker died,
or resumed through another router) with output whose text ended inside a stop string ends where it
would have ended undisturbed, with the same tokens and text.

The move is made exact with `Resume`, which is what the router does with a migration's tokens: the
client has the tokens streamed so far and the text the first worker released for them (everything
but the held-back tail that may begin a stop string)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from tandem.v1 import api_pb2, api_pb2_grpc

from cluster.config import parse_config
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.model.tokenizer import Tokenizer
from tests.served import serving, wait_idle

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
PROMPT = "def fibonacci(n):\n    "
MAX_TOKENS = 48


@pytest.fixture(
    scope="module",
    params=[("thread", 4096), ("process", 4)],
    ids=["thread core, local prefill", "process core, remote prefill"],
)
def served(request):  # type: ignore[no-untyped-def]
    engine_core, local_prefill_max_tokens = request.param
    config = parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "scheduler": {"engine_core": engine_core},
            "cache": {"block_size": 16, "num_blocks": 128},
            "router": {"local_prefill_max_tokens": local_prefill_max_tokens},
        }
    )
    with serving(config, "tandem-demo-code") as cluster, grpc.insecure_channel(cluster.grpc_address) as channel:
        yield api_pb2_grpc.TandemStub(channel), cluster


def generate(stub, prompt: list[int], stop: tuple[str, ...] = (), resume: api_pb2.Resume | None = None):  # type: ignore[no-untyped-def]
    """(tokens, text, finish reason) of one greedy request."""
    sampling = api_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)
    request = api_pb2.GenerateRequest(request_id="r", token_ids=api_pb2.TokenIds(ids=prompt), sampling=sampling)
    if resume is not None:
        request.resume.CopyFrom(resume)
    messages = list(stub.Generate(request, timeout=120))
    tokens = [t for m in messages for t in m.token_ids]
    return tokens, "".join(m.text for m in messages), messages[-1].finish_reason


def straddling_moves(tokenizer: Tokenizer, prompt: list[int], tokens: list[int], text: str):  # type: ignore[no-untyped-def]
    """(stop string, tokens before the move) pairs: a stop string first found in `text` at some point,
    and a move after a token whose text ends inside it."""
    ends = [len(tokenizer.decode(tokens[:k])) for k in range(len(tokens) + 1)]
    for length in (6, 8, 10):
        for start in range(8, len(text) - length):
            stop = text[start : start + length]
            if text.find(stop) != start or not stop.strip():
                continue
            inside = [k for k, end in enumerate(ends) if start < end < start + length]
            if inside:
                yield stop, inside[0]


def test_a_stop_string_split_across_a_move_ends_the_stream_where_it_would_have_undisturbed(served):
    stub, cluster = served
    tokenizer = Tokenizer(DEMO)
    prompt = tokenizer.encode(PROMPT)
    tokens, text, _ = generate(stub, prompt)
    moves = list(straddling_moves(tokenizer, prompt, tokens, text))[:3]
    assert moves, f"no stop string of the output {text!r} can be split by a move"
    for stop, moved in moves:
        expected = generate(stub, prompt, (stop,))
        assert expected[1] == text[: text.find(stop)] and expected[2] == api_pb2.FINISH_REASON_STOP
        first = IncrementalDetokenizer(tokenizer, prompt, [stop])
        received = "".join(first.add(t) for t in tokens[:moved])  # what the client had when its stream broke
        assert not first.stopped and len(received) < len(tokenizer.decode(tokens[:moved])), "the move splits no stop"
        resume = api_pb2.Resume(request_id="r", token_ids=tokens[:moved], text=received)
        rest, rest_text, finish = generate(stub, prompt, (stop,), resume)
        assert (tokens[:moved] + rest, received + rest_text, finish) == expected, f"{stop!r} split after {moved} tokens"
    wait_idle(cluster)  # no KV block left held on either worker
