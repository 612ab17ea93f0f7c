"""Proposers for speculative decoding: cheap guesses of a request's next tokens.

Decode reads every weight once per step however many tokens the step checks, so a pass that
scores k guessed tokens costs about what a pass that makes one does. A proposer guesses; the
target model scores every guess in one pass; `Sampler.verify` keeps the guesses the target agrees
with (exactly, for greedy and seeded requests; in distribution, for other sampled ones) and adds
one token of its own. Rejected guesses leave nothing behind: the scheduler trims the blocks that held their KV.

    drafts = proposer.propose(requests, ks, rows_for)   # one `Draft` per request (maybe empty)
    ... the target verifies them ...
    proposer.retain(live_request_ids)                   # forget finished requests

A decode engine drives its proposer through a `Speculator`: after the scheduler's plan, and before
the pass, `speculator.draft(plan)` asks for each decoding request's draft, cuts it to what the
request's grammar accepts, and has the scheduler add what fits (each chunk's `draft`, with the
proposer's probabilities in `draft_probs`); the runner verifies them in the pass.

Two proposers:

- `NgramProposer` (prompt lookup): finds the most recent earlier occurrence of the request's last
  n tokens in its own prompt and output and proposes what followed it. No model; pays off when the
  output copies from the prompt (code edits, quoting, extraction).
- `DraftProposer`: a small model with the target's vocabulary, run in the same process over its
  own paged KV cache. Each request keeps its draft KV between steps; what the target rejected is
  recomputed on the next call. Given batch buckets, its passes after a request's first (one or
  two tokens per request) run through compiled graphs (`cluster.engine.compiled`). A seeded request's
  draft token at output index i is drawn with the noise the target samples index i with
  (`cluster.engine.sampler`), so the two agree as often as a shared draw lets them, and what it drafts
  never changes the request's tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.block_manager import BlockManager, kv_block_bytes, num_blocks_for_budget
from cluster.engine.compiled import CompiledDecode
from cluster.engine.request import Request, ScheduledChunk, StepPlan
from cluster.engine.sampler import Draft, Sampler, SampleRow
from cluster.engine.structured import grammatical
from cluster.model.attention import SeqChunk, allocate_kv_cache, as_decode_rows, build_attention_metadata
from cluster.model.causal_lm import CausalLM
from cluster.model.gguf import model_folder
from cluster.model.loader import load_model

# The sampling row of a request at a given history (drafted tokens appended to its output).
RowsFor = Callable[[Request, Sequence[int]], SampleRow]


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], ks: Sequence[int], rows_for: RowsFor) -> list[Draft]:
        """Up to `ks[i]` tokens to follow `requests[i]`'s current tokens (fewer, or none, is fine)."""
        ...

    def retain(self, request_ids: Iterable[str]) -> None:
        """Drops the state of every request not named."""
        ...


class DraftScheduler(Protocol):
    """What a `Speculator` needs of the decode scheduler."""

    def room(self, request: Request) -> int:
        """Draft tokens `request` could still keep."""
        ...

    def speculate(self, plan: StepPlan, drafts: Mapping[str, Sequence[int]]) -> StepPlan:
        """`plan` with as much of each request's draft as fits."""
        ...


class Speculator:
    """A proposer's part in a decode step: drafts for the plan's decoding requests, up to
    `num_tokens` each (or fewer, as a request asks)."""

    def __init__(self, proposer: Proposer, num_tokens: int, scheduler: DraftScheduler, rows_for: RowsFor) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.scheduler = scheduler
        self.rows_for = rows_for

    def warm_up(self) -> None:
        if isinstance(self.proposer, DraftProposer):
            self.proposer.warm_up()

    def draft(self, plan: StepPlan) -> StepPlan:
        """`plan` with drafts added to the chunks of its decoding requests (not beams), as far as
        the scheduler finds room; each is first cut to the prefix its request's grammar accepts."""
        candidates, ks = [], []
        for c in plan.chunks:
            if c.samples and c.num_new == 1 and c.request.group is None and (k := self._length(c.request)) > 0:
                candidates.append(c.request)
                ks.append(k)
        if not candidates:
            return plan
        proposals = self.proposer.propose(candidates, ks, self.rows_for)
        proposals = [grammatical(r.matcher, d) for r, d in zip(candidates, proposals, strict=True)]
        drafts = {r.request_id: d for r, d in zip(candidates, proposals, strict=True) if d.tokens}
        plan = self.scheduler.speculate(plan, {rid: d.tokens for rid, d in drafts.items()})
        chunks = tuple(_with_probs(c, drafts[c.request.request_id]) if c.draft else c for c in plan.chunks)
        return dataclasses.replace(plan, chunks=chunks)

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forgets the draft state of every request not named."""
        self.proposer.retain(request_ids)

    def _length(self, request: Request) -> int:
        asked = request.params.speculative_tokens
        k = self.num_tokens if asked is None else min(asked, self.num_tokens)
        return min(k, self.scheduler.room(request))


def _with_probs(chunk: ScheduledChunk, proposed: Draft) -> ScheduledChunk:
    """`chunk` with the probabilities of its draft as the plan kept it (the scheduler may have shortened it)."""
    if proposed.probs is None:
        return chunk
    return dataclasses.replace(chunk, draft_probs=proposed.probs[: len(chunk.draft)])


class NgramProposer:
    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, requests: Sequence[Request], ks: Sequence[int], rows_for: RowsFor) -> list[Draft]:
        pairs = zip(requests, ks, strict=True)
        return [Draft(tuple(lookup(r.all_token_ids, k, self.max_n, self.min_n))) for r, k in pairs]

    def retain(self, request_ids: Iterable[str]) -> None:
        pass  # stateless


def lookup(tokens: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of `tokens`' last n tokens,
    for the longest n in [min_n, max_n] that occurs; [] when none does."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = list(tokens[-n:])
        first = suffix[0]
        # Search right to left, so the latest match (the most relevant context) wins.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []


@dataclass
class _DraftState:
    computed: int = 0  # leading positions whose draft KV is valid
    proposed_at: int = 0  # where the last proposal started
    proposed: tuple[int, ...] = ()  # and what it was, to find how much of it the target kept


class DraftProposer:
    """Runs a draft model autoregressively for k tokens per request, all requests batched per pass."""

    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, sampler: Sampler, compile_buckets: Sequence[int] = ()
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        arch = model.arch
        # One block past the block manager's range: the scratch block that compiled padding rows use.
        self.kv_cache = allocate_kv_cache(
            arch.num_layers, num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim,
            model.embed_tokens.weight.dtype, self.device,
        )  # fmt: skip
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.compiled = CompiledDecode(model, compile_buckets, block_size, num_blocks) if compile_buckets else None
        self.sampler = sampler
        self._states: dict[str, _DraftState] = {}

    def warm_up(self) -> None:
        """Compiles the draft model's buckets now (when it has them)."""
        if self.compiled is not None:
            self.compiled.warm_up(self.kv_cache)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], ks: Sequence[int], rows_for: RowsFor) -> list[Draft]:
        live: list[tuple[int, Request, int]] = []  # (index, request, k) of requests that get a draft
        for i, (request, k) in enumerate(zip(requests, ks, strict=True)):
            if k > 0 and self._prepare(request, k):
                live.append((i, request, k))
        drafts = [Draft(())] * len(requests)
        if not live:
            return drafts
        tokens: dict[int, list[int]] = {i: [] for i, _, _ in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in live}
        for step in range(max(k for _, _, k in live)):
            batch = [(i, r) for i, r, k in live if k > step]
            chunks, ids = [], []
            for i, r in batch:
                state = self._states[r.request_id]
                if step == 0:  # catch up: every token whose draft KV is missing, then predict
                    new = r.token_ids(state.computed, r.num_tokens)
                    chunks.append(SeqChunk(self.blocks.block_table(r.request_id), state.computed, len(new)))
                else:
                    new = [tokens[i][-1]]
                    chunks.append(SeqChunk(self.blocks.block_table(r.request_id), r.num_tokens + step - 1, 1))
                ids.extend(new)
            logits = self._logits(ids, chunks)
            # Greedy requests take the draft's argmax (a guess needs no penalties, and greedy
            # verification needs no draft probabilities); sampled ones draw from the distribution
            # their own parameters give, which verification needs.
            greedy = logits.argmax(-1).tolist()
            sampled = [(n, i, r) for n, (i, r) in enumerate(batch) if not r.params.greedy]
            if sampled:
                rows = [rows_for(r, tokens[i]) for _, i, r in sampled]
                dist = self.sampler.probabilities(logits[[n for n, _, _ in sampled]], rows)
                drawn = self.sampler.draw(dist, rows).tolist()  # a seeded row: the noise of its index
                for (_, i, _), p, token in zip(sampled, dist, drawn, strict=True):
                    probs[i].append(p)
                    tokens[i].append(token)
            for n, (i, r) in enumerate(batch):
                if r.params.greedy:
                    tokens[i].append(greedy[n])
        for i, r, k in live:
            state = self._states[r.request_id]
            state.computed = r.num_tokens + k - 1
            state.proposed_at, state.proposed = r.num_tokens, tuple(tokens[i])
            drafts[i] = Draft(tuple(tokens[i]), torch.stack(probs[i]) if probs[i] else None)
        return drafts

    def _logits(self, ids: list[int], chunks: list[SeqChunk]) -> torch.Tensor:
        """One pass of the draft model: float32 logits [len(chunks), vocab] at each chunk's last token."""
        ends = list(itertools.accumulate(c.num_new for c in chunks))  # one past each chunk's last row
        if self.compiled is not None and self.compiled.fits(ends[-1]):
            logits = self.compiled(ids, as_decode_rows(chunks), self.kv_cache)
            return logits[[end - 1 for end in ends]].cpu()
        meta = build_attention_metadata(chunks, self.block_size, self.model.windows, self.device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, meta.positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden[meta.last_token_index]).float().cpu()

    def _prepare(self, request: Request, k: int) -> bool:
        """Rolls the request's draft KV back to what the target kept and gives it blocks for k more
        positions; False (no draft this step) when the draft cache is full."""
        rid = request.request_id
        state = self._states.get(rid)
        if state is None:
            state = self._states[rid] = _DraftState()
        else:
            kept = 0
            for j, token in enumerate(state.proposed):
                at = state.proposed_at + j
                if at >= request.num_tokens or request.token_ids(at, at + 1)[0] != token:
                    break
                kept += 1
            state.computed = min(state.computed, state.proposed_at + kept, request.num_tokens - 1)
        needed = request.num_tokens + k - 1  # positions written: the catch-up and k - 1 drafts
        if rid not in self.blocks:
            if not self.blocks.can_allocate(range(needed)):
                del self._states[rid]
                return False
            self.blocks.allocate(rid, range(needed))
            return True
        self.blocks.trim(rid, state.computed)
        if not self.blocks.can_append(rid, needed):
            self.blocks.free(rid)
            del self._states[rid]
            return False
        self.blocks.append(rid, needed)
        return True

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        for rid in [rid for rid in self._states if rid not in keep]:
            del self._states[rid]
            self.blocks.free(rid)


def build_proposer(
    config: SpeculativeConfig, target: CausalLM, block_size: int, seed: int = 0, compile_buckets: Sequence[int] = ()
) -> Proposer | None:
    """The proposer a deployment's config asks for; the draft model loads beside the target, on
    its device and in its dtype (its passes compiled for `compile_buckets` rows, when given).
    Raises ValueError for a draft whose vocabulary differs."""
    if config.method == "none":
        return None
    if config.method == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    assert config.draft_model is not None
    weight = target.embed_tokens.weight
    dtype = "bfloat16" if weight.dtype == torch.bfloat16 else "float32"
    draft = load_model(model_folder(config.draft_model), dtype, weight.device.type)
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"draft model {config.draft_model} has {draft.arch.vocab_size} tokens, the served model "
            f"{target.arch.vocab_size}: they must share a vocabulary"
        )
    a = draft.arch
    per_block = kv_block_bytes(block_size, a.num_layers, a.num_kv_heads, a.head_dim, weight.element_size())
    num_blocks = num_blocks_for_budget(int(config.draft_memory_gib * 2**30), per_block)
    return DraftProposer(draft, num_blocks, block_size, Sampler(a.vocab_size, seed), compile_buckets)
