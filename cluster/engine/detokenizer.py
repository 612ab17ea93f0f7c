"""Incremental detokenisation with stop strings.

Text is released as tokens arrive, never ending inside a UTF-8 character: byte-level BPE splits
characters across tokens, and a partial one decodes to U+FFFD, so text that ends in U+FFFD waits for
the next token. Decoding restarts a few tokens back (`prefix_offset`) rather than from the start,
which keeps each step's cost constant and lets merges that depend on context settle.

Stop strings may span token boundaries, so the last `max(len(stop)) - 1` characters are held back
until they cannot start a stop string. On a match the text is cut before the stop string. Only the
text not yet released is kept, so each token costs the same however long the output grows.

A request that moved to another worker with output it already had opens with `after`: the output's
last tokens are replayed, so the new detokenizer holds back what the old one held back (the client
has not been sent it) and a stop string that began before the move is found across it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-6:])  # context so the first token decodes as it would inline
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded text not yet returned: between calls, at most the held-back tail
        self.stopped = False

    @classmethod
    def after(
        cls, tokenizer: Decoder, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
        stop: Sequence[str] = (),
    ) -> IncrementalDetokenizer:  # fmt: skip
        """A detokenizer for the tokens after `output_token_ids`, holding what one that had released
        their text as they came would still hold. Replays only the output's tail: enough tokens to
        make more text than a stop string's hold-back (every token when the output is short)."""
        take = max((len(s) for s in stop), default=1) + 8
        while True:
            start = max(0, len(output_token_ids) - take)
            context = [*prompt_token_ids[-6:], *output_token_ids[max(0, start - 6) : start]]
            detokenizer = cls(tokenizer, context, stop)
            released = sum(len(detokenizer.add(token)) for token in output_token_ids[start:])
            if start == 0 or released > 0:  # the text before the replayed tail was all released
                return detokenizer
            take *= 2

    def add(self, token_id: int) -> str:
        """Adds one token; returns the text that is now safe to emit (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self._pending += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # Released text cannot start a stop string (the hold-back), so the pending text is all a match can be in
        if self._stop and not self.stopped:
            hits = [i for s in self._stop if (i := self._pending.find(s)) != -1]
            if hits:
                self._pending = self._pending[: min(hits)]
                self.stopped = True
                final = True
        cut = len(self._pending) if final else max(0, len(self._pending) - self._hold)
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        return delta
