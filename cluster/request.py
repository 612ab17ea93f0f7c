"""One request's state, counted: its token ids, how many are prompt, and how many have KV computed;
and the plan of one forward pass over many requests.

Prefill, chunked prefill, recompute after preemption and admission of a transferred KV cache are
all the same thing: `num_computed_tokens` catching up with `num_tokens`. A request is WAITING (not
holding blocks), RUNNING (holding blocks, in the batch) or FINISHED. Shared by both workers: no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 keeps all
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the sampled token's and the top n

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 or >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (all(self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # admission order key; earlier first
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # positions [start, start + num_new) are computed this step
    num_new: int
    block_table: tuple[int, ...]
    samples: bool  # the chunk reaches the request's last token, so its logits pick the next one


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
