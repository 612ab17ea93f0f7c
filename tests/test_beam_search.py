"""Beam search on shared KV blocks equals transformers' `generate(num_beams=...)`, sequences and
scores, inside a batch of other requests, and under KV pressure."""

from __future__ import annotations

import itertools

import pytest
import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import SamplingParams
from cluster.model.loader import load_model
from decode_worker.beam import BeamSearch
from decode_worker.engine import Engine
from tests.conftest import drive, write_hf_model

BATCHING = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, long_prefill_chunk=64)
PROMPTS = [[5, 17, 42, 8, 99, 3], [250, 11], [7] * 9 + [123, 45, 67], list(range(30, 51))]


class NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.fixture(scope="module")
def model_with_eos(tmp_path_factory):
    """The tiny test Llama with two frequent next tokens made its end-of-sequence ids, so beams
    finish at different lengths and the length penalty matters."""
    folder = tmp_path_factory.mktemp("beam-llama")
    hf = write_hf_model("llama", folder, seed=3)
    with torch.inference_mode():
        contexts = torch.randint(3, 320, (64, 6), generator=torch.Generator().manual_seed(0))
        favourites = hf(contexts).logits[:, -1].argmax(-1).bincount(minlength=320).topk(2).indices.tolist()
    hf.generation_config.eos_token_id = favourites
    hf.generation_config.pad_token_id = 0
    return load_model(folder, "float32"), hf, favourites


def hf_beams(hf, prompt, n, max_tokens, length_penalty, early_stopping, eos):
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), num_beams=n, num_return_sequences=n, do_sample=False,
            max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
            eos_token_id=eos, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    lengths = (out.beam_indices >= 0).sum(-1).tolist()
    beams = [out.sequences[i, len(prompt) : len(prompt) + lengths[i]].tolist() for i in range(n)]
    return beams, out.sequences_scores.tolist()


CASES = [
    # (prompt index, beams, max_tokens, length_penalty, early_stopping)
    (0, 2, 12, 1.0, False),
    (1, 3, 10, 0.0, False),
    (2, 4, 14, 2.0, False),
    (3, 3, 12, -0.5, False),
    (0, 4, 10, 1.0, True),
    (1, 2, 12, 1.5, "never"),
    (2, 3, 9, 1.0, "never"),
    (3, 2, 16, 0.5, True),
]


def as_tandem(early_stopping) -> str:
    return {False: "false", True: "true", "never": "never"}[early_stopping]


@pytest.mark.parametrize("num_blocks", [3000, 40], ids=["roomy", "preempting"])
def test_beam_search_equals_transformers_in_a_mixed_batch(model_with_eos, num_blocks):
    model, hf, eos = model_with_eos
    requests = {}
    for i, (p, n, m, lp, es) in enumerate(CASES):
        params = SamplingParams(max_tokens=m, num_beams=n, length_penalty=lp, early_stopping=as_tandem(es))
        requests[f"beam{i}"] = (PROMPTS[p], params)
    for i in range(6):  # ordinary requests in the same batch
        requests[f"plain{i}"] = ([20 + i] * (3 + i), SamplingParams(max_tokens=10 + i, temperature=0.0))
    engine = Engine(model, NoText(), CacheConfig(block_size=4, num_blocks=num_blocks, watermark=0.0), BATCHING, eos)
    streamed, finals = drive(engine, requests)
    if num_blocks < 100:
        assert engine.scheduler.stats.num_preemptions > 0, "the small cache should force preemptions"
        assert engine.beams.num_restarts > 0, "and a beam search should lose a beam to one"
    finished_by_stop = 0
    for i, (p, n, m, lp, es) in enumerate(CASES):
        out = finals[f"beam{i}"]
        beams, scores = hf_beams(hf, PROMPTS[p], n, m, lp, es, eos)
        assert [b.token_ids for b in out.beams] == beams, (i, out.beams, beams)
        assert [b.score for b in out.beams] == pytest.approx(scores, abs=1e-4), i
        assert out.token_ids == streamed[f"beam{i}"] == beams[0]  # one message, at the end
        finished_by_stop += sum(1 for b in beams if b[-1] in eos)
    assert finished_by_stop > 3, "some beams should end on an EOS id, so lengths differ"
    for i in range(6):
        prompt, params = requests[f"plain{i}"]
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False)
        assert streamed[f"plain{i}"] == ref[0, len(prompt) :].tolist()


def test_beams_share_blocks_and_copy_only_the_block_they_write(model_with_eos):
    model, _, _ = model_with_eos
    engine = Engine(model, NoText(), CacheConfig(block_size=4, num_blocks=200, watermark=0.0), BATCHING)
    prompt = list(range(40, 50))  # 10 tokens: two full blocks and a partial one
    engine.add_request("b", prompt, SamplingParams(max_tokens=8, num_beams=4, ignore_eos=True))
    engine.step()  # the prompt, then the fork into 4 beams
    blocks = engine.scheduler.blocks
    tables = [blocks.block_table(r.request_id) for r in engine.scheduler.running]
    assert len(tables) == 4
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1  # full blocks: shared
    assert blocks.num_free_blocks == 200 - 3  # counted once
    plan = engine.scheduler.schedule()
    assert len(plan.copies) == 3  # three beams copy the shared partial block, the last one keeps it
    assert len({c.block_table[2] for c in plan.chunks}) == 4
    blocks.check_integrity()
    engine.abort("b")
    assert blocks.num_free_blocks == 200
    blocks.check_integrity()


def test_fork_and_copy_on_write_bookkeeping():
    blocks = BlockManager(10, 4, prefix_caching=False)
    blocks.allocate("a", list(range(6)))  # blocks: full + partial
    blocks.fork("a", "b")
    assert blocks.num_free_blocks == 8
    assert blocks.can_append("b", 7, write_from=6)
    copy = blocks.append("b", 7, write_from=6)
    assert copy is not None and copy[0] == blocks.block_table("a")[1] and copy[1] == blocks.block_table("b")[1]
    assert blocks.append("a", 7, write_from=6) is None  # now a's block is its own again
    blocks.check_integrity()
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_free_blocks == 10
    blocks.check_integrity()


def test_beam_search_rules_on_a_hand_made_distribution():
    # Two beams over a 4-token vocabulary, token 3 stops. Step 1 from the prompt: 0.5 / 0.3 / 0.2.
    search = BeamSearch(2, max_tokens=5, stop_token_ids=[3], length_penalty=1.0)
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.0001, 0.1999]]))
    nxt = search.advance(lp)
    assert [(c.parent, c.token) for c in nxt] == [(0, 0), (0, 1)]
    assert search.finished == []  # the stop token ranked third: kept out of the finished list
    # Step 2: beam "0" stops with 0.5 * 0.9; beam "1" continues with 0.3 * 0.6.
    lp = torch.log(torch.tensor([[0.05, 0.04, 0.01, 0.9], [0.6, 0.2, 0.1, 0.1]]))
    nxt = search.advance(lp)
    assert [h.token_ids for h in search.finished] == [(0, 3)]
    assert search.finished[0].score == pytest.approx(float(torch.log(torch.tensor(0.45))) / 2)
    assert [(c.parent, c.token) for c in nxt] == [(1, 0), (1, 1)]
    assert not search.done


def test_sampling_parameters_that_beam_search_cannot_honour_are_refused():
    for bad in (dict(stop=("x",)), dict(logprobs=1), dict(min_tokens=2), dict(speculative_tokens=2)):
        with pytest.raises(ValueError, match="beam search"):
            SamplingParams(num_beams=2, **bad)
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(num_beams=2, early_stopping="sometimes")
    assert list(itertools.islice(iter(CASES), 1))


def test_beams_beside_a_speculating_request_keep_their_copy_on_write():
    """A step that speculates for one request still copies the blocks the beams of another share
    before they write them: the beams come out as they do alone."""
    from pathlib import Path

    from cluster.engine.speculative import NgramProposer
    from cluster.model.tokenizer import Tokenizer

    demo = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"
    model, tok = load_model(demo, "float32"), Tokenizer(demo)
    ids = tok.encode((demo / "heldout_eval.txt").read_text())
    cache = CacheConfig(block_size=4, num_blocks=400, watermark=0.0)
    budget = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, long_prefill_chunk=64)
    beam = (ids[100:110], SamplingParams(max_tokens=12, num_beams=3, temperature=0.0))
    plain = (ids[500:520] * 2, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    alone = drive(Engine(model, tok, cache, budget, tok.eos_token_ids), {"b": beam})[1]["b"]
    ngram = NgramProposer()
    speculating = Engine(model, tok, cache, budget, tok.eos_token_ids, proposer=ngram, num_speculative_tokens=4)
    mixed = drive(speculating, {"b": beam, "p": plain})[1]["b"]
    assert [(b.token_ids, pytest.approx(b.score, abs=1e-4)) for b in mixed.beams] == [
        (b.token_ids, b.score) for b in alone.beams
    ]
