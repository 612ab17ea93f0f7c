"""Sampling, vectorised over the batch: penalties, temperature, top-k, top-p, min-p, logprobs.

Each row of the logits belongs to one request with its own `SamplingParams`. The parameters are
gathered into per-row tensors once per step and every transform runs on the whole batch. Random
draws use the exponential race: the token is argmax(probs / E), E a vector of Exp(1) noise, one
entry per vocabulary token (equivalent to sampling from probs, and unmoved by the last-bit
differences that another batch shape gives the logits). Logprobs are those of the model's raw
distribution (before penalties and temperature), as the OpenAI API reports them.

The seeded rule: a request with a seed draws the token at output index i (its position in the
request's whole output: i tokens came before it, wherever they were sampled) with the noise
`noise(seed, i, vocab)`, a pure function (counter-based: splitmix64 over a key mixed from seed
and index, one counter per vocabulary entry). A seeded draw depends on (seed, index, the row's
logits) and nothing else: not the batch, the worker or the draws before it. So a seeded request
gives the same tokens alone or in any batch, preempted and recomputed, moved to another worker
after a failure, with its first token sampled on a prefill worker, and with or without speculative
decoding: verification and the draft model take the token at index i from that same noise
(`verify`). Rows without a seed draw keys for their noise from the sampler's own generator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cluster.engine.request import SamplingParams, TokenLogprob
from cluster.model import cpu_kernels

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # and its finaliser's multipliers


def _signed(x: int) -> int:
    """A 64-bit word as the int64 that holds its bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _fmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def noise_key(seed: int, index: int) -> int:
    """The 64-bit key of a seeded request's draw at output index `index`. For one seed, distinct
    indices give distinct keys; nearby seeds or indices give unrelated ones."""
    h = _fmix64(((seed & _MASK) + _GOLDEN) & _MASK)
    return _fmix64(((h ^ (index & _MASK)) + _GOLDEN) & _MASK)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] float32 Exp(1) noise, row r a pure function of `keys[r]` (int64 [n]): entry j is
    splitmix64's output j + 1 for the state `keys[r]`, its top 23 bits k as u = (2k + 1) / 2**24
    (exact in float32, never 0 or 1), and the noise -log(u). Integer products wrap modulo 2**64;
    right shifts are masked to act as logical ones."""
    if keys.device.type == "cpu" and cpu_kernels.used():  # the same uniforms in one pass (20 ms for 8 rows here)
        return torch.ops.tandem_cpu.race_uniforms(keys, vocab).log_().neg_()
    counters = torch.arange(1, vocab + 1, dtype=torch.int64) * _signed(_GOLDEN)
    z = keys[:, None] + counters
    z ^= (z >> 30) & ((1 << 34) - 1)
    z *= _signed(_M1)
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= _signed(_M2)
    z ^= (z >> 31) & ((1 << 33) - 1)
    u = ((z >> 41) & 0x7FFFFF).float().mul_(2).add_(1).mul_(2.0**-24)
    return u.log_().neg_()


def noise(seed: int, index: int, vocab: int) -> torch.Tensor:
    """[vocab] the Exp(1) noise a request with `seed` draws its output token `index` with."""
    return exponential_noise(torch.tensor([_signed(noise_key(seed, index))]), vocab)[0]


@dataclass(frozen=True)
class SampleRow:
    """One row of a step's logits: the request's parameters and the tokens it has seen. The row
    picks output token `index`, the count of its output tokens so far."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    suppressed: tuple[int, ...] = ()  # token ids not allowed this step (EOS before min_tokens)
    allowed: torch.Tensor | None = None  # structured output: the int32 bitmask of the tokens allowed

    @property
    def index(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class Draft:
    """Tokens a proposer suggests for one request, and the probability it gave each (a [k, V]
    tensor, rows summing to one), or None for a deterministic proposer."""

    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class VerifyResult:
    token_ids: list[list[int]]  # per request: accepted drafts, then one token of the target's own
    accepted: list[int]  # per request: how many draft tokens were kept
    logprobs: list[list[TokenLogprob]] | None  # per request, per token


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # of each sampled token, when any row asked
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)  # noise keys of rows without a seed

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:  # logits [B, V] float32
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, rows)
        # A greedy structured-output row is masked only when its argmax is a token the mask refuses:
        # where the model already follows the constraint, the argmax is the masked one.
        lazy = [i for i, r in enumerate(rows) if r.allowed is not None and r.params.greedy]
        first = [dataclasses.replace(r, allowed=None) if r.allowed is not None and r.params.greedy else r for r in rows]
        logits = self._adjust(logits, first if lazy else rows)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            picked = [rows[i] for i in sampled]
            tokens[sampled] = self.draw(self._probs(logits[sampled], picked), picked)
        token_ids = tokens.tolist()
        for i in lazy:
            allowed, t = rows[i].allowed, token_ids[i]
            if not (int(allowed[t >> 5]) >> (t & 31)) & 1:  # type: ignore[index]
                logits[i].masked_fill_(unpack_bitmask(~allowed[None], logits.shape[-1])[0], float("-inf"))  # type: ignore[index]
                token_ids[i] = int(logits[i].argmax())
        if raw_logprobs is None:
            return SampleResult(token_ids, None, None)
        chosen, tops = self._logprobs(raw_logprobs, list(range(len(rows))), token_ids, rows)
        return SampleResult(token_ids, chosen, tops)

    def probabilities(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """[B, V] the distribution each row samples from: penalties, suppression, temperature, top-k,
        top-p and min-p applied; a greedy row is one-hot on its argmax."""
        logits = self._adjust(logits.float(), rows)
        probs = torch.zeros_like(logits)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            probs[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(-1), logits.shape[-1]).float()
        if sampled:
            probs[sampled] = self._probs(logits[sampled], [rows[i] for i in sampled])
        return probs

    def draw(self, probs: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """[B] one token per row from the (unnormalised) distributions `probs` [B, V]: the
        exponential race, with each seeded row's noise that of its (seed, index)."""
        return (probs / self.noise(rows)).argmax(dim=-1)

    def noise(self, rows: Sequence[SampleRow]) -> torch.Tensor:
        """[B, V] Exp(1) noise for each row's next token: `noise(seed, index)` for a seeded row,
        from a key the sampler's generator draws for any other."""
        keys = torch.randint(-(2**63), 2**63 - 1, (len(rows),), generator=self.generator, dtype=torch.int64)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                keys[i] = _signed(noise_key(row.params.seed, row.index))
        return exponential_noise(keys, self.vocab_size)

    def verify(self, logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[Draft]) -> VerifyResult:
        """Speculative decoding's acceptance step. For each request, `drafts` holds the k proposed
        tokens and `logits`/`rows` hold k + 1 consecutive rows: the target model's prediction before
        each draft token and one past the last (each row's history includes the drafts before it).

        Greedy and seeded rows take, at each position, the token plain decoding would take there
        (the argmax; the seeded draw of that output index), keep the drafts that equal it, then
        add it where they first differ (or past the end): exactly the tokens of plain decoding,
        whatever was drafted. A seeded draft x is thus kept with probability p(x) when the proposer
        is deterministic, as in the rule below; a draft model drawing with the same noise
        (`DraftProposer`) has its token kept whenever both draws agree.

        Unseeded sampled rows use the rejection rule of speculative sampling: draft token x,
        proposed with probability q(x), is kept with probability min(1, p(x) / q(x)); the first
        rejected one is replaced by a sample from the residual max(0, p - q), renormalised; if all
        are kept, one more token is sampled from the last row. The output then follows the target
        distribution p exactly. A proposer without probabilities (n-gram lookup) proposes
        deterministically: q is a point mass."""
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, rows)
        probs = self.probabilities(logits, rows)
        exact = self._exact(probs, rows)
        token_ids, accepted, positions = [], [], []
        offset = 0
        for draft in drafts:
            k = len(draft.tokens)
            if exact[offset] is not None:
                tokens = _follow(draft.tokens, exact[offset : offset + k + 1])  # type: ignore[arg-type]
            else:
                tokens = self._speculative_sample(probs[offset : offset + k + 1], draft)
            token_ids.append(tokens)
            accepted.append(len(tokens) - 1)
            positions.append(list(range(offset, offset + len(tokens))))
            offset += k + 1
        if raw_logprobs is None:
            return VerifyResult(token_ids, accepted, None)
        flat = [i for ps in positions for i in ps]
        chosen, tops = self._logprobs(raw_logprobs, flat, [t for ts in token_ids for t in ts], [rows[i] for i in flat])
        pairs = list(zip(chosen, tops, strict=True))
        logprobs, at = [], 0
        for ts in token_ids:
            logprobs.append(pairs[at : at + len(ts)])
            at += len(ts)
        return VerifyResult(token_ids, accepted, logprobs)

    def _exact(self, probs: torch.Tensor, rows: Sequence[SampleRow]) -> list[int | None]:
        """Each row's plain-decoding token where it is fixed by the row alone: the argmax of a greedy
        row, the seeded draw of a seeded one; None for an unseeded sampled row."""
        tokens = probs.argmax(dim=-1)
        seeded = [i for i, r in enumerate(rows) if not r.params.greedy and r.params.seed is not None]
        if seeded:
            tokens[seeded] = self.draw(probs[seeded], [rows[i] for i in seeded])
        out: list[int | None] = list(tokens.tolist())
        for i, row in enumerate(rows):
            if not row.params.greedy and row.params.seed is None:
                out[i] = None
        return out

    def _speculative_sample(self, probs: torch.Tensor, draft: Draft) -> list[int]:
        """The rejection rule (see `verify`) for one unseeded request: `probs` [k + 1, V]."""
        tokens: list[int] = []
        for j, x in enumerate(draft.tokens):
            p = probs[j]
            q = draft.probs[j] if draft.probs is not None else None
            qx = float(q[x]) if q is not None else 1.0
            if float(torch.rand((), generator=self.generator)) * qx < float(p[x]):
                tokens.append(x)
                continue
            residual = (p - q).clamp_(min=0) if q is not None else p.clone().index_fill_(0, torch.tensor(x), 0)
            tokens.append(self._draw_unseeded(residual if bool(residual.sum() > 0) else p))
            return tokens
        tokens.append(self._draw_unseeded(probs[len(draft.tokens)]))
        return tokens

    def _draw_unseeded(self, probs: torch.Tensor) -> int:
        """One token from the (unnormalised) distribution `probs` [V], with noise of a fresh key."""
        key = torch.randint(-(2**63), 2**63 - 1, (1,), generator=self.generator, dtype=torch.int64)
        return int((probs / exponential_noise(key, probs.shape[-1])[0]).argmax())

    def _raw_logprobs(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor | None:
        return torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None

    def _logprobs(
        self, raw: torch.Tensor, at: Sequence[int], token_ids: Sequence[int], rows: Sequence[SampleRow]
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Each sampled token's log-probability at row `at[i]` of `raw`, and that row's top n."""
        index = torch.tensor(list(at), dtype=torch.long)
        raw = raw[index]
        chosen = raw.gather(1, torch.tensor(list(token_ids))[:, None]).squeeze(1).tolist()
        top_n = max(r.params.logprobs or 0 for r in rows)
        top_vals, top_ids = raw.topk(top_n, dim=-1) if top_n else (None, None)
        tops = []
        for i, row in enumerate(rows):
            n = row.params.logprobs or 0
            tops.append(list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True)) if n else [])
        return chosen, tops

    def _adjust(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """Penalties, then the suppressed tokens and those outside a row's structured-output mask
        at -inf. Plain rows, the common case, get `logits` back as it is; a structured-output row's
        mask is applied in place (the step's logits are its own: callers never read them again)."""
        adjusted = self._penalise(logits, rows)
        for i, row in enumerate(rows):
            if row.suppressed:
                if adjusted is logits:
                    adjusted = logits.clone()
                adjusted[i, list(row.suppressed)] = float("-inf")
        constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
        if constrained:  # in place: one pass over each constrained row, none over the others
            refused = unpack_bitmask(~torch.stack([rows[i].allowed for i in constrained]), logits.shape[-1])  # type: ignore[misc]
            if len(constrained) == len(rows):
                adjusted.masked_fill_(refused, float("-inf"))
            else:
                for j, i in enumerate(constrained):
                    adjusted[i].masked_fill_(refused[j], float("-inf"))
        return adjusted

    def _penalise(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """Repetition, presence and frequency penalties, out of place; `logits` where none applies."""
        if all(r.params.repetition_penalty == 1 and r.params.presence_penalty == 0 == r.params.frequency_penalty
               for r in rows):  # fmt: skip
            return logits
        rep = torch.tensor([r.params.repetition_penalty for r in rows])
        pres = torch.tensor([r.params.presence_penalty for r in rows])
        freq = torch.tensor([r.params.frequency_penalty for r in rows])
        if bool((rep != 1).any()):
            seen = self._counts(rows, include_prompt=True) > 0
            factor = torch.where(logits > 0, 1 / rep[:, None], rep[:, None])
            logits = torch.where(seen, logits * factor, logits)
        if bool((pres != 0).any() or (freq != 0).any()):
            counts = self._counts(rows, include_prompt=False)
            logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
        return logits

    def _counts(self, rows: Sequence[SampleRow], include_prompt: bool) -> torch.Tensor:
        """[B, V] occurrences of each token in each row's outputs (and prompt)."""
        counts = torch.zeros(len(rows), self.vocab_size)
        for i, row in enumerate(rows):
            ids = [*row.prompt_token_ids, *row.output_token_ids] if include_prompt else row.output_token_ids
            if ids:
                counts[i].index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))
        return counts

    def _probs(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p: the [B, V] distribution sampled rows draw from. Each
        row's filters touch that row only (a neighbour's top-p never reshapes it)."""
        temperature = torch.tensor([r.params.temperature or 1.0 for r in rows])
        min_p = torch.tensor([r.params.min_p for r in rows])
        logits = logits / temperature[:, None]
        filtered = [i for i, r in enumerate(rows) if 0 < r.params.top_k < self.vocab_size or r.params.top_p < 1]
        if filtered:
            logits[filtered] = self._top_k_top_p(logits[filtered], [rows[i] for i in filtered])
        probs = torch.softmax(logits, dim=-1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _top_k_top_p(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """`logits` with every token outside each row's top-k and top-p set to -inf."""
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in rows])
        top_p = torch.tensor([r.params.top_p for r in rows])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1])[None, :]
        drop = rank >= top_k[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p (the top one always stays).
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] bool from an [n, words] int32 bitmask (bit j of word w is token 32 w + j)."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab])).view(torch.bool)  # 0/1 bytes are bools


def _follow(drafted: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The drafts that equal the target tokens, then the first target that differs (or the one past
    the last draft): `targets` has one more entry than `drafted`."""
    tokens = []
    for x, t in zip(drafted, targets, strict=False):
        tokens.append(t)
        if x != t:
            return tokens
    tokens.append(targets[len(drafted)])
    return tokens
