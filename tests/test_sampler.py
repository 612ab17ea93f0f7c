"""The sampler on hand-made logits, and the incremental detokenizer on a real byte-level BPE."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.request import SamplingParams
from cluster.engine.sampler import Draft, Sampler, SampleRow, exponential_noise, noise, noise_key
from cluster.model import cpu_kernels
from cluster.model.builder import train_tokenizer

V = 8


def row(prompt=(), output=(), suppressed=(), **params):
    return SampleRow(SamplingParams(**params), list(prompt), list(output), suppressed)


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
    alone = [Sampler(V, seed=s)(logits[:1], [row(seed=7)]).token_ids[0] for s in range(3)]
    with_others = [Sampler(V, seed=s)(logits, [row(seed=7), row(), row()]).token_ids[0] for s in range(3)]
    assert alone == with_others and len(set(alone)) == 1


def test_seeded_noise_is_splitmix64_of_a_key_from_seed_and_index():
    """The noise is defined by this arithmetic alone (no library generator): a pure-Python
    splitmix64 gives the same values, for any 64-bit seed."""
    mask = (1 << 64) - 1

    def finalise(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    for seed, index in [(0, 0), (7, 3), (2**64 - 1, 95), (2**63, 1)]:
        key = noise_key(seed, index)
        top23 = [finalise((key + (j + 1) * 0x9E3779B97F4A7C15) & mask) >> 41 for j in range(64)]
        expected = [-math.log((2 * t + 1) / 2**24) for t in top23]
        assert noise(seed, index, 64).tolist() == pytest.approx(expected, rel=1e-6)
    assert noise_key(1, 0) != noise_key(0, 1) and noise_key(5, 2) == noise_key(5, 2)


@pytest.mark.skipif(not cpu_kernels.used(), reason="the CPU kernels are not built on this machine")
def test_the_kernels_draw_the_same_noise_as_torch_s_int64_ops(monkeypatch):
    """`tandem_cpu::race_uniforms` makes the uniforms the torch expression makes, bit for bit, so a
    seeded stream is the same on a worker with the kernels and one without."""
    keys = torch.tensor([noise_key(s, i) - 2**63 for s, i in [(0, 0), (7, 3), (2**64 - 1, 95), (2**63, 1)]])
    keys = torch.cat([keys, torch.tensor([0, -1, 2**63 - 1, -(2**63)])])
    with_kernels = exponential_noise(keys, 49_157)
    monkeypatch.setattr(cpu_kernels, "used", lambda: False)
    assert torch.equal(with_kernels, exponential_noise(keys, 49_157))


def test_seeded_noise_is_exponential_and_unrelated_across_seeds_and_indices():
    e = exponential_noise(torch.tensor([noise_key(3, 0) - 2**63]), 200_000)[0]
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.02 and float(e.min()) > 0
    rows = torch.stack([noise(s, i, 4096) for s in range(4) for i in range(4)])
    corr = torch.corrcoef(rows)
    off_diagonal = corr[~torch.eye(len(rows), dtype=torch.bool)]
    assert float(off_diagonal.abs().max()) < 0.08


def test_a_seeded_draw_depends_only_on_seed_index_and_logits():
    """The same (seed, output index, logits) gives the same token whatever the batch, the sampler's
    own seed or what it drew before; another index or seed draws afresh."""
    vocab = 4096
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)) * 0.5
    target = row(output=[1] * 5, seed=11, temperature=0.8, top_p=0.95)
    alone = Sampler(vocab, seed=0)(logits, [target]).token_ids[0]
    busy = Sampler(vocab, seed=9)
    for _ in range(3):  # history: unseeded and seeded draws of other requests
        busy(logits.expand(4, vocab), [row(), row(seed=11), row(seed=12, output=[3] * 5), row(top_k=5)])
    neighbours = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    batch = torch.cat([neighbours[:2], logits, neighbours[2:]])
    rows = [row(top_p=0.5), row(seed=11, output=[2] * 4), target, row(seed=11, output=[9] * 5, temperature=0)]
    assert busy(batch, rows).token_ids[2] == alone
    other_history = row(output=[7, 8, 9, 10, 11], seed=11, temperature=0.8, top_p=0.95)
    assert Sampler(vocab)(logits, [other_history]).token_ids[0] == alone  # the index counts, not the tokens
    by_index = {Sampler(vocab)(logits, [row(output=[1] * i, seed=11)]).token_ids[0] for i in range(20)}
    by_seed = {Sampler(vocab)(logits, [row(output=[1] * 5, seed=s)]).token_ids[0] for s in range(20)}
    assert len(by_index) > 10 and len(by_seed) > 10


def test_seeded_draws_over_many_seeds_follow_the_distribution():
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0])
    n = 4000
    draws = Sampler(V)(torch.log(p + 1e-12).expand(n, V), [row(seed=s) for s in range(n)]).token_ids
    for t in range(V):
        q = float(p[t])
        assert abs(draws.count(t) / n - q) < 4 * math.sqrt(q * (1 - q) / n) + 1e-9, (t, draws.count(t) / n, q)


def test_seeded_verification_gives_the_plain_tokens_whatever_was_drafted():
    """A seeded row's verified tokens are those plain decoding samples at each index, for any draft
    (right, wrong, with or without draft probabilities): a rollback or a restart replays them."""
    vocab, k = 64, 4
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(5))
    params = dict(seed=21, temperature=0.9)
    plain: list[int] = []
    for j in range(k + 1):  # plain decoding, one token per step
        plain.append(Sampler(vocab)(logits[j : j + 1], [row(output=[0, 0, *plain], **params)]).token_ids[0])

    def verify(drafted: tuple[int, ...], probs: torch.Tensor | None = None) -> list[int]:
        rows = [row(output=[0, 0, *drafted[:j]], **params) for j in range(len(drafted) + 1)]
        result = Sampler(vocab, seed=len(drafted)).verify(logits[: len(drafted) + 1], rows, [Draft(drafted, probs)])
        return result.token_ids[0]

    assert verify(tuple(plain[:k])) == plain  # all kept, then the bonus token
    wrong = ((plain[0] + 1) % vocab, *plain[1:k])
    assert verify(wrong) == plain[:1]
    assert verify((plain[0], plain[1], (plain[2] + 1) % vocab)) == plain[:3]
    q = torch.softmax(torch.randn(2, vocab), -1)
    assert verify((plain[0], (plain[1] + 3) % vocab), q) == plain[:2]
    assert verify(()) == plain[:1]


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


def test_the_detokenizer_keeps_only_the_text_it_has_not_released(tokenizer):
    """Each token costs the same however long the output: what is kept between tokens is the held-back
    tail (a possible stop string, a partial character), never the whole output."""
    detok = IncrementalDetokenizer(tokenizer, [], stop=["never there"])
    ids = tokenizer.encode(TEXT) * 200
    out = []
    for t in ids:
        out.append(detok.add(t))
        assert len(detok._pending) <= len("never there") + 8, "the detokenizer holds more than its hold-back"
    assert "".join(out) + detok.flush() == TEXT * 200


@pytest.mark.parametrize("stop", ["wörld", "語 🙂", "\nret", "# done", "never there"])
def test_a_detokenizer_after_a_move_releases_and_stops_as_the_undisturbed_one(tokenizer, stop):
    """At every token a request could move at: the client has what the old detokenizer released; the
    new one, opened `after` the output so far, releases the rest and stops where the old one would
    have, a stop string that began before the move included (the moves at 1 to len(stop) - 1 characters
    into it straddle it)."""
    prompt, ids = tokenizer.encode("# start\n"), tokenizer.encode(TEXT * 3)
    whole = TEXT * 3
    expected = whole[: whole.find(stop)] if stop in whole else whole
    for moved in range(len(ids)):
        before = IncrementalDetokenizer(tokenizer, prompt, stop=[stop])
        received = "".join(before.add(t) for t in ids[:moved])
        if before.stopped:
            break
        after = IncrementalDetokenizer.after(tokenizer, prompt, ids[:moved], stop=[stop])
        for t in ids[moved:]:
            received += after.add(t)
            if after.stopped:
                break
        received += after.flush()
        assert received == expected, f"moved after {moved} tokens"
