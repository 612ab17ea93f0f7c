"""Concurrent streams for the fault tests: half greedy and half seeded, each one's tokens, and an event
set once every one of them has its first token (the moment to break something under them)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from router.sdk.client import Client


def run_streams(
    targets: Sequence[str],
    n: int,
    prompt: str | list[int],
    max_tokens: int,
    first: threading.Event | None = None,
    retries: int = 0,
) -> list[list[int]]:
    """`n` streams at once, stream `i` through `targets[i % len(targets)]` (seeded with `i` where `i` is
    even); `prompt`: token ids, or a text in which `{i}` is the stream's number; `retries`: how often
    the SDK may resume one through another router."""
    started = threading.Barrier(n + 1) if first is not None else None

    def one(i: int) -> list[int]:
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.8, "seed": i}
        text = prompt.format(i=i) if isinstance(prompt, str) else prompt
        tokens: list[int] = []
        with Client(targets[i % len(targets)], timeout=180, retries=retries) as client:
            for delta in client.stream(text, max_tokens=max_tokens, ignore_eos=True, **sampling):
                if not tokens and started is not None:
                    started.wait(60)
                tokens += delta.token_ids
        return tokens

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        if started is not None and first is not None:
            started.wait(60)
            first.set()
        return [f.result(300) for f in futures]
