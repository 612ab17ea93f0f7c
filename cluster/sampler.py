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
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
        logits = self._penalise(logits.clone(), rows)
        for i, row in enumerate(rows):
            if row.suppressed:
                logits[i, list(row.suppressed)] = float("-inf")
        greedy = torch.tensor([r.params.greedy for r in rows])
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, rows)
            tokens = torch.where(greedy, tokens, sampled)
        token_ids = tokens.tolist()
        if raw_logprobs is None:
            return SampleResult(token_ids, None, None)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_n = max(r.params.logprobs or 0 for r in rows)
        top_vals, top_ids = raw_logprobs.topk(top_n, dim=-1) if top_n else (None, None)
        tops = []
        for i, row in enumerate(rows):
            n = row.params.logprobs or 0
            tops.append(list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True)) if n else [])
        return SampleResult(token_ids, chosen, tops)

    def skip(self, generator: torch.Generator) -> None:
        """Advances a seeded request's generator past one sampled token (drawn where it was sampled
        elsewhere, as a prefill worker does), so its later tokens match a single-process run."""
        torch.empty(self.vocab_size).exponential_(generator=generator)

    def _penalise(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
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

    def _sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
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
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        return (probs / noise).argmax(dim=-1)
