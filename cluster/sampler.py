"""Sampling, vectorised over the batch: penalties, temperature, top-k, top-p, min-p, logprobs.

Each row of the logits belongs to one request with its own `SamplingParams`. The parameters are
gathered into per-row tensors once per step and every transform runs on the whole batch. Random
draws use the exponential race (argmax of probs / Exp(1) noise, equivalent to sampling from probs);
a request with a seed draws its noise from its own generator, so its tokens do not depend on what
else is in the batch. Logprobs are those of the model's raw distribution (before penalties and
temperature), as the OpenAI API reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.request import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    """One row of a step's logits: the request's parameters and the tokens it has seen."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # the request's own, when it has a seed
    suppressed: tuple[int, ...] = ()  # token ids not allowed this step (EOS before min_tokens)


TokenLogprob = tuple[float, list[tuple[int, float]]]  # a token's log-probability and the top n alternatives


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
        self.generator = torch.Generator().manual_seed(seed)  # for rows without a seed of their own

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:  # logits [B, V] float32
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, rows)
        logits = self._adjust(logits, rows)
        tokens = logits.argmax(dim=-1)
        if not all(r.params.greedy for r in rows):
            greedy = torch.tensor([r.params.greedy for r in rows])
            sampled = self._draw(self._probs(logits, rows), rows)
            tokens = torch.where(greedy, tokens, sampled)
        token_ids = tokens.tolist()
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

    def verify(self, logits: torch.Tensor, rows: Sequence[SampleRow], drafts: Sequence[Draft]) -> VerifyResult:
        """Speculative decoding's acceptance step. For each request, `drafts` holds the k proposed
        tokens and `logits`/`rows` hold k + 1 consecutive rows: the target model's prediction before
        each draft token and one past the last (each row's history includes the drafts before it).

        Greedy rows keep the drafts that equal the target's argmax, then add the argmax where they
        first differ (or past the end): exactly the tokens of plain greedy decoding. Sampled rows use
        the rejection rule of speculative sampling: draft token x, proposed with probability q(x),
        is kept with probability min(1, p(x) / q(x)); the first rejected one is replaced by a sample
        from the residual max(0, p - q), renormalised; if all are kept, one more token is sampled
        from the last row. The output then follows the target distribution p exactly. A proposer
        without probabilities (n-gram lookup) proposes deterministically: q is a point mass."""
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, rows)
        probs = self.probabilities(logits, rows)
        token_ids, accepted, positions = [], [], []
        offset = 0
        for draft in drafts:
            k = len(draft.tokens)
            row = rows[offset]
            generator = row.generator or self.generator
            tokens: list[int] = []
            for j, x in enumerate(draft.tokens):
                p = probs[offset + j]
                if row.params.greedy:
                    keep = bool(p[x] == 1)
                    q = None
                else:
                    q = draft.probs[j] if draft.probs is not None else None
                    qx = float(q[x]) if q is not None else 1.0
                    keep = float(torch.rand((), generator=generator)) * qx < float(p[x])
                if keep:
                    tokens.append(x)
                    continue
                if row.params.greedy:
                    tokens.append(int(p.argmax()))
                else:
                    residual = (p - q).clamp_(min=0) if q is not None else p.clone().index_fill_(0, torch.tensor(x), 0)
                    tokens.append(self.draw_one(residual if bool(residual.sum() > 0) else p, generator))
                break
            else:
                p = probs[offset + k]
                tokens.append(int(p.argmax()) if row.params.greedy else self.draw_one(p, generator))
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

    def skip(self, generator: torch.Generator) -> None:
        """Advances a seeded request's generator past one sampled token (drawn where it was sampled
        elsewhere, as a prefill worker does), so its later tokens match a single-process run."""
        torch.empty(self.vocab_size).exponential_(generator=generator)

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
        """Penalties, then the suppressed tokens at -inf; `logits` itself is never changed (plain
        rows, the common case, get it back as it is)."""
        adjusted = self._penalise(logits, rows)
        for i, row in enumerate(rows):
            if row.suppressed:
                if adjusted is logits:
                    adjusted = logits.clone()
                adjusted[i, list(row.suppressed)] = float("-inf")
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
        """Temperature, top-k, top-p and min-p: the [B, V] distribution sampled rows draw from."""
        temperature = torch.tensor([r.params.temperature or 1.0 for r in rows])
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in rows])
        top_p = torch.tensor([r.params.top_p for r in rows])
        min_p = torch.tensor([r.params.min_p for r in rows])
        logits = logits / temperature[:, None]
        if bool((top_k < self.vocab_size).any() or (top_p < 1).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            rank = torch.arange(logits.shape[-1])[None, :]
            drop = rank >= top_k[:, None]
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            # Drop a token once the mass strictly before it already reaches top_p (the top one always stays).
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(logits, dim=-1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def draw_one(probs: torch.Tensor, generator: torch.Generator) -> int:
        """One token from the (unnormalised) distribution `probs` [V]."""
        return int((probs / torch.empty_like(probs).exponential_(generator=generator)).argmax())
