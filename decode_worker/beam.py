"""Beam search: keep the `num_beams` best partial continuations, finish the best complete ones.

The rule is Hugging Face transformers' `generate(num_beams=n, do_sample=False)`, step for step,
so the same weights give the same sequences and scores:

- Each step, every running beam's log-softmax is added to its running score; the best
  `max(2, 1 + number of stop tokens) * n` (beam, token) candidates are kept, best first.
- A candidate ending in a stop token (or reaching `max_tokens`) is finished: among the first n
  candidates it joins the finished hypotheses with score `sum of log-probs / length ** length_penalty`
  (length counts generated tokens), and the n best hypotheses are kept. The other candidates, best
  first, become the n running beams.
- `early_stopping`: "true" ends as soon as n hypotheses are finished; "false" (the default) ends
  once the best running beam, scored at its current length, cannot beat the worst finished one;
  "never" scores it at `max_tokens` when `length_penalty > 0` (the canonical, exhaustive rule).

`BeamSearch` is the arithmetic only. `BeamGroups` runs each running beam as a sequence whose KV
blocks are shared with its siblings (`BlockManager.fork`, copy-on-write), in the engine's step:

    plan = beams.settle(scheduler.schedule())        # a group's beams run together, or not at all
    output = runner.run(plan)                        # a beam's row is not sampled: its logits come back
    scheduler.update(beams.unsampled(plan), ...)     # the other requests' tokens
    finished = beams.advance(output.logits)          # each group's step: its beams forked anew
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from cluster.engine.request import Request, StepPlan
from decode_worker.scheduler import Scheduler

EarlyStopping = str  # "true", "false" or "never"
_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens, the stop token included
    score: float  # sum of log-probs / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (a stop token) or "length"


@dataclass(frozen=True)
class Continuation:
    parent: int  # index of the running beam it extends
    token: int
    score: float  # its sum of log-probs


class BeamSearch:
    def __init__(
        self,
        num_beams: int,
        max_tokens: int,
        stop_token_ids: Collection[int],
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = "false",
    ) -> None:
        if num_beams < 1:
            raise ValueError("num_beams must be >= 1")
        if early_stopping not in ("true", "false", "never"):
            raise ValueError('early_stopping must be "true", "false" or "never"')
        self.num_beams = num_beams
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.candidates = max(2, 1 + len(self.stop_token_ids)) * num_beams
        self.running: list[tuple[tuple[int, ...], float]] = [((), 0.0)]  # (tokens, sum of log-probs), best first
        self.finished: list[Hypothesis] = []  # best first, at most num_beams
        self.done = False
        self._improvable = True

    @property
    def generated(self) -> int:
        """Tokens each running beam has generated (they all have the same length)."""
        return len(self.running[0][0])

    def advance(self, logprobs: torch.Tensor) -> list[Continuation]:
        """One step: `logprobs` [len(running), V] are the running beams' log-softmaxed next-token
        distributions, in `running` order. Returns the new running beams as continuations of the
        old ones (empty once the search is done)."""
        n, vocab = self.num_beams, logprobs.shape[-1]
        scores = torch.tensor([score for _, score in self.running], dtype=torch.float32)
        if len(self.running) < n:  # the first step: transformers pads with impossible beams
            scores = torch.cat([scores, torch.full((n - len(self.running),), _NEG)])
            logprobs = torch.cat([logprobs, logprobs.new_zeros(n - len(self.running), vocab)])
        total = (logprobs.float() + scores[:, None]).flatten()
        top_scores, top_index = total.topk(min(self.candidates, total.numel()))
        length = self.generated + 1
        candidates = []
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist(), strict=True)):
            parent, token = divmod(index, vocab)
            stops = token in self.stop_token_ids or length >= self.max_tokens
            candidates.append((rank, parent, token, score, stops))
        # Finished: stopping candidates among the first n, while they can still make the list.
        full = len(self.finished) == n and self.early_stopping == "true"
        if self._improvable and not full:
            for rank, parent, token, score, stops in candidates:
                if stops and rank < n:
                    tokens = (*self.running[parent][0], token) if parent < len(self.running) else (token,)
                    reason = "stop" if token in self.stop_token_ids else "length"
                    self.finished.append(Hypothesis(tokens, score / length**self.length_penalty, reason))
            self.finished = sorted(self.finished, key=lambda h: h.score, reverse=True)[:n]
        # Running: the best n candidates, stopping ones ranked as impossible.
        ranked = [(score + (_NEG if stops else 0.0), parent, token) for _, parent, token, score, stops in candidates]
        ranked = sorted(ranked, key=lambda c: c[0], reverse=True)[:n]
        nxt = [Continuation(parent, token, score) for score, parent, token in ranked]
        self.running = [((*self.running[c.parent][0], c.token), c.score) for c in nxt]
        self._improvable = self._improvable and self._can_improve()
        all_finished = len(self.finished) == n and self.early_stopping == "true"
        if not self._improvable or all_finished or all(c[4] for c in candidates):
            self.done = True
            return []
        return nxt

    def _can_improve(self) -> bool:
        exhaustive = self.early_stopping == "never" and self.length_penalty > 0
        best_length = self.max_tokens if exhaustive else self.generated
        best_possible = self.running[0][1] / best_length**self.length_penalty
        if len(self.finished) < self.num_beams:
            return best_possible > _NEG
        return best_possible > min(h.score for h in self.finished)


@dataclass
class _Group:
    root: Request  # the request as the client sent it
    search: BeamSearch
    members: list[Request]  # the running beams, in `search.running` order
    generation: int = 0  # steps taken: part of the members' ids
    restarts: int = 0


@dataclass(frozen=True)
class BeamResult:
    request: Request  # the client's request
    hypotheses: list[Hypothesis]  # best first


class BeamGroups:
    """The engine's beam-search requests. A request starts as one sequence (its prompt); at its
    first logits it forks into `num_beams` sequences that share its blocks, and every step each
    beam's continuations replace it. A group's beams always step together: a plan that holds only
    some of them (the token budget ran out) leaves the group out, and a group that loses a beam to
    preemption starts again from its prompt (beam search is deterministic, so its result is the same).
    """

    def __init__(self, scheduler: Scheduler, eos_token_ids: Collection[int]) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self.num_restarts = 0  # groups started again after losing a beam to preemption

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __bool__(self) -> bool:
        return bool(self._groups)

    def add(self, request: Request) -> None:
        request.group = request.request_id
        self.scheduler.add(request)
        self._groups[request.request_id] = _Group(request, self._search(request), [request])

    def abort(self, request_id: str) -> bool:
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for member in group.members:
            self.scheduler.remove(member.request_id)
        return True

    def settle(self, plan: StepPlan) -> StepPlan:
        """Restarts groups that lost a beam to preemption and leaves out of `plan` the groups
        whose beams are not all in it."""
        for rid in plan.preempted:
            request = self.scheduler.requests.get(rid)
            if request is not None and request.group is not None and request.output_token_ids:
                self._restart(self._groups[request.group])
        live = [c for c in plan.chunks if self.scheduler.requests.get(c.request.request_id) is c.request]
        sampling: dict[str, int] = {}
        for c in live:
            if c.samples and c.request.group is not None:
                sampling[c.request.group] = sampling.get(c.request.group, 0) + 1
        whole = {g for g, n in sampling.items() if n == len(self._groups[g].members)}
        kept = tuple(c for c in live if c.request.group is None or c.request.group in whole or not c.samples)
        return StepPlan(kept, plan.preempted, plan.copies)

    @staticmethod
    def unsampled(plan: StepPlan) -> StepPlan:
        """`plan` without the chunks of beams that sample: `advance` replaces those sequences with
        their continuations, so the scheduler has nothing to append to them."""
        return StepPlan(tuple(c for c in plan.chunks if not (c.samples and c.request.group is not None)))

    def advance(self, logits: dict[str, torch.Tensor]) -> list[BeamResult]:
        """One beam-search step for every group whose beams' next-token logits are in `logits`
        (by member id); returns the groups that finished, whose sequences are freed."""
        by_group: dict[str, list[Request]] = {}
        for rid in logits:
            request = self.scheduler.requests[rid]
            by_group.setdefault(request.group, []).append(request)  # type: ignore[arg-type]
        results = []
        for gid in by_group:
            group = self._groups[gid]
            rows = torch.stack([logits[m.request_id] for m in group.members])
            continuations = group.search.advance(torch.log_softmax(rows.float(), dim=-1))
            if group.search.done:
                for member in group.members:
                    self.scheduler.remove(member.request_id)
                del self._groups[gid]
                results.append(BeamResult(group.root, group.search.finished))
                continue
            group.generation += 1
            children = []
            for j, c in enumerate(continuations):
                child_id = f"{gid}\x1fbeam{group.generation}.{j}"  # no client id holds a control character
                children.append(self.scheduler.fork(group.members[c.parent], child_id, c.token))
            for member in group.members:
                self.scheduler.remove(member.request_id)
            group.members = children
        return results

    def _restart(self, group: _Group) -> None:
        for member in group.members:
            self.scheduler.remove(member.request_id)
        root = group.root
        fresh = Request(root.request_id, root.prompt_token_ids, root.params, root.arrival, group=root.request_id)
        self.scheduler.requeue(fresh)
        group.search = self._search(root)
        group.members = [fresh]
        group.restarts += 1
        self.num_restarts += 1

    def _search(self, request: Request) -> BeamSearch:
        p = request.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        return BeamSearch(p.num_beams, p.max_tokens, stops, p.length_penalty, p.early_stopping)
