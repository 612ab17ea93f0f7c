"""Decode steps through `torch.compile`, one graph per bucket of decode rows.

Eager decode at small batch is bound by per-op dispatch: a 30-layer step issues hundreds of small
ops. Inductor in `max-autotune` mode with frozen weights fuses the element-wise work between the
matrix products into a few loops; on CPU the few-row products (`tandem_cpu::skinny_linear`) and
decode attention (`tandem_cpu::decode_attention`, whose context-length dimensions are dynamic) are
opaque calls inside the graph. On CPU the graph is driven from C++ (inductor's `cpp_wrapper`): from
Python, its ~270 calls a SmolLM2 step (fused loops, products, attention) cost about 3 ms of a 9-16 ms
step; from C++ the step is 11-18 % faster, for about 7 s more of compiling per bucket, once.

A step of `n` decode rows (one per sequence, or one per new token where a sequence verifies a draft
or catches up: `attention.as_decode_rows`) is padded to the smallest compiled bucket >= n. Padding
rows are dummy one-token sequences that write to and read from a scratch block nobody owns. Each
bucket compiles on its first use (or in `warm_up`), which costs seconds to minutes at start-up.
Once `warm_up` has compiled every bucket, calls evaluate only the guards that tell the buckets (and
the models) apart (`skip_guard_eval_unsafe`): the weights are frozen and nothing else can change,
and checking the hundreds of guards on them cost half a millisecond per step. For the same reason
the graphs do not re-check the shapes of their custom ops' outputs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from cluster.model import cpu_kernels
from cluster.model.attention import KVCache, SeqChunk, build_attention_metadata
from cluster.model.causal_lm import CausalLM
from cluster.model.lora import LoraBatch, LoraSlots


class CompiledDecode:
    def __init__(self, model: CausalLM, buckets: Sequence[int], block_size: int, scratch_block: int) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError("compiled decode needs at least one positive batch bucket")
        self.model = model
        self.buckets = sorted(set(buckets))
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.steps = 0  # decode steps served by a compiled graph
        self._warm = False  # every bucket compiled
        # One graph per bucket and model (every instance compiles the same function); keep dynamo
        # from falling back to eager past its limit.
        torch._dynamo.config.recompile_limit += 2 * len(self.buckets)
        # The graphs take the kernels' answers as given.
        for probe in (cpu_kernels.available, cpu_kernels.used, cpu_kernels.amx):
            torch.compiler.assume_constant_result(probe)
        # max-autotune's options, without CUDA graphs on CPU (inductor would skip them there, with a warning).
        options = {"max_autotune": True, "coordinate_descent_tuning": True}
        self._cpu = model.embed_tokens.weight.device.type == "cpu"
        options["triton.cudagraphs"] = not self._cpu
        self._forward = torch.compile(self._logits, options=options, fullgraph=True, dynamic=False)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta, lora) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return self.model.compute_logits(self.model(ids, positions, kv_cache, meta, lora=lora))

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def __call__(
        self, input_ids: Sequence[int], chunks: Sequence[SeqChunk], kv_cache: KVCache, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        """Logits [len(chunks), vocab] (float32) for a step of decode rows (one new token each), each
        row through its adapter in `lora` (a graph of its own per bucket: the base model's has none)."""
        n = len(chunks)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        padding = [SeqChunk((self.scratch_block,), 0, 1)] * (bucket - n)
        device = self.model.embed_tokens.weight.device
        # At least two block columns: dynamo would specialise a length of one into its own graph.
        meta = build_attention_metadata([*chunks, *padding], self.block_size, self.model.windows, device, min_blocks=2)
        (group,) = meta.groups  # decode rows only: one group
        torch._dynamo.mark_dynamic(group.block_tables, 1)
        for mask in group.masks.values():
            torch._dynamo.mark_dynamic(mask, 3)
        self.steps += 1
        ids = torch.tensor([*input_ids, *([0] * (bucket - n))], dtype=torch.long, device=device)
        if lora is not None:
            lora = lora.padded(bucket)
        if self._warm:  # every graph is built: inductor's settings no longer matter
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._forward(ids, meta.positions, kv_cache, meta, lora)[:n]
        import torch._inductor.config as inductor_config  # here: importing inductor takes a second

        with inductor_config.patch(
            {
                "freezing": True,
                "autotune_num_choices_displayed": 0,
                "max_autotune_report_choices_stats": False,
                # The graphs' inputs are built here, in the shapes they were compiled for; checking
                # every custom op's output shape and alignment cost ~0.3 ms a step at batch 1.
                "size_asserts": False,
                "alignment_asserts": False,
                "scalar_asserts": False,
                "cpp_wrapper": self._cpu,  # see the module's docstring
            }
        ):
            return self._forward(ids, meta.positions, kv_cache, meta, lora)[:n]

    @torch.inference_mode()
    def warm_up(self, kv_cache: KVCache, slots: LoraSlots | None = None) -> None:
        """Compiles every bucket now, on dummy sequences in the scratch block; with LoRA `slots`, each
        bucket's graph with adapter rows too."""
        for bucket in self.buckets:
            chunks = [SeqChunk((self.scratch_block,), 0, 1)] * bucket
            self(list(range(bucket)), chunks, kv_cache)
            if slots is not None:
                self(list(range(bucket)), chunks, kv_cache, slots.batch(torch.full((bucket,), -1)))
        self._warm = True
