"""The paged KV block manager: which blocks each sequence owns. Pure Python, no torch.

Lifecycle of a sequence's blocks:

    can_allocate(tokens) -> allocate(seq, tokens)   on admission (shares cached full blocks)
    can_append(seq, n)   -> append(seq, n)          as the sequence grows, before each step
    mark_computed(seq, tokens)                      after a step computed these tokens' KV
    free(seq)                                       on finish, abort or preemption
    trim(seq, n)                                    rejected speculative tokens give blocks back
    fork(parent, child)                             a new beam shares its parent's blocks

Blocks are reference-counted. A full block whose KV has been computed is keyed by a chained hash
of its tokens (the hash of the previous block and its own token ids), so sequences with an equal
prompt prefix share those blocks. A lookup never covers a sequence's last token, so the position a
step computes always lands in a block of its own. A freed block keeps its contents and hash while
it sits in the free queue; it is reused by a later hit, or evicted (least recently freed first)
when a fresh block is needed. Sequences free their blocks tail first, so a prompt's shared head
outlives its private tail.

Forked beams share every block of their parent. A sequence about to write into a block it shares
gets a private copy first (copy-on-write, `append(..., write_from=position)`): only the partly
filled last block is ever written, so beams share all full blocks for their whole life.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from cluster.engine.kv_events import KVJournal


def kv_block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one block across all layers, keys and values."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    return budget_bytes // block_bytes


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation was attempted without checking `can_allocate` / `can_append`."""


@dataclass(slots=True)  # millions of them in a simulated cluster: no per-block __dict__
class _Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block holds a full, registered run of tokens
    tokens: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.0,
        prefix_caching: bool = True,
        journal: KVJournal | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_caching = prefix_caching
        self.journal = journal  # told of every block the cache registers and evicts
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict first
        self._cached: dict[int, int] = {}  # chained hash -> block id
        self._tables: dict[Hashable, list[int]] = {}
        self._hashes: dict[Hashable, list[int]] = {}  # chained hashes of each sequence's full blocks
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1 - len(self._free) / self.num_blocks

    def block_table(self, seq: Hashable) -> list[int]:
        return self._tables[seq]

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._tables

    def can_allocate(self, tokens: Sequence[int], reuse: bool = True) -> bool:
        """Whether `tokens` fit, counting cached blocks (unless `reuse` is false) and leaving the
        watermark free."""
        hits = self._lookup(tokens[:-1]) if reuse else []
        in_use = sum(1 for b in hits if self._blocks[b].ref_count > 0)
        needed = self._blocks_for(len(tokens)) - in_use
        return len(self._free) - needed >= self.watermark_blocks

    def can_append(self, seq: Hashable, num_tokens: int, write_from: int | None = None) -> bool:
        """Whether `seq` can grow to `num_tokens` tokens (no watermark: running sequences may use it),
        counting the private copy it needs if it writes from `write_from` into a shared block."""
        needed = self._blocks_for(num_tokens) - len(self._tables[seq])
        return needed + self._shared_at(seq, write_from) <= len(self._free)

    # -- changes ---------------------------------------------------------------------------------

    def allocate(self, seq: Hashable, tokens: Sequence[int], reuse: bool = True) -> int:
        """Gives `seq` blocks for `tokens`; returns how many leading tokens are already cached
        (none when `reuse` is false: every block is fresh, and is registered as its KV is computed)."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq!r} already has blocks")
        if not tokens:
            raise ValueError("cannot allocate an empty sequence")
        hits = self._lookup(tokens[:-1]) if reuse else []
        self.prefix_queries += len(tokens) // self.block_size if reuse else 0
        self.prefix_hits += len(hits)
        table = []
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
        self._tables[seq] = table
        self._hashes[seq] = [self._blocks[b].hash for b in hits]  # type: ignore[misc]
        try:
            self.append(seq, len(tokens))
        except NoFreeBlocks:
            self.free(seq)
            raise
        return len(hits) * self.block_size

    def append(self, seq: Hashable, num_tokens: int, write_from: int | None = None) -> tuple[int, int] | None:
        """Grows `seq`'s table to hold `num_tokens` tokens. If the step writes from position
        `write_from` into a block other sequences share (a forked beam), `seq` gets a private copy
        (copy-on-write): returns (source block, new block), whose KV the runner must copy first."""
        table = self._tables[seq]
        needed = self._blocks_for(num_tokens) - len(table)
        if needed + self._shared_at(seq, write_from) > len(self._free):
            raise NoFreeBlocks(f"sequence {seq!r} needs {needed} blocks, {len(self._free)} free")
        copy = None
        if self._shared_at(seq, write_from):
            assert write_from is not None
            index = write_from // self.block_size
            source = self._blocks[table[index]]
            source.ref_count -= 1
            table[index] = self._take_free()
            del self._hashes[seq][index:]  # a written block is no longer the registered one
            copy = (source.id, table[index])
        for _ in range(needed):
            table.append(self._take_free())
        return copy

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Gives `child` the blocks of `parent`, shared by reference count (beam search)."""
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already has blocks")
        table = self._tables[parent]
        for block_id in table:
            self._blocks[block_id].ref_count += 1
        self._tables[child] = list(table)
        self._hashes[child] = list(self._hashes[parent])

    def mark_computed(self, seq: Hashable, tokens: Sequence[int]) -> None:
        """Registers the full blocks among `seq`'s leading `tokens`, whose KV is now in the cache."""
        table, hashes = self._tables[seq], self._hashes[seq]
        while self.prefix_caching and len(hashes) < len(tokens) // self.block_size:
            i = len(hashes)
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = hash((hashes[-1] if hashes else 0, chunk))
            hashes.append(h)
            block = self._blocks[table[i]]
            if block.hash is None and h not in self._cached:
                block.hash, block.tokens = h, chunk
                self._cached[h] = block.id
                if self.journal is not None:
                    self.journal.stored(h)

    def trim(self, seq: Hashable, num_tokens: int) -> None:
        """Shrinks `seq`'s table to the blocks `num_tokens` tokens need (rejected speculative tokens
        give back the blocks they were written into), tail first."""
        table = self._tables[seq]
        keep = self._blocks_for(num_tokens)
        hashes = self._hashes[seq]
        del hashes[keep:]
        while len(table) > keep:
            block = self._blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.id] = None

    def free(self, seq: Hashable) -> None:
        """Releases `seq`'s blocks, tail first; unknown sequences are ignored."""
        table = self._tables.pop(seq, None)
        self._hashes.pop(seq, None)
        for block_id in reversed(table or []):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    # -- internals -------------------------------------------------------------------------------

    def _shared_at(self, seq: Hashable, position: int | None) -> int:
        """1 if the block holding `position` exists and other sequences share it, else 0."""
        if position is None:
            return 0
        table = self._tables[seq]
        index = position // self.block_size
        return int(index < len(table) and self._blocks[table[index]].ref_count > 1)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup(self, tokens: Sequence[int]) -> list[int]:
        """Cached blocks matching the longest run of full leading blocks of `tokens`."""
        if not self.prefix_caching:
            return []
        hits, prev = [], 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            prev = hash((prev, chunk))  # as `kv_events.block_hashes`
            block_id = self._cached.get(prev)
            if block_id is None or self._blocks[block_id].tokens != chunk:  # compare against collisions
                break
            hits.append(block_id)
        return hits

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None:  # evict its cached contents
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
                if self.journal is not None:
                    self.journal.removed(block.hash)
            block.hash, block.tokens = None, ()
        block.ref_count = 1
        return block_id

    def check_integrity(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent. Tests call it after every operation."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self._blocks:
            assert block.ref_count == refs[block.id], f"block {block.id}: ref {block.ref_count} != {refs[block.id]}"
            assert (block.ref_count == 0) == (block.id in self._free), f"block {block.id} free state wrong"
        assert len(self._free) + sum(1 for r in refs if r) == self.num_blocks
        for h, block_id in self._cached.items():
            assert self._blocks[block_id].hash == h, f"cache entry {h} points at block {block_id} with another hash"
        if self.journal is not None:
            assert self.journal.held() == set(self._cached), "the KV journal disagrees with the cache"
        for seq, table in self._tables.items():
            assert len(self._hashes[seq]) <= len(table), f"sequence {seq!r} hashes more blocks than it owns"
