"""One request's state, counted: its token ids, how many are prompt, and how many have KV computed;
and the plan of one forward pass over many requests.

Prefill, chunked prefill, recompute after preemption, a request moved from a failed worker (it
arrives with the output it already generated) and admission of a transferred KV cache are all the
same thing: `num_computed_tokens` catching up with `num_tokens`. A request is WAITING (not
holding blocks), RUNNING (holding blocks, in the batch) or FINISHED. Shared by both workers; no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from tandem.v1 import api_pb2

from cluster.config import MAX_ADAPTER_NAME
from cluster.engine.block_names import Scope

if TYPE_CHECKING:
    from cluster.engine.block_manager import Loaded

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    """Structured output: the whole output must match this (`cluster.engine.structured` compiles it).
    `value` is the JSON schema's text, the regex or the Lark grammar ("" for json_object);
    `choices` the strings of a choice."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured: unknown kind {self.kind!r}; one of {', '.join(STRUCTURED_KINDS)}")
        if self.kind == "choice" and not self.choices:
            raise ValueError("structured.choice: no choices")
        if self.kind == "choice" and not all(self.choices):
            raise ValueError("structured.choice: a choice is empty")
        if self.kind not in ("choice", "json_object") and not self.value:
            raise ValueError(f"structured.{self.kind}: is empty")


MAX_CACHE_SALT = 256
TokenLogprob = tuple[float, list[tuple[int, float]]]  # a token's log-probability and the top n alternatives


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
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's (after the first) and the top n
    speculative_tokens: int | None = None  # None: the deployment's setting; 0: no speculation
    num_beams: int = 1  # > 1: beam search (deterministic; sampling parameters are ignored)
    length_penalty: float = 1.0  # beam search: scores are sum of log-probs / length ** length_penalty
    early_stopping: str = "false"  # beam search: "true", "false" (heuristic) or "never"
    structured: Constraint | None = None  # the output must match this
    cache_salt: str = ""  # KV is shared only between requests with the same salt ("" among themselves)
    adapter: str = ""  # the LoRA adapter the request runs through, by name; "": the base model

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
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs must be >= 0"),
            (self.speculative_tokens is None or self.speculative_tokens >= 0, "speculative_tokens must be >= 0"),
            (all(self.stop), "stop strings must not be empty"),
            (self.num_beams >= 1, "num_beams must be >= 1"),
            (self.early_stopping in ("true", "false", "never"), 'early_stopping must be "true", "false" or "never"'),
            (len(self.cache_salt) <= MAX_CACHE_SALT, f"cache_salt must be at most {MAX_CACHE_SALT} characters"),
            (len(self.adapter) <= MAX_ADAPTER_NAME, f"adapter must be at most {MAX_ADAPTER_NAME} characters"),
        ]
        if self.structured is not None:
            checks += [
                (self.num_beams == 1, "beam search cannot be combined with structured output"),
                (self.min_tokens == 0, "min_tokens cannot be combined with structured output (EOS ends a match)"),
                (not self.ignore_eos, "ignore_eos cannot be combined with structured output (EOS ends a match)"),
            ]
        if self.num_beams > 1:
            checks += [
                (not self.stop, "beam search does not support stop strings"),
                (self.logprobs is None, "beam search does not support logprobs"),
                (self.prompt_logprobs is None, "beam search does not support prompt_logprobs"),
                (self.min_tokens == 0, "beam search does not support min_tokens"),
                (not self.speculative_tokens, "beam search cannot be combined with speculative decoding"),
                (
                    self.repetition_penalty == 1 and self.presence_penalty == 0 and self.frequency_penalty == 0,
                    "beam search does not support penalties",
                ),
            ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def params_to_proto(p: SamplingParams) -> api_pb2.SamplingParams:
    m = api_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        stop=p.stop,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        cache_salt=p.cache_salt,
        adapter=p.adapter,
    )
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.speculative_tokens is not None:
        m.speculative_tokens = p.speculative_tokens
    if p.num_beams > 1:
        m.num_beams = p.num_beams
        m.length_penalty = p.length_penalty
        m.early_stopping = EARLY_STOPPING[p.early_stopping]
    if p.structured is not None:
        m.structured.CopyFrom(constraint_to_proto(p.structured))
    return m


def logprob_entries(scored: Iterable[tuple[int, TokenLogprob]]) -> list[api_pb2.TokenLogprob]:
    """The wire's entries for (token id, (its log-probability, the top alternatives)) pairs."""
    return [
        api_pb2.TokenLogprob(
            token_id=token, logprob=lp, top=[api_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top]
        )
        for token, (lp, top) in scored
    ]


def constraint_to_proto(c: Constraint) -> api_pb2.Structured:
    if c.kind == "choice":
        return api_pb2.Structured(choice=api_pb2.Choices(choices=c.choices))
    if c.kind == "json_object":
        return api_pb2.Structured(json_object=True)
    return api_pb2.Structured(**{c.kind: c.value})


def constraint_from_proto(m: api_pb2.Structured) -> Constraint | None:
    """The wire's constraint, None when unset; raises ValueError on a bad one."""
    kind = m.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint("choice", choices=tuple(m.choice.choices))
    if kind == "json_object":
        if not m.json_object:
            raise ValueError("structured.json_object: set it to true")
        return Constraint("json_object")
    return Constraint(kind, getattr(m, kind))


EARLY_STOPPING = {
    "false": api_pb2.EARLY_STOPPING_HEURISTIC,
    "true": api_pb2.EARLY_STOPPING_FIRST,
    "never": api_pb2.EARLY_STOPPING_NEVER,
}


def params_from_proto(m: api_pb2.SamplingParams) -> SamplingParams:
    """The wire's sampling parameters (unset fields take their defaults); raises ValueError on bad values.
    `max_tokens` must already be resolved (the wire's 0, "up to the context window", is the router's to fill)."""
    return SamplingParams(
        max_tokens=m.max_tokens,
        min_tokens=m.min_tokens,
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        top_k=m.top_k if m.HasField("top_k") else -1,
        min_p=m.min_p if m.HasField("min_p") else 0.0,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        seed=m.seed if m.HasField("seed") else None,
        stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        speculative_tokens=m.speculative_tokens if m.HasField("speculative_tokens") else None,
        num_beams=max(m.num_beams, 1),
        length_penalty=m.length_penalty if m.HasField("length_penalty") else 1.0,
        early_stopping={v: k for k, v in EARLY_STOPPING.items()}[m.early_stopping],
        structured=constraint_from_proto(m.structured) if m.HasField("structured") else None,
        cache_salt=m.cache_salt,
        adapter=m.adapter,
    )


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
    num_passes: int = 0  # forward passes that gave this request tokens
    num_draft_tokens: int = 0  # speculative tokens proposed for it
    num_accepted_tokens: int = 0  # and kept
    group: str | None = None  # beam search: the id of the request whose beam this is
    matcher: Any = None  # structured output: the `cluster.engine.structured.Matcher` over its output
    # With params.prompt_logprobs: the runner appends each prompt token's entry (tokens 1.. in order)
    # as its pass computes it; the engine hands them out with the request's first token.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_logprobs: int = 0  # entries computed so far (those handed out included)
    loaded: Loaded | None = None  # KV of its prompt's blocks read from the tiers, used at admission
    loaded_from: tuple[str, ...] = ()  # the tier of each prompt block it took from them
    adapter: bytes = b""  # its adapter's digest, which the engine resolves from `params.adapter`
    # Where its first token waited on the worker that prefills it (`time.monotonic()`, 0.0 = not yet):
    # queued there, its tiers' load over (it waited parked for them), first scheduled, first token.
    queued_at: float = 0.0
    loaded_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float = 0.0

    @property
    def scope(self) -> Scope:
        """What its KV's block names depend on besides the tokens (`cluster.engine.block_names`)."""
        return Scope(self.params.cache_salt, self.adapter)

    def take_prompt_logprobs(self) -> list[tuple[int, TokenLogprob]]:
        """The prompt logprobs scored and not taken yet, as (prompt token, its entry); the output
        with the first token takes them all (the pass that samples it scores the prompt's end)."""
        scored = len(self.prompt_logprobs)
        if not scored:
            return []
        at = self.num_prompt_logprobs - scored + 1  # the prompt token the first of them scores
        taken = list(zip(self.prompt_token_ids[at : at + scored], self.prompt_logprobs, strict=True))
        self.prompt_logprobs = []
        return taken

    @property
    def reuses_cache(self) -> bool:
        """Whether its prompt may start from the prefix cache: not when its prompt's logprobs are
        asked for, since a cached block's positions are never computed (so never scored)."""
        return self.params.prompt_logprobs is None

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


class FirstToken(NamedTuple):
    """Where a prompt prefilled on this worker spent the time to its first token, in seconds: waiting
    for its blocks to load from the KV tiers, then in the queue, then from its first pass to its first
    token (its chunks, beside the running batch)."""

    tier_load_s: float
    queue_s: float
    prefill_s: float

    @classmethod
    def of(cls, request: Request) -> FirstToken:
        loaded = request.loaded_at or request.queued_at
        started = max(request.started_at, loaded)
        return cls(loaded - request.queued_at, started - loaded, request.first_token_at - started)


class UnknownAdapter(LookupError):
    """A request named an adapter this engine has not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"adapter {self.name!r} is not loaded"


def adapters_fit(running: Iterable[Request], request: Request, max_adapters: int) -> bool:
    """Whether `running` and `request` together run through at most `max_adapters` distinct LoRA
    adapters (the slots a worker holds; the base model takes none)."""
    name = request.params.adapter
    if not name:
        return True
    names = {r.params.adapter for r in running} - {""}
    return name in names or len(names) < max_adapters


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # positions [start, start + num_new) are computed this step
    num_new: int
    block_table: tuple[int, ...]
    samples: bool  # the chunk reaches the request's last token, so its logits pick the next one
    draft: tuple[int, ...] = ()  # speculative tokens after the last one, counted in num_new
    # The proposer's probability of each draft token ([len(draft), vocab], a torch tensor), or None.
    draft_probs: Any = field(default=None, compare=False)

    @property
    def input_token_ids(self) -> list[int]:
        known = self.request.token_ids(self.start, self.start + self.num_new - len(self.draft))
        return [*known, *self.draft]


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()  # (source, destination) blocks to copy before the pass

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
