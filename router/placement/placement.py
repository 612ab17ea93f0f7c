"""Which workers serve a request: pure functions of the prompt and the workers' reported loads
(`choose`), and the same choices from an index that the workers' pushed loads keep up to date
(`router.placement.index.LoadIndex`).

- Prefill locally (on the decode worker) when the prompt is at most `local_prefill_max_tokens`:
  no transfer is cheaper than any transfer.
- Decode worker: among those whose cache can hold the sequence at all, the ones with its blocks
  free now first, then the lightest (fewest running plus waiting sequences, then most free
  blocks). A full worker still takes a sequence it can hold: its scheduler queues or preempts
  (recomputing later), which is better than refusing the request.
- Prefill worker: the owner of the prompt's first block on a consistent-hash ring, so equal
  prefixes land where their KV is cached, unless its queue is longer than the shortest by more
  than `queue_slack_tokens`; then the one with the fewest queued prompt tokens.

With `matches` (KV-aware routing: per worker, the prompt's leading blocks its cache holds, from
the workers' own cache events, `router.placement.prefix_index`), what is cached is known instead of guessed:

- Decode worker: the cheapest of the lightest one and every decode worker holding part of the
  prompt, by `decode_cost` (in the spirit of Dynamo's router: the blocks left to prefill, times
  `overlap_weight`, plus the blocks it has in use), those with room now first. Turn k + 1 of a
  chat returns to the worker holding turn k's KV, unless that worker is busy enough to cost more.
- Local prefill when the prompt's uncached part on that worker is at most
  `local_prefill_max_tokens` ("local:cached-prefix" when part of it was cached).
- Prefill worker: the one holding the longest part of the prompt ("remote:cached-prefix"),
  unless its queue is longer than the shortest by more than `queue_slack_tokens`; with no prefill
  worker holding any of it, the ring as above.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.v1 import worker_pb2

OVERLAP_WEIGHT = 1.0  # a block to prefill weighs as much as a block in use


@dataclass(frozen=True)
class Choice:
    decode: str
    prefill: str | None  # None: prefill on the decode worker
    reason: str  # "remote", "remote:prefix-owner", "local:short-prompt", ...
    cached_blocks: int = 0  # the prompt's leading blocks the prefilling worker holds (KV-aware routing)
    decode_blocks: int = 0  # remote prefill: those the decode worker holds, which are not shipped


class NoCapacity(RuntimeError):
    """No decode worker can take the sequence now."""


class NoneInView(NoCapacity):
    """No decode worker has reported recently enough to be placed on (none up yet, or every one
    late with its heartbeat): a moment's wait may bring one back."""


def choose(
    prompt: Sequence[int],
    max_tokens: int,
    loads: dict[str, worker_pb2.WorkerLoad],
    block_size: int,
    local_prefill_max_tokens: int,
    queue_slack_tokens: int = 2048,
    matches: dict[str, int] | None = None,
) -> Choice:
    needed = -(-(len(prompt) + max_tokens) // block_size)
    decode = choose_decode(len(prompt) + max_tokens, loads, block_size)
    if matches:
        decode = cheapest_decode(decode, needed, len(prompt) // block_size, loads, matches)
        held = matches.get(decode, 0)
        if len(prompt) - held * block_size <= local_prefill_max_tokens:
            return Choice(decode, None, "local:cached-prefix" if held else "local:short-prompt", held)
    elif len(prompt) <= local_prefill_max_tokens:
        return Choice(decode, None, "local:short-prompt")
    prefills = {name: load for name, load in loads.items() if load.role == "prefill" and placeable(load)}
    if not prefills:
        return Choice(decode, None, "local:no-prefill-worker")
    shortest = min(prefills, key=lambda n: (prefills[n].queued_prompt_tokens, n))
    matches = matches or {}
    kept = matches.get(decode, 0)
    holder = best_holder(prefills, matches)
    if holder is not None:
        if prefills[holder].queued_prompt_tokens - prefills[shortest].queued_prompt_tokens <= queue_slack_tokens:
            return Choice(decode, holder, "remote:cached-prefix", matches[holder], kept)
        return Choice(decode, shortest, "remote:shortest-queue", matches.get(shortest, 0), kept)
    owner = ring_owner(prompt[:block_size], sorted(prefills))
    if prefills[owner].queued_prompt_tokens - prefills[shortest].queued_prompt_tokens <= queue_slack_tokens:
        return Choice(decode, owner, "remote:prefix-owner", 0, kept)
    return Choice(decode, shortest, "remote:shortest-queue", 0, kept)


def placeable(load: worker_pb2.WorkerLoad) -> bool:
    return not load.draining and not load.wedged


def decode_cost(load: worker_pb2.WorkerLoad, held: int, prompt_blocks: int) -> float:
    """What placing a prompt of `prompt_blocks` full blocks on this decode worker costs: the blocks
    it would prefill (or receive) beyond the `held` ones, weighted, plus the blocks it has in use."""
    return OVERLAP_WEIGHT * max(0, prompt_blocks - held) + (load.total_kv_blocks - load.free_kv_blocks)


def cheapest_decode(
    lightest: str, needed: int, prompt_blocks: int, loads: dict[str, worker_pb2.WorkerLoad], matches: dict[str, int]
) -> str:
    """The lightest decode worker or one holding part of the prompt, whichever costs less; one
    without room now for the blocks it lacks comes after every one with room."""

    def key(name: str) -> tuple[bool, float, str]:
        load, held = loads[name], matches.get(name, 0)
        return (load.free_kv_blocks < needed - held, decode_cost(load, held, prompt_blocks), name)

    holders = [
        name
        for name in matches
        if (load := loads.get(name)) is not None
        and load.role == "decode"
        and placeable(load)
        and load.total_kv_blocks >= needed
    ]
    return min([lightest, *holders], key=key)


def best_holder(prefills: dict[str, worker_pb2.WorkerLoad], matches: dict[str, int]) -> str | None:
    """The prefill worker holding the most of the prompt (then the shortest queue), or None."""
    holders = [name for name in prefills if matches.get(name, 0)]
    if not holders:
        return None
    return min(holders, key=lambda n: (-matches[n], prefills[n].queued_prompt_tokens, n))


def choose_decode(num_tokens: int, loads: dict[str, worker_pb2.WorkerLoad], block_size: int) -> str:
    needed = -(-num_tokens // block_size)
    fits = [
        name
        for name, load in loads.items()
        if load.role == "decode" and placeable(load) and load.total_kv_blocks >= needed
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
