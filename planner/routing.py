"""`router.placement.placement`'s rule, indexed so that choosing among thousands of workers stays cheap.

`router.placement.placement.choose` rebuilds the consistent-hash ring and scans every worker on each call:
right for a router of tens of workers, O(workers log workers) per request for a simulated cluster
of a thousand. `Placer` keeps the ring of the live prefill workers until the pool changes and
gives the real `placement.choose_decode` the loads of the decode candidates only: all of them up
to `exact_up_to` workers (then its choice equals `placement.choose`, which the tests check), else
`sample` of them drawn at random per request (the power of d choices), plus, for prefill, the
ring owner. The rule itself (local under the threshold, the owner unless its queue is longer than
the shortest by more than the slack) is `placement.choose`'s.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Sequence

from tandem.v1 import worker_pb2

from router.placement import placement
from router.placement.placement import Choice


def _hash(data: bytes) -> int:  # as router.placement.placement hashes the ring
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    """`placement.ring_owner` over a fixed set of workers, built once."""

    def __init__(self, workers: Sequence[str], points_per_worker: int = 64) -> None:
        ring = sorted((_hash(f"{w}#{i}".encode()), w) for w in sorted(workers) for i in range(points_per_worker))
        self._hashes = [h for h, _ in ring]
        self._owners = [w for _, w in ring]

    def owner(self, key: Sequence[int]) -> str:
        h = _hash(",".join(map(str, key)).encode())
        i = bisect.bisect_left(self._hashes, h)  # ring_owner's bisect of (h, "") lands here too
        return self._owners[i % len(self._owners)]


class Placer:
    """Chooses workers for a request from loads read through `load(name)` (a `WorkerLoad`)."""

    def __init__(
        self,
        load: Callable[[str], worker_pb2.WorkerLoad],
        block_size: int,
        local_prefill_max_tokens: int,
        queue_slack_tokens: int = 2048,
        exact_up_to: int = 64,
        sample: int = 8,
        seed: int = 0,
    ) -> None:
        self.load = load
        self.block_size = block_size
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.queue_slack_tokens = queue_slack_tokens
        self.exact_up_to = exact_up_to
        self.sample = sample
        self.rng = random.Random(seed)
        self.decode: list[str] = []
        self.prefill: list[str] = []
        self._ring: Ring | None = None

    def set_workers(self, decode: Sequence[str], prefill: Sequence[str]) -> None:
        """The workers placement may choose (serving, not draining)."""
        self.decode = list(decode)
        if sorted(prefill) != sorted(self.prefill) or self._ring is None:
            self._ring = Ring(prefill) if prefill else None
        self.prefill = list(prefill)

    def choose(self, prompt: Sequence[int], max_tokens: int) -> Choice:
        """As `placement.choose`; raises `placement.NoCapacity` when no decode worker can hold it."""
        loads = {name: self.load(name) for name in self._candidates(self.decode)}
        decode = placement.choose_decode(len(prompt) + max_tokens, loads, self.block_size)
        if len(prompt) <= self.local_prefill_max_tokens:
            return Choice(decode, None, "local:short-prompt")
        if self._ring is None:
            return Choice(decode, None, "local:no-prefill-worker")
        owner = self._ring.owner(prompt[: self.block_size])
        queued = {name: self.load(name).queued_prompt_tokens for name in {owner, *self._candidates(self.prefill)}}
        shortest = min(queued, key=lambda n: (queued[n], n))
        if queued[owner] - queued[shortest] <= self.queue_slack_tokens:
            return Choice(decode, owner, "remote:prefix-owner")
        return Choice(decode, shortest, "remote:shortest-queue")

    def _candidates(self, names: list[str]) -> Sequence[str]:
        if len(names) <= self.exact_up_to:
            return names
        return self.rng.sample(names, min(self.sample, len(names)))
