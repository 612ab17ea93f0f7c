"""Which workers serve a request: pure functions of the prompt and the workers' reported loads
(`choose`), and the same choices from an index that the workers' pushed loads keep up to date
(`router.index.LoadIndex`).

- Prefill locally (on the decode worker) when the prompt is at most `local_prefill_max_tokens`:
  no transfer is cheaper than any transfer.
- Decode worker: among those whose cache can hold the sequence at all, the ones with its blocks
  free now first, then the lightest (fewest running plus waiting sequences, then most free
  blocks). A full worker still takes a sequence it can hold: its scheduler queues or preempts
  (recomputing later), which is better than refusing the request.
- Prefill worker: the owner of the prompt's first block on a consistent-hash ring, so equal
  prefixes land where their KV is cached, unless its queue is longer than the shortest by more
  than `queue_slack_tokens`; then the one with the fewest queued prompt tokens.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.v1 import worker_pb2


@dataclass(frozen=True)
class Choice:
    decode: str
    prefill: str | None  # None: prefill on the decode worker
    reason: str  # "remote", "remote:prefix-owner", "local:short-prompt", ...


class NoCapacity(RuntimeError):
    """No decode worker can take the sequence now."""


def choose(
    prompt: Sequence[int],
    max_tokens: int,
    loads: dict[str, worker_pb2.WorkerLoad],
    block_size: int,
    local_prefill_max_tokens: int,
    queue_slack_tokens: int = 2048,
) -> Choice:
    decode = choose_decode(len(prompt) + max_tokens, loads, block_size)
    prefills = {
        name: load for name, load in loads.items() if load.role == "prefill" and not load.draining and not load.wedged
    }
    if len(prompt) <= local_prefill_max_tokens:
        return Choice(decode, None, "local:short-prompt")
    if not prefills:
        return Choice(decode, None, "local:no-prefill-worker")
    owner = ring_owner(prompt[:block_size], sorted(prefills))
    shortest = min(prefills, key=lambda n: (prefills[n].queued_prompt_tokens, n))
    if prefills[owner].queued_prompt_tokens - prefills[shortest].queued_prompt_tokens <= queue_slack_tokens:
        return Choice(decode, owner, "remote:prefix-owner")
    return Choice(decode, shortest, "remote:shortest-queue")


def choose_decode(num_tokens: int, loads: dict[str, worker_pb2.WorkerLoad], block_size: int) -> str:
    needed = -(-num_tokens // block_size)
    fits = [
        name
        for name, load in loads.items()
        if load.role == "decode" and not load.draining and not load.wedged and load.total_kv_blocks >= needed
    ]
    if not fits:
        raise NoCapacity(f"no decode worker can hold {needed} KV blocks")

    def preference(n: str) -> tuple[bool, int, int, str]:
        load = loads[n]
        return (load.free_kv_blocks < needed, load.running_seqs + load.waiting_seqs, -load.free_kv_blocks, n)

    return min(fits, key=preference)


class Ring:
    """A consistent-hash ring over `workers` (adding a worker moves ~1/n of the keys). Building it
    sorts `points_per_worker` points a worker; a lookup is one hash and one bisection."""

    def __init__(self, workers: Sequence[str], points_per_worker: int = 64) -> None:
        ring = sorted((_hash(f"{w}#{i}".encode()), w) for w in workers for i in range(points_per_worker))
        self._hashes = [h for h, _ in ring]
        self._owners = [w for _, w in ring]

    def owner(self, key: Sequence[int]) -> str:
        i = bisect.bisect_left(self._hashes, _hash(",".join(map(str, key)).encode()))
        return self._owners[i % len(self._owners)]


def ring_owner(key: Sequence[int], workers: Sequence[str], points_per_worker: int = 64) -> str:
    """The worker owning `key` on a consistent-hash ring over `workers`."""
    return Ring(workers, points_per_worker).owner(key)


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
