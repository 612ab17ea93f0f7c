"""The paged KV block manager: which blocks each sequence owns. Pure Python, no torch.

Lifecycle of a sequence's blocks:

    can_allocate(tokens) -> allocate(seq, tokens)   on admission (shares cached full blocks)
    can_append(seq, n)   -> append(seq, n)          as the sequence grows, before each step
    mark_computed(seq, tokens)                      after a step computed these tokens' KV
    free(seq)                                       on finish, abort or preemption
    trim(seq, n)                                    rejected speculative tokens give blocks back
    fork(parent, child)                             a new beam shares its parent's blocks

With KV tiers under the pool (`cluster.engine.tiering`), `spill` names the blocks whose KV goes down
to them ("evicted": as each is evicted; "computed": as each is registered), taken with
`take_spills()` before the step that could overwrite them; and `allocate(..., loaded=...)` fills
fresh blocks with KV loaded from the tiers, taken with `take_fills()` before the step that reads them.

Blocks are reference-counted. A full block whose KV has been computed is keyed by its name
(`cluster.engine.block_names`: a digest of the model, the request's adapter and `cache_salt`, and every
token up to the block's end), so sequences with an equal prompt prefix and scope share those blocks. A lookup
never covers a sequence's last token, so the position a step computes always lands in a block of
its own. A freed block keeps its contents and name while
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
from typing import Literal

from cluster.engine.block_names import BASE, UNNAMED_MODEL, Scope, chain, child, request_root
from cluster.engine.kv_events import KVJournal


def kv_block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one block across all layers, keys and values."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    return budget_bytes // block_bytes


@dataclass(frozen=True)
class Loaded:
    """KV loaded from the tiers for a prompt's blocks `first`, `first + 1`, ...: one payload each."""

    first: int
    payloads: list[bytes]
    sources: tuple[str, ...] = ()  # the tier each payload came from


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation was attempted without checking `can_allocate` / `can_append`."""


@dataclass(slots=True)  # millions of them in a simulated cluster: no per-block __dict__
class _Block:
    id: int
    ref_count: int = 0
    name: bytes | None = None  # set while the block holds a full, registered run of tokens


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.0,
        prefix_caching: bool = True,
        journal: KVJournal | None = None,
        root: bytes = UNNAMED_MODEL,
        spill: Literal["evicted", "computed"] | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_caching = prefix_caching
        self.journal = journal  # told of every block the cache registers and evicts
        self.root = root  # the model's root name (`block_names.model_root`)
        self.spill = spill  # when blocks go down to the KV tiers; None: no tiers
        self.tier_hits = 0  # blocks filled from the tiers
        self.last_filled: tuple[str, ...] = ()  # the tier of each block the last `allocate` filled
        self._spills: list[tuple[int, bytes]] = []  # (block id, name) whose KV goes to the tiers
        self._fills: list[tuple[int, bytes]] = []  # (block id, KV bytes) loaded from the tiers
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict first
        self._cached: dict[bytes, int] = {}  # block name -> block id
        self._tables: dict[Hashable, list[int]] = {}
        self._names: dict[Hashable, list[bytes]] = {}  # the names of each sequence's full blocks
        self._roots: dict[Hashable, bytes] = {}  # each sequence's root (its scope's)
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

    def can_allocate(self, tokens: Sequence[int], reuse: bool = True, scope: Scope = BASE) -> bool:
        """Whether `tokens` fit, counting cached blocks (unless `reuse` is false) and leaving the
        watermark free."""
        hits = self._lookup(tokens[:-1], request_root(self.root, scope)) if reuse else []
        in_use = sum(1 for b in hits if self._blocks[b].ref_count > 0)
        needed = self._blocks_for(len(tokens)) - in_use
        return len(self._free) - needed >= self.watermark_blocks

    def cached_blocks(self, tokens: Sequence[int], scope: Scope = BASE) -> int:
        """How many leading full blocks of `tokens` (never the last token) the pool holds now."""
        return self.held_run(chain(tokens[:-1], self.block_size, request_root(self.root, scope)))

    def held_run(self, names: Sequence[bytes]) -> int:
        """How many of the block `names`, from the first, the pool holds now."""
        run = 0
        while self.prefix_caching and run < len(names) and names[run] in self._cached:
            run += 1
        return run

    def can_append(self, seq: Hashable, num_tokens: int, write_from: int | None = None) -> bool:
        """Whether `seq` can grow to `num_tokens` tokens (no watermark: running sequences may use it),
        counting the private copy it needs if it writes from `write_from` into a shared block."""
        needed = self._blocks_for(num_tokens) - len(self._tables[seq])
        return needed + self._shared_at(seq, write_from) <= len(self._free)

    # -- changes ---------------------------------------------------------------------------------

    def allocate(
        self,
        seq: Hashable,
        tokens: Sequence[int],
        reuse: bool = True,
        scope: Scope = BASE,
        loaded: Loaded | None = None,
    ) -> int:
        """Gives `seq` blocks for `tokens`; returns how many leading tokens are already cached
        (none when `reuse` is false: every block is fresh, and is registered as its KV is computed).
        Only blocks named in the same `scope` are shared. `loaded` KV (from the tiers) fills the
        blocks after the pool's run, where it starts at or before the run's end."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq!r} already has blocks")
        if not tokens:
            raise ValueError("cannot allocate an empty sequence")
        root = request_root(self.root, scope)
        hits = self._lookup(tokens[:-1], root) if reuse else []
        self.prefix_queries += len(tokens) // self.block_size if reuse else 0
        self.prefix_hits += len(hits)
        table = []
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            table.append(block_id)
        self._tables[seq], self._roots[seq] = table, root
        self._names[seq] = [self._blocks[b].name for b in hits]  # type: ignore[misc]
        try:
            self.append(seq, len(tokens))
        except NoFreeBlocks:
            self.free(seq)
            raise
        self.last_filled = ()
        filled = self._fill(seq, tokens, loaded, len(hits)) if reuse and loaded is not None else 0
        return (len(hits) + filled) * self.block_size

    def take_spills(self) -> list[tuple[int, bytes]]:
        """The (block id, name) pairs whose KV the tiers should keep, noted since the last call."""
        spills, self._spills = self._spills, []
        return spills

    def take_fills(self) -> list[tuple[int, bytes]]:
        """The (block id, KV bytes) pairs to write into the pool before the next step runs."""
        fills, self._fills = self._fills, []
        return fills

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
            del self._names[seq][index:]  # a written block is no longer the registered one
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
        self._tables[child], self._roots[child] = list(table), self._roots[parent]
        self._names[child] = list(self._names[parent])

    def mark_computed(self, seq: Hashable, tokens: Sequence[int], spill: bool = True) -> None:
        """Registers the full blocks among `seq`'s leading `tokens`, whose KV is now in the cache
        (and, with `spill` "computed", notes them for the tiers unless `spill` is false here)."""
        table, names = self._tables[seq], self._names[seq]
        while self.prefix_caching and len(names) < len(tokens) // self.block_size:
            i = len(names)
            parent = names[-1] if names else self._roots[seq]
            name = child(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            names.append(name)
            block = self._blocks[table[i]]
            if block.name is None and name not in self._cached:
                block.name = name
                self._cached[name] = block.id
                if self.journal is not None:
                    self.journal.stored(name)
                if spill and self.spill == "computed":
                    self._spills.append((block.id, name))

    def trim(self, seq: Hashable, num_tokens: int) -> None:
        """Shrinks `seq`'s table to the blocks `num_tokens` tokens need (rejected speculative tokens
        give back the blocks they were written into), tail first."""
        table = self._tables[seq]
        keep = self._blocks_for(num_tokens)
        del self._names[seq][keep:]
        while len(table) > keep:
            block = self._blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.id] = None

    def free(self, seq: Hashable) -> None:
        """Releases `seq`'s blocks, tail first; unknown sequences are ignored."""
        table = self._tables.pop(seq, None)
        self._names.pop(seq, None)
        self._roots.pop(seq, None)
        for block_id in reversed(table or []):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    # -- internals -------------------------------------------------------------------------------

    def _fill(self, seq: Hashable, tokens: Sequence[int], loaded: Loaded, hits: int) -> int:
        """Fills `seq`'s fresh blocks after its `hits` pool blocks from `loaded`; returns how many."""
        if not loaded.first <= hits < loaded.first + len(loaded.payloads):
            return 0  # the pool's run ends before the loaded run starts: a gap only computing fills
        payloads = loaded.payloads[hits - loaded.first :][: (len(tokens) - 1) // self.block_size - hits]
        table = self._tables[seq]
        self._fills += [(table[hits + i], payload) for i, payload in enumerate(payloads)]
        self.mark_computed(seq, tokens[: (hits + len(payloads)) * self.block_size], spill=False)
        self.tier_hits += len(payloads)
        self.last_filled = loaded.sources[hits - loaded.first :][: len(payloads)]
        return len(payloads)

    def _shared_at(self, seq: Hashable, position: int | None) -> int:
        """1 if the block holding `position` exists and other sequences share it, else 0."""
        if position is None:
            return 0
        table = self._tables[seq]
        index = position // self.block_size
        return int(index < len(table) and self._blocks[table[index]].ref_count > 1)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup(self, tokens: Sequence[int], root: bytes) -> list[int]:
        """Cached blocks matching the longest run of full leading blocks of `tokens` under `root`."""
        if not self.prefix_caching:
            return []
        hits, name = [], root
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            name = child(name, tokens[start : start + self.block_size])  # as `block_names.chain`
            block_id = self._cached.get(name)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.name is not None:  # evict its cached contents
            if self._cached.get(block.name) == block_id:
                del self._cached[block.name]
                if self.journal is not None:
                    self.journal.removed(block.name)
                if self.spill == "evicted":
                    self._spills.append((block_id, block.name))
            block.name = None
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
        for name, block_id in self._cached.items():
            assert self._blocks[block_id].name == name, (
                f"cache entry {name.hex()} points at block {block_id} named otherwise"
            )
        if self.journal is not None:
            assert self.journal.held() == set(self._cached), "the KV journal disagrees with the cache"
        for seq, table in self._tables.items():
            assert len(self._names[seq]) <= len(table), f"sequence {seq!r} names more blocks than it owns"
