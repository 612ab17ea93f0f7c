"""Executes a `StepPlan` on the model: builds the flat batch, runs one forward pass, samples.

The runner owns the paged KV cache (one preallocated key and value tensor per layer) and knows
nothing about scheduling: it computes exactly the token ranges the plan names, and picks the next
tokens of each chunk that reaches its request's last token.

    output = runner.run(plan)   # a decode step: StepOutput, new tokens (and logprobs) by request id
    result = runner.execute(plan, rows, after_layer, masks)   # one sample per row (the prefill worker)

A request that asked for its prompt's logprobs (`SamplingParams.prompt_logprobs`) has every prompt
position of its chunks scored in the same pass (`_score_prompts`), into `Request.prompt_logprobs`.

`run` reads everything from the plan. A constrained request's masks (`cluster.engine.structured`)
are computed on their thread while the pass runs. A step of plain rows samples one token each
(`execute`). A step with drafts or beams takes the logits of every row: each chunk with a draft
(`ScheduledChunk.draft`, `draft_probs`) is verified by `Sampler.verify`, which keeps the draft
tokens the target agrees with and adds one of its own; plain rows in that step are verified with
an empty draft; a beam's row (`Request.group`) is not sampled: its logits go to the beam search.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cluster.config import CacheConfig
from cluster.engine.adapters import Adapters
from cluster.engine.block_manager import kv_block_bytes, num_blocks_for_budget
from cluster.engine.compiled import CompiledDecode
from cluster.engine.request import Request, ScheduledChunk, StepPlan
from cluster.engine.sampler import Draft, Sampler, SampleResult, SampleRow, TokenLogprob
from cluster.engine.structured import Grammars, PendingMasks
from cluster.model import cpu_kernels
from cluster.model.attention import (
    SeqChunk,
    allocate_kv_cache,
    as_decode_rows,
    build_attention_metadata,
    kv_row_bytes,
)
from cluster.model.causal_lm import CausalLM


@dataclass(frozen=True)
class StepOutput:
    """What a decode step gave the requests of its plan that sample, by request id."""

    token_ids: dict[str, list[int]]  # accepted draft tokens, then one of the target's own
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # per token; empty when no row asked
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # each beam's next-token logits [vocab]


PROMPT_SCORE_ROWS = 256  # prompt positions whose logits are taken at once (`_score_prompts`)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        sampler: Sampler,
        compiled: CompiledDecode | None = None,
        kv_dtype: str = "auto",
        eos_token_ids: Sequence[int] = (),
        grammars: Grammars | None = None,
        shared_kv: bool = False,
        adapters: Adapters | None = None,
    ) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        # One block past the block manager's range: the scratch block that compiled padding rows use.
        self.kv_cache = allocate_kv_cache(
            arch.num_layers, num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim,
            model.embed_tokens.weight.dtype, self.device, kv_dtype, shared_kv,
        )  # fmt: skip
        self.sampler = sampler
        self.compiled = compiled
        self.eos_token_ids = tuple(eos_token_ids)  # suppressed before a request's min_tokens
        self.grammars = grammars  # computes structured output's masks in `run`
        self.adapters = adapters  # LoRA: each chunk's rows through its request's adapter
        if self.device.type == "cpu":
            cpu_kernels.available()  # build (or load) the CPU kernels now, not in the first decode step

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """A decode step: the pass over `plan`, and each sampling request's new tokens (see the
        module's docstring); structured output's masks are computed beside the pass."""
        sampling = [c for c in plan.chunks if c.samples]
        plain = [c for c in sampling if c.request.group is None]
        masks = self._masks(plain)  # started now, waited for after the pass
        ids = [c.request.request_id for c in plain]
        if len(plain) < len(sampling) or any(c.draft for c in plain):
            return self._verify(plan, sampling, masks)
        result = self.execute(plan, [self.row(c.request) for c in plain], masks=masks)
        tokens = {rid: [t] for rid, t in zip(ids, result.token_ids, strict=True)}
        if result.logprobs is None:
            return StepOutput(tokens)
        pairs = zip(ids, result.logprobs, result.top_logprobs, strict=True)  # type: ignore[arg-type]
        return StepOutput(tokens, {rid: [(lp, top)] for rid, lp, top in pairs})

    def _verify(self, plan: StepPlan, sampling: list[ScheduledChunk], masks: PendingMasks | None) -> StepOutput:
        """A step with drafts or beams: every sampling row's logits; drafts (empty for a plain
        request) verified, beams' rows handed on."""
        rows, drafts, plain_rows, beams, at = [], [], [], {}, 0
        for c in sampling:
            if c.request.group is not None:
                beams[c.request.request_id] = at
            else:
                rows += [self.row(c.request, c.draft[:j]) for j in range(len(c.draft) + 1)]
                drafts.append(Draft(c.draft, c.draft_probs))
                plain_rows += range(at, at + len(c.draft) + 1)
            at += 1 + len(c.draft)
        logits = self.logits(plan)
        assert logits is not None
        if masks is not None:
            rows = masks.attach(rows)
        verified = self.sampler.verify(logits[plain_rows], rows, drafts)
        ids = [c.request.request_id for c in sampling if c.request.group is None]
        tokens = dict(zip(ids, verified.token_ids, strict=True))
        logprobs = dict(zip(ids, verified.logprobs, strict=True)) if verified.logprobs is not None else {}
        return StepOutput(tokens, logprobs, {rid: logits[i] for rid, i in beams.items()})

    def _masks(self, chunks: list[ScheduledChunk]) -> PendingMasks | None:
        """Starts the structured-output masks of the constrained chunks' rows (each chunk has one
        row per draft token and one past the last, in order)."""
        work, row = [], 0
        for c in chunks:
            if c.request.matcher is not None:
                work.append((row, c.request.matcher, c.draft))
            row += 1 + len(c.draft)
        if not work or self.grammars is None:
            return None
        return self.grammars.masks(work)

    def row(self, request: Request, drafted: Sequence[int] = ()) -> SampleRow:
        """The sampling row of `request` with `drafted` tokens appended to its output so far."""
        params = request.params
        suppressed: tuple[int, ...] = ()
        if len(request.output_token_ids) + len(drafted) < params.min_tokens:
            suppressed = (*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids))
        output = [*request.output_token_ids, *drafted] if drafted else request.output_token_ids
        return SampleRow(params, request.prompt_token_ids, output, suppressed)

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        rows: Sequence[SampleRow],
        after_layer: Callable[[int], None] | None = None,
        masks: PendingMasks | None = None,
    ) -> SampleResult:
        """Runs `plan`; `rows` describe, in plan order, the chunks whose `samples` is true.
        `after_layer(i)` is called once layer `i` has written its KV (so it can be shipped early).
        `masks`, computed while the pass runs, constrain the rows of structured-output requests."""
        logits = self.logits(plan, after_layer)
        if logits is None:
            return SampleResult([], None, None)
        return self.sampler(logits, masks.attach(rows) if masks is not None else rows)

    @torch.inference_mode()
    def logits(self, plan: StepPlan, after_layer: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """One forward pass over `plan`; float32 logits [R, vocab] on the CPU, where each chunk
        that samples gives one row per draft token plus one (its last 1 + len(draft) positions),
        in plan order. None when no chunk samples.

        A pass of decode rows and drafts to verify (every new token samples) runs each new token as
        a decode row (`as_decode_rows`): through a compiled graph where one fits, else eagerly."""
        self.copy_blocks(plan.copies)
        chunks, input_ids, rows = [], [], []
        for c in plan.chunks:
            if c.samples:
                end = len(input_ids) + c.num_new
                rows.extend(range(end - 1 - len(c.draft), end))
            chunks.append(SeqChunk(c.block_table, c.start, c.num_new))
            input_ids.extend(c.input_token_ids)
        lora = self.adapters.batch(plan.chunks) if self.adapters is not None else None
        if after_layer is None and len(rows) == len(input_ids):
            chunks = as_decode_rows(chunks)
            if self.compiled is not None and self.compiled.fits(len(chunks)):
                return self.compiled(input_ids, chunks, self.kv_cache, lora).cpu()
        meta = build_attention_metadata(chunks, self.block_size, self.model.windows, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, meta.positions, self.kv_cache, meta, after_layer, lora)
        self._score_prompts(plan, hidden)
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index]).float().cpu()

    def _score_prompts(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Prompt logprobs: for each chunk of a request that asked for them, the log-probability of
        every prompt token this pass saw the position before (its logits are that position's), and
        the top n there, appended to `Request.prompt_logprobs` in order. A position scored before
        (a preempted request computed again) is not scored twice. Logits are taken a slice of rows
        at a time, so a long prompt never holds [prompt, vocab] floats at once."""
        at = 0
        for c in plan.chunks:
            request, offset, at = c.request, at, at + c.num_new
            if request.params.prompt_logprobs is None:
                continue
            first = max(c.start, request.num_prompt_logprobs)
            end = min(c.start + c.num_new, request.num_prompt_tokens - 1)  # the last position picks output
            if first >= end:
                continue
            assert first == request.num_prompt_logprobs, "prompt positions are scored in order"
            top_n, prompt = request.params.prompt_logprobs, request.prompt_token_ids
            for lo in range(first, end, PROMPT_SCORE_ROWS):
                hi = min(lo + PROMPT_SCORE_ROWS, end)
                rows = hidden[offset + lo - c.start : offset + hi - c.start]
                raw = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1).cpu()
                chosen = raw.gather(1, torch.tensor(prompt[lo + 1 : hi + 1])[:, None]).squeeze(1).tolist()
                tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
                if top_n:
                    values, ids = raw.topk(top_n, dim=-1)
                    tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
                request.prompt_logprobs.extend(zip(chosen, tops, strict=True))
            request.num_prompt_logprobs = end

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies whole KV blocks, every layer (copy-on-write for beams that share a block)."""
        if not copies:
            return
        source = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dest = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_cache:
            k_cache.index_copy_(0, dest, k_cache.index_select(0, source))
            v_cache.index_copy_(0, dest, v_cache.index_select(0, source))

    @torch.inference_mode()
    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block's KV, every layer, as bytes laid out [keys/values, layer, block_size, heads, dim]."""
        if not block_ids:
            return []
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [torch.stack([cache.index_select(0, index) for cache, _ in self.kv_cache])]
        parts.append(torch.stack([cache.index_select(0, index) for _, cache in self.kv_cache]))
        blocks = torch.stack(parts).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()  # [n, 2, layers, block, heads, dim]
        flat = blocks.view(len(block_ids), -1).view(torch.uint8)
        return [row.numpy().tobytes() for row in flat]

    @torch.inference_mode()
    def write_blocks(self, fills: Sequence[tuple[int, bytes]]) -> None:
        """Writes KV bytes (as `read_blocks` gives them) into their blocks, every layer."""
        if not fills:
            return
        k_cache = self.kv_cache[0][0]
        data = torch.frombuffer(bytearray(b"".join(p for _, p in fills)), dtype=torch.uint8).view(k_cache.dtype)
        blocks = data.view(len(fills), 2, len(self.kv_cache), *k_cache.shape[1:]).to(self.device)
        index = torch.tensor([block_id for block_id, _ in fills], dtype=torch.long, device=self.device)
        for layer, (keys, values) in enumerate(self.kv_cache):
            keys.index_copy_(0, index, blocks[:, 0, layer])
            values.index_copy_(0, index, blocks[:, 1, layer])

    def kv_layout(self) -> bytes:
        """What a block's bytes mean: element type and shape. The tiers seal entries with it."""
        keys = self.kv_cache[0][0]
        return f"{keys.dtype} {len(self.kv_cache)} layers x {tuple(keys.shape[1:])}".encode()


def num_kv_blocks(model: CausalLM, cache: CacheConfig) -> int:
    """Blocks that fit in the configured budget (or the configured count)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    arch = model.arch
    row = kv_row_bytes(arch.head_dim, model.embed_tokens.weight.element_size(), cache.kv_dtype)
    per_block = kv_block_bytes(cache.block_size, arch.num_layers, arch.num_kv_heads, row, 1)
    return num_blocks_for_budget(int(cache.memory_gib * 2**30), per_block)
