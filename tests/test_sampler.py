"""The sampler on hand-made logits, and the incremental detokenizer on a real byte-level BPE."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.model_builder import train_tokenizer
from cluster.request import SamplingParams
from cluster.sampler import Sampler, SampleRow
from decode_worker.detokenizer import IncrementalDetokenizer

V = 8


def row(prompt=(), output=(), generator=None, suppressed=(), **params):
    return SampleRow(SamplingParams(**params), list(prompt), list(output), generator, suppressed)


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    rows = [row(temperature=0), row(top_k=1), row(top_p=1e-6), row(min_p=1.0), row(temperature=1e-4)]
    assert Sampler(V)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_suppressed_tokens_are_never_chosen():
    logits = torch.tensor([[0.0, 9.0, 8.0, 0, 0, 0, 0, 0]])
    assert Sampler(V)(logits, [row(temperature=0, suppressed=(1,))]).token_ids == [2]


def test_penalties():
    sampler = Sampler(V)
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0, 0, 0, 0]])
    out = sampler._penalise(logits.clone(), [row(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert out[0, :3].tolist() == [1.0, -4.0, 1.0]  # positive seen divided, negative seen multiplied
    out = sampler._penalise(logits.clone(), [row(output=[2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)])
    assert out[0, 2].item() == pytest.approx(1.0 - 0.5 - 0.5)
    assert out[0, 3].item() == pytest.approx(1.0 - 0.5 - 0.25)
    assert out[0, 0].item() == 2.0


def test_sampling_follows_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]]) + 1e-12)
    sampler = Sampler(V, seed=0)
    n = 4000
    draws = sampler(logits.expand(n, V), [row(top_p=0.85)] * n).token_ids
    freq = [draws.count(t) / n for t in range(V)]
    # top_p 0.85 keeps {0, 1, 2}: renormalised 0.5/0.9, 0.3/0.9, 0.1/0.9
    for t, p in enumerate([0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9]):
        assert abs(freq[t] - p) < 4 * math.sqrt(p * (1 - p) / n), (t, freq[t], p)
    assert sum(freq[3:]) == 0
    draws = sampler(logits.expand(n, V), [row(top_k=2, temperature=2.0)] * n).token_ids
    p0 = math.sqrt(0.5) / (math.sqrt(0.5) + math.sqrt(0.3))  # temperature 2 flattens: p ** (1/2)
    assert abs(draws.count(0) / n - p0) < 4 * math.sqrt(p0 * (1 - p0) / n)
    assert set(draws) == {0, 1}
    draws = sampler(logits.expand(n, V), [row(min_p=0.5)] * n).token_ids  # keeps p >= 0.25
    assert set(draws) == {0, 1}


def test_seeded_rows_ignore_their_neighbours():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))

    def seeded():
        return torch.Generator().manual_seed(7)

    alone = [Sampler(V, seed=s)(logits[:1], [row(generator=seeded())]).token_ids[0] for s in range(3)]
    with_others = [Sampler(V, seed=s)(logits, [row(generator=seeded()), row(), row()]).token_ids[0] for s in range(3)]
    assert alone == with_others and len(set(alone)) == 1


def test_logprobs_and_top_n():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 5.0]])
    result = Sampler(V)(logits, [row(temperature=0, logprobs=2), row(temperature=0)])
    expected = torch.log_softmax(logits, -1)
    assert result.logprobs[0] == pytest.approx(expected[0, 0].item())
    assert [t for t, _ in result.top_logprobs[0]] == [0, 2]
    assert result.top_logprobs[1] == []


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer as Raw

    raw: Raw = train_tokenizer(400)

    class Tok:
        def encode(self, text):
            return raw.encode(text).ids

        def decode(self, ids, skip_special_tokens=True):
            return raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    return Tok()


TEXT = 'print("héllo wörld ✓ 日本語 🙂")\nreturn x  # done'


def test_incremental_text_is_exact_and_never_splits_a_character(tokenizer):
    prompt = tokenizer.encode("# start\n")
    ids = tokenizer.encode(TEXT)
    assert len(ids) > 10
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) + detok.flush() == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas), "multi-byte characters should span tokens and wait"


@pytest.mark.parametrize("stop", ["wörld", "語 🙂", "\nret", "# done"])
def test_stop_strings_across_tokens(tokenizer, stop):
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop, "never there"])
    emitted = ""
    for t in tokenizer.encode(TEXT):
        emitted += detok.add(t)
        if detok.stopped:
            break
    emitted += detok.flush()
    assert detok.stopped
    assert emitted == TEXT[: TEXT.find(stop)]
