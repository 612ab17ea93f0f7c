"""Structured output through the engines: every constraint kind gives outputs that parse and
validate, alone, in a mixed batch, under preemption, with speculative decoding (n-gram and draft
model), disaggregated (first token on the prefill engine) and after a move (the matcher replayed);
unconstrained requests beside them keep exactly their tokens; bad constraints are refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tandem.v1 import api_pb2

from cluster.config import CacheConfig, SchedulerConfig, SpeculativeConfig, TransferConfig
from cluster.engine.request import Constraint, SamplingParams, params_from_proto, params_to_proto
from cluster.engine.speculative import build_proposer
from cluster.engine.structured import Grammars, for_tokenizer
from cluster.kv.transport import LocalSender
from cluster.kv.wire import model_fingerprint
from cluster.model.loader import load_model
from cluster.model.tokenizer import Tokenizer
from decode_worker.engine import Engine
from decode_worker.kv_intake import KVIntake
from prefill_worker.engine import PrefillEngine
from router.service.validate import InvalidRequest, Limits, validate
from tests.conftest import drive

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "tandem-demo-code"
DRAFT = ROOT / "models" / "tandem-demo-code-draft"
ROOMY = CacheConfig(block_size=4, num_blocks=2000, watermark=0.0)
TIGHT = CacheConfig(block_size=4, num_blocks=120, watermark=0.0)
BATCHING = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, long_prefill_chunk=64)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "count", "ok", "kind", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}-\d{2}(\.\d)?"
LARK = 'start: expr\nexpr: NUM | "(" expr " + " expr ")"\nNUM: /[0-9]{1,3}/'
CHOICES = ("yes", "no", "maybe so")
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", REGEX),
    "grammar": Constraint("grammar", LARK),
    "choice": Constraint("choice", choices=CHOICES),
}
PROMPTS = ["def f(x):\n    return", 'config = {"name":', "# the answer is", "import os\n\n"]


def _expr(text: str, i: int = 0) -> int:
    """The end of one `expr` of LARK starting at `i`; ValueError where there is none."""
    if m := re.compile(r"[0-9]{1,3}").match(text, i):
        return m.end()
    if not text.startswith("(", i):
        raise ValueError(f"no expr at {i}: {text!r}")
    i = _expr(text, i + 1)
    if not text.startswith(" + ", i):
        raise ValueError(f"no ' + ' at {i}: {text!r}")
    i = _expr(text, i + 3)
    if not text.startswith(")", i):
        raise ValueError(f"no ')' at {i}: {text!r}")
    return i + 1


def check(kind: str, text: str) -> None:
    """Raises unless `text` matches the constraint of `kind` (checked without llguidance)."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "grammar":
        assert _expr(text) == len(text), text
    else:
        assert text in CHOICES, text


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    model, tok = load_model(DEMO, "float32"), Tokenizer(DEMO)
    grammars = for_tokenizer(tok, model.arch.vocab_size, tok.eos_token_ids)
    yield model, tok, grammars
    grammars.close()  # its mask thread stops with the module


def workload(tok: Tokenizer, kinds=CONSTRAINTS, temperatures=(0.0, 0.8), seeded: bool = True):  # type: ignore[no-untyped-def]
    """Every kind on every prompt at each temperature (sampled ones seeded unless `seeded` is
    false), and one unconstrained request per prompt: {id: (prompt ids, params)}."""
    out = {}
    for p, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        for kind in kinds:
            for t in temperatures:
                seed = 10 * p + len(kind) if seeded and t > 0 else None
                params = SamplingParams(max_tokens=96, temperature=t, seed=seed, structured=CONSTRAINTS[kind])
                out[f"{kind}-{p}-{t}"] = (ids, params)
        out[f"plain-{p}"] = (ids, SamplingParams(max_tokens=24, temperature=0.0))
    return out


def assert_valid(tok: Tokenizer, requests, tokens, finals=None, grammars=None) -> None:  # type: ignore[no-untyped-def]
    """Every constrained output matches. Any JSON object has no bound on its length, and the demo
    model can ramble inside one until max_tokens: such an output must be a prefix of a match."""
    for rid, (_, params) in requests.items():
        c = params.structured
        if c is None:
            continue
        if c.kind == "json_object" and finals is not None and finals[rid].finish_reason == "length":
            assert grammars is not None and not grammars.matcher(c, tokens[rid]).error, rid
            continue
        if finals is not None:
            assert finals[rid].finish_reason == "stop", (rid, tok.decode(tokens[rid]))
        check(c.kind, tok.decode(tokens[rid]))


def engine(demo, cache=ROOMY, **kwargs) -> Engine:  # type: ignore[no-untyped-def]
    model, tok, grammars = demo
    return Engine(model, tok, cache, BATCHING, tok.eos_token_ids, grammars=grammars, **kwargs)


def test_every_kind_validates_and_plain_rows_keep_their_tokens(demo):
    tok = demo[1]
    requests = workload(tok, temperatures=(0.0, 0.8, 1.0))
    requests.update({f"free-{rid}": r for rid, r in workload(tok, {}, seeded=False).items()})
    tokens, finals = drive(engine(demo), requests)
    assert_valid(tok, requests, tokens, finals, demo[2])
    plain = {rid: r for rid, r in requests.items() if r[1].structured is None}
    alone, _ = drive(engine(demo), plain)
    assert {rid: tokens[rid] for rid in plain} == alone


def test_unseeded_sampling_validates_too(demo):
    tok = demo[1]
    requests = workload(tok, temperatures=(1.0,), seeded=False)
    tokens, finals = drive(engine(demo), requests)
    assert_valid(tok, requests, tokens, finals, demo[2])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_under_preemption_gives_the_constrained_tokens_of_plain_decoding(demo, method):
    """Greedy and seeded constrained requests keep plain decoding's tokens with drafts checked
    against their matchers and rolled back, and with preemption recomputing their KV."""
    model, tok, _ = demo
    requests = workload(tok)
    plain, _ = drive(engine(demo), requests)
    config = SpeculativeConfig(method=method, num_tokens=4, draft_model=DRAFT, draft_memory_gib=0.01)
    proposer = build_proposer(config, model, TIGHT.block_size)
    spec = engine(demo, TIGHT, proposer=proposer, num_speculative_tokens=4)
    tokens, finals = drive(spec, requests)
    assert tokens == plain
    assert_valid(tok, requests, tokens, finals, demo[2])
    assert spec.scheduler.stats.num_preemptions > 0, "the KV budget should force preemptions"
    constrained = [f for rid, f in finals.items() if requests[rid][1].structured is not None]
    assert sum(f.num_accepted_tokens for f in constrained) > 0, "some drafts of constrained requests kept"


def test_prefill_engine_samples_the_first_token_under_the_constraint(demo):
    """Prefill → local transfer → decode gives the single engine's constrained tokens."""
    model, tok, grammars = demo
    requests = workload(tok)
    colocated, _ = drive(engine(demo), requests)
    decode = engine(demo)
    intake = KVIntake(decode, model_fingerprint(model, model.arch), timeout_s=30)
    prefill = PrefillEngine(model, ROOMY, BATCHING, TransferConfig(), 2000, tok.eos_token_ids, grammars=grammars)
    firsts = {}
    for rid, (prompt, params) in requests.items():
        prefill.add_request(rid, prompt, params, LocalSender(intake))
    while prefill.has_unfinished:
        for out in prefill.step():
            firsts[out.request_id] = out.first_token
        prefill.poll_leases()
    tokens, finals = {rid: [] for rid in requests}, {}
    while decode.has_unfinished:
        for out in decode.step():
            tokens[out.request_id] += out.token_ids
            finals[out.request_id] = out
    assert tokens == colocated
    assert {rid: t[0] for rid, t in tokens.items()} == firsts
    assert_valid(tok, requests, tokens, finals, grammars)


def test_a_moved_request_replays_its_matcher(demo):
    """A request that arrives with output made elsewhere continues as if it had never moved."""
    tok = demo[1]
    requests = workload(tok, temperatures=(0.0, 0.8))
    whole, _ = drive(engine(demo), requests)
    moved = engine(demo)
    for rid, (prompt, params) in requests.items():
        cut = len(whole[rid]) // 2
        if cut > 0:
            moved.add_request(rid, prompt, params, output_token_ids=whole[rid][:cut])
    rest: dict[str, list[int]] = {}
    while moved.has_unfinished:
        for out in moved.step():
            rest.setdefault(out.request_id, []).extend(out.token_ids)
    for rid, tokens in rest.items():
        assert whole[rid][: len(whole[rid]) // 2] + tokens == whole[rid], rid


def test_beam_search_min_tokens_and_ignore_eos_refuse_a_constraint():
    c = CONSTRAINTS["regex"]
    for bad, words in [({"num_beams": 2}, "beam search"), ({"min_tokens": 2}, "min_tokens"),
                       ({"ignore_eos": True}, "ignore_eos")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            SamplingParams(max_tokens=8, structured=c, **bad)  # type: ignore[arg-type]


def test_every_kind_travels_on_the_wire():
    for c in CONSTRAINTS.values():
        p = SamplingParams(max_tokens=8, structured=c)
        m = params_to_proto(p)
        assert params_from_proto(api_pb2.SamplingParams.FromString(m.SerializeToString())) == p
    assert params_from_proto(api_pb2.SamplingParams(max_tokens=8)).structured is None


class _Tok:
    vocab_size = 4096

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)


def _request(**structured) -> api_pb2.GenerateRequest:  # type: ignore[no-untyped-def]
    s = api_pb2.Structured(**structured)
    return api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(max_tokens=8, structured=s))


BAD = [
    ({"json_schema": "{not json"}, "not JSON"),
    ({"json_schema": '{"type": "objectx"}'}, "Invalid type"),
    ({"json_schema": '{"type": "object", "if": {}}'}, "Unimplemented keys"),
    ({"json_schema": '{"type": "string", "format": "shoe-size"}'}, "Unknown format"),
    ({"json_schema": '{"$ref": "#/nowhere"}'}, "does not exist"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"regex": "a" * 70_000}, "at most 65536"),
    ({"regex": "(a{1000}){1000}"}, "too complex"),  # small, and past the lexer's limits
    ({"choice": api_pb2.Choices(choices=[str(i) for i in range(2000)])}, "at most 1024"),
    ({"json_object": False}, "set it to true"),
    ({"choice": api_pb2.Choices()}, "no choices"),
]


@pytest.mark.parametrize(("structured", "words"), BAD, ids=[w for _, w in BAD])
def test_router_refuses_a_bad_constraint_naming_the_problem(demo, structured, words):
    grammars = demo[2]
    with pytest.raises(InvalidRequest, match=re.escape(words)) as e:
        validate(_request(**structured), Limits(1024, 4096), _Tok(demo[1]), grammars)
    assert str(e.value).startswith("sampling")


def test_router_compiles_each_constraint_once_and_refuses_without_a_tokenizer(demo):
    tok = demo[1]
    grammars = Grammars(tok.to_json(), 4096, tok.eos_token_ids)
    request = _request(json_schema=json.dumps(SCHEMA))
    for _ in range(3):
        _, params = validate(request, Limits(1024, 4096), _Tok(tok), grammars)
    assert params.structured == CONSTRAINTS["json_schema"] and grammars.compiles == 1
    for _ in range(2):
        with pytest.raises(InvalidRequest):
            validate(_request(regex="a(b"), Limits(1024, 4096), _Tok(tok), grammars)
    assert grammars.compiles == 2, "a refused constraint is cached too"
    with pytest.raises(InvalidRequest, match="not available"):
        validate(request, Limits(1024, 4096), _Tok(tok), None)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["json_schema", "regex", "grammar", "choice"]),
    text=st.one_of(st.text(max_size=60), st.sampled_from(['{"type": "object"', '{"type": 5}', "[]", "start: /(/"])),
)
def test_any_constraint_text_is_compiled_or_refused_by_name(demo, kind, text):
    """No constraint makes validation fail with anything but InvalidRequest."""
    s = (
        api_pb2.Structured(choice=api_pb2.Choices(choices=[text]))
        if kind == "choice"
        else api_pb2.Structured(**{kind: text})
    )
    request = api_pb2.GenerateRequest(text="hi", sampling=api_pb2.SamplingParams(max_tokens=8, structured=s))
    try:
        validate(request, Limits(1024, 4096), _Tok(demo[1]), demo[2])
    except InvalidRequest as e:
        assert str(e).startswith("sampling") and len(str(e)) > len("sampling: ")
