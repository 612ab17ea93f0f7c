"""Incremental detokenisation with stop strings.

Text is released as tokens arrive, never ending inside a UTF-8 character: byte-level BPE splits
characters across tokens, and a partial one decodes to U+FFFD, so text that ends in U+FFFD waits for
the next token. Decoding restarts a few tokens back (`prefix_offset`) rather than from the start,
which keeps each step's cost constant and lets merges that depend on context settle.

Stop strings may span token boundaries, so the last `max(len(stop)) - 1` characters are held back
until they cannot start a stop string. On a match the text is cut before the stop string.
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
        self.text = ""  # all decoded output text so far (before any stop string)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Adds one token; returns the text that is now safe to emit (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop and not self.stopped:
            start = max(0, self._emitted - self._hold)
            hits = [i for s in self._stop if (i := self.text.find(s, start)) != -1]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
