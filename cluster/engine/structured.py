"""Structured output: each constrained request's matcher, and the token masks the sampler applies.

A `Constraint` (JSON schema, any JSON object, regex, Lark grammar, a choice among strings) becomes
an llguidance grammar. `Grammars` compiles it against the model's tokenizer once per distinct
constraint (an LRU keyed by the constraint's hash; failures are cached too) and gives each sequence
a `Matcher` copied from the compiled one. The router uses the same `Grammars` to refuse a bad
constraint before any worker sees it; a worker compiles it again from its own cache.

A constrained request on a worker:

    request.matcher = grammars.matcher(constraint, output_so_far)  # replays output made elsewhere
    pending = grammars.masks([(row, matcher, draft), ...])          # on a thread, beside the pass
    ... the forward pass ...
    rows = pending.attach(rows)                                     # `SampleRow.allowed`, per position
    matcher.consume(new_tokens)                                     # after the step

EOS is allowed exactly when the matcher accepts (llguidance's tokenizer is given the model's EOS
ids); once a match is complete and nothing may follow, EOS is the only token left. Speculative
drafts are cut to the prefix the matcher accepts before they are scored; the masks of a draft's
positions are computed by consuming it and rolling back. A matcher that was fed a token it does
not accept (a resumed stream whose tokens were not made under this constraint) allows EOS only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy as llg_numpy  # not llguidance.torch: importing it compiles a kernel we do not use
import numpy as np

from cluster.engine.request import Constraint

if TYPE_CHECKING:
    import torch

    from cluster.engine.sampler import Draft, SampleRow

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex, grammar or the choices together
MAX_CHOICES = 1024
# Compact JSON: no free whitespace, so a model cannot pad a value with spaces until max_tokens.
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}
# A fifth of llguidance's default fuel for building the lexer's regexes: a few milliseconds, which
# every schema, regex and grammar of the tests and benchmarks stays far within, while a small one
# that explodes (`(a{1000}){1000}`: a 1.7 s first mask by default) fails fast and is refused.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=200_000)


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint; ValueError for one that is not even well-formed."""
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured.json_schema: not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("structured.json_schema: a schema is a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.value)
    if c.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(c.value)
    alternatives = " | ".join(json.dumps(s, ensure_ascii=False) for s in c.choices)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


def constraint_key(c: Constraint) -> str:
    return hashlib.sha256(json.dumps([c.kind, c.value, list(c.choices)]).encode()).hexdigest()


class Matcher:
    """One sequence's position in its constraint's grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def consume(self, tokens: Sequence[int]) -> None:
        """Advances over tokens the sequence now has (a refused one leaves the matcher in error)."""
        if tokens and not self._m.is_error():
            self._m.consume_tokens(list(tokens))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) the matcher would accept from here, without moving."""
        return 0 if self._m.is_error() else self._m.validate_tokens(list(tokens))

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def fill(self, bitmask: torch.Tensor, row: int, draft: Sequence[int], eos_only: torch.Tensor) -> int:
        """Writes the masks of the positions before each draft token and past the last into rows
        [row, row + len(draft) + 1) of `bitmask`; the matcher ends where it started. Returns rows written."""
        consumed = 0
        for j in range(len(draft) + 1):
            if self._m.is_error():
                bitmask[row + j] = eos_only
            elif j > consumed:  # past a draft token the matcher refused: never reached by verification
                bitmask[row + j] = -1
            else:
                llg_numpy.fill_next_token_bitmask(self._m, bitmask.numpy(), row + j)
            if j < len(draft) and j == consumed and not self._m.is_error():
                consumed += self._m.try_consume_tokens([draft[j]])
        if consumed:
            self._m.rollback(consumed)
        return len(draft) + 1


class PendingMasks:
    """Masks being computed on the mask thread for some of a step's sampling rows: entry i covers
    the rows [starts[i], starts[i] + len(draft) + 1)."""

    def __init__(self, future: Future[torch.Tensor], starts: Sequence[int], lengths: Sequence[int]) -> None:
        self._future = future
        self._starts = list(starts)
        self._lengths = list(lengths)

    def wait(self) -> torch.Tensor:
        """[rows, words] int32: the masks, entries in order."""
        return self._future.result()

    def attach(self, rows: Sequence[SampleRow]) -> list[SampleRow]:
        """`rows` with each constrained one's mask (waits for them)."""
        bitmask, out, at = self.wait(), list(rows), 0
        for start, n in zip(self._starts, self._lengths, strict=True):
            for j in range(n):
                out[start + j] = dataclasses.replace(out[start + j], allowed=bitmask[at + j])
            at += n
        return out


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, caches them, and computes masks.
    The llguidance tokenizer (its token trie; about half a second to build) is built on first use."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_chars: int = MAX_SPEC_CHARS,
        cache_size: int = 256,
        overlap: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap  # masks on a thread beside the forward pass, else before it
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_chars = max_chars
        self.cache_size = cache_size
        self._tokenizer_json = tokenizer_json
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()  # key -> matcher or error
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.words = (vocab_size + 31) // 32
        self._eos_only = np.zeros(self.words, dtype=np.int32)
        for t in self.eos_token_ids:
            self._eos_only[t // 32] |= np.int32(_bit(t % 32))
        self.compiles = 0  # distinct constraints compiled (cache misses)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                eos = list(self.eos_token_ids) or None
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def check(self, c: Constraint) -> None:
        """Raises ValueError naming what is wrong with `c` (compiling it, once per distinct constraint)."""
        self._compile(c)

    def matcher(self, c: Constraint, tokens: Sequence[int] = ()) -> Matcher:
        """A fresh matcher for `c`, advanced over `tokens` (output the sequence already has)."""
        m = Matcher(self._compile(c).deep_copy())
        m.consume(tokens)
        return m

    def masks(self, entries: Sequence[tuple[int, Matcher, Sequence[int]]]) -> PendingMasks:
        """Starts computing, on the mask thread, each entry's masks: for (first row, matcher, draft),
        one row per draft token and one past the last. Nothing may touch those matchers until
        the masks are waited for."""
        work = [(m, d) for _, m, d in entries]
        rows = sum(len(d) + 1 for _, d in work)
        if self.overlap:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-masks")
            future = self._pool.submit(self._fill, work, rows)
        else:
            future = Future()
            future.set_result(self._fill(work, rows))
        return PendingMasks(future, [s for s, _, _ in entries], [len(d) + 1 for _, d in work])

    def close(self) -> None:
        """Stops the mask thread (the engine's loop has ended)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _fill(self, entries: list[tuple[Matcher, Sequence[int]]], rows: int) -> torch.Tensor:
        import torch  # here: the router, which only checks constraints, runs without torch

        bitmask, eos_only = torch.empty(rows, self.words, dtype=torch.int32), torch.from_numpy(self._eos_only)
        at = 0
        for matcher, draft in entries:
            at += matcher.fill(bitmask, at, draft, eos_only)
        return bitmask

    def _compile(self, c: Constraint) -> llguidance.LLMatcher:
        size = len(c.value) + sum(len(s) for s in c.choices)
        if size > self.max_chars:
            raise ValueError(f"structured.{c.kind}: {size} characters; at most {self.max_chars}")
        if len(c.choices) > MAX_CHOICES:
            raise ValueError(f"structured.choice: {len(c.choices)} choices; at most {MAX_CHOICES}")
        key = constraint_key(c)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
        if hit is None:
            hit = self._build(c)
            with self._lock:
                self._compiled[key] = hit
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def _build(self, c: Constraint) -> llguidance.LLMatcher | str:
        self.compiles += 1
        try:
            grammar = grammar_text(c)
        except ValueError as e:
            return str(e) if str(e).startswith("structured.") else f"structured.{c.kind}: {e}"
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        error = m.get_error() if m.is_error() else self._probe(m.deep_copy())
        if error:
            return f"structured.{c.kind}: {_short(error)}"
        return m

    def _probe(self, m: llguidance.LLMatcher) -> str:
        """Takes a first step: the first mask, and one token it allows. A grammar too complex
        for the limits fails here (most at their first token), so it is refused where it is
        checked, not on the worker in the middle of a batch. Returns the error, or ""."""
        bitmask = np.zeros((1, self.words), dtype=np.int32)
        llg_numpy.fill_next_token_bitmask(m, bitmask, 0)
        words = np.flatnonzero(bitmask[0] & ~self._eos_only)
        if not m.is_error() and len(words):
            word = int(words[0])
            bits = int(bitmask[0, word]) & ~int(self._eos_only[word]) & 0xFFFFFFFF
            m.consume_token(32 * word + (bits & -bits).bit_length() - 1)
        return f"too complex for the matcher's limits: {m.get_error().splitlines()[0]}" if m.is_error() else ""


def grammatical(matcher: Matcher | None, draft: Draft) -> Draft:
    """A speculative draft cut to the prefix `matcher` accepts (the rest could never be kept)."""
    if matcher is None or not draft.tokens:
        return draft
    n = matcher.valid_prefix(draft.tokens)
    if n == len(draft.tokens):
        return draft
    return dataclasses.replace(draft, tokens=draft.tokens[:n], probs=None if draft.probs is None else draft.probs[:n])


def for_tokenizer(tokenizer: object, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammars | None:
    """`Grammars` for a `cluster.model.tokenizer.Tokenizer`; None for one without a tokenizer.json
    (a test's stand-in), where constrained requests are refused."""
    to_json = getattr(tokenizer, "to_json", None)
    return Grammars(to_json(), vocab_size, eos_token_ids) if callable(to_json) else None


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def _short(message: str, limit: int = 400) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + " ..."
