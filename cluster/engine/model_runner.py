"""Executes a `StepPlan` on the model: builds the flat batch, runs one forward pass, samples.

The runner owns the paged KV cache (one preallocated key and value tensor per layer) and knows
nothing about scheduling: it computes exactly the token ranges the plan names and samples one
token for each chunk that reaches its request's last token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cluster.config import CacheConfig
from cluster.engine.block_manager import kv_block_bytes, num_blocks_for_budget
from cluster.engine.compiled import CompiledDecode
from cluster.engine.request import StepPlan
from cluster.engine.sampler import Sampler, SampleResult, SampleRow
from cluster.engine.structured import PendingMasks
from cluster.model import cpu_kernels
from cluster.model.attention import (
    SeqChunk,
    allocate_kv_cache,
    as_decode_rows,
    build_attention_metadata,
    kv_row_bytes,
)
from cluster.model.causal_lm import CausalLM


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        sampler: Sampler,
        compiled: CompiledDecode | None = None,
        kv_dtype: str = "auto",
    ) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.device = model.embed_tokens.weight.device
        # One block past the block manager's range: the scratch block that compiled padding rows use.
        self.kv_cache = allocate_kv_cache(
            arch.num_layers, num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim,
            model.embed_tokens.weight.dtype, self.device, kv_dtype,
        )  # fmt: skip
        self.sampler = sampler
        self.compiled = compiled
        if self.device.type == "cpu":
            cpu_kernels.available()  # build (or load) the CPU kernels now, not in the first decode step

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
        if after_layer is None and len(rows) == len(input_ids):
            chunks = as_decode_rows(chunks)
            if self.compiled is not None and self.compiled.fits(len(chunks)):
                return self.compiled(input_ids, chunks, self.kv_cache).cpu()
        meta = build_attention_metadata(chunks, self.block_size, self.model.windows, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, meta.positions, self.kv_cache, meta, after_layer)
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index]).float().cpu()

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


def num_kv_blocks(model: CausalLM, cache: CacheConfig) -> int:
    """Blocks that fit in the configured budget (or the configured count)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    arch = model.arch
    row = kv_row_bytes(arch.head_dim, model.embed_tokens.weight.element_size(), cache.kv_dtype)
    per_block = kv_block_bytes(cache.block_size, arch.num_layers, arch.num_kv_heads, row, 1)
    return num_blocks_for_budget(int(cache.memory_gib * 2**30), per_block)
