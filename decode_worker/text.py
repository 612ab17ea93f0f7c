"""What the decode engine hands out for each request, and what a client reads of it: its text, cut
at a stop string.

    RequestOutput   one request's new tokens this step (their text, once `TextStreams` has seen them);
                    `merged` makes several of one request's outputs one, for a stream that lags
    TextStreams     every open request's incremental detokenizer: `open` it when the request is
                    queued or admitted, `apply` each of its outputs in order; a stop string ends
                    the request there, dropping the tokens past it

An engine in this process applies the text itself (`Engine(text=True)`, the default). A served
worker's engine core does not: its front (`decode_worker.core`'s handles) applies each frame's
outputs and aborts, in the core, a request a stop string has ended, so the core spends no step's
time on strings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.engine.detokenizer import Decoder, IncrementalDetokenizer
from cluster.engine.sampler import TokenLogprob


@dataclass(frozen=True)
class BeamOutput:
    token_ids: list[int]
    text: str
    score: float  # sum of log-probs / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" or "length"


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new this step
    text: str = ""  # new this step
    # The sequences below default to an empty tuple, not a new list: a step makes an output per
    # running request, and a default factory per field tripled what each one cost.
    logprobs: Sequence[TokenLogprob] = ()
    # With the first token, when asked for: (token id, its logprob) for each prompt token after the first.
    prompt_logprobs: Sequence[tuple[int, TokenLogprob]] = ()
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_passes: int = 0  # target-model passes that gave this request tokens
    num_draft_tokens: int = 0  # speculative tokens proposed
    num_accepted_tokens: int = 0  # and kept
    beams: Sequence[BeamOutput] = ()  # beam search: every beam, best first, at the end
    loaded_from: tuple[str, ...] = ()  # on the last output: the tier of each prompt block loaded from the KV tiers


_RARE = ("text", "logprobs", "prompt_logprobs", "beams", "loaded_from")  # empty in most outputs of a served core


def pack_outputs(outputs: Sequence[RequestOutput]) -> tuple:
    """A step's outputs as columns of plain values, for the pipe from an engine core to its front:
    ids, tokens and counts in lists, finish reasons and the rarely set fields by index. Pickled, a
    list of dataclasses costs an object's state per output on both ends; this costs a few lists."""
    ids = [o.request_id for o in outputs]
    tokens = [o.token_ids for o in outputs]
    counts = [
        (o.num_prompt_tokens, o.num_cached_tokens, o.num_output_tokens, o.num_passes, o.num_draft_tokens,
         o.num_accepted_tokens)
        for o in outputs
    ]  # fmt: skip
    ends = {i: o.finish_reason for i, o in enumerate(outputs) if o.finished}
    rare = {
        i: {name: getattr(o, name) for name in _RARE if getattr(o, name)}
        for i, o in enumerate(outputs)
        if o.text or o.logprobs or o.prompt_logprobs or o.beams or o.loaded_from
    }
    return ids, tokens, counts, ends, rare


def unpack_outputs(packed: tuple) -> list[RequestOutput]:
    """The outputs `pack_outputs` packed, equal to them."""
    ids, tokens, counts, ends, rare = packed
    outputs = [
        RequestOutput(
            rid, token_ids, num_prompt_tokens=c[0], num_cached_tokens=c[1], num_output_tokens=c[2],
            num_passes=c[3], num_draft_tokens=c[4], num_accepted_tokens=c[5],
        )
        for rid, token_ids, c in zip(ids, tokens, counts, strict=True)
    ]  # fmt: skip
    for i, reason in ends.items():
        outputs[i].finished, outputs[i].finish_reason = True, reason
    for i, fields in rare.items():
        for name, value in fields.items():
            setattr(outputs[i], name, value)
    return outputs


def merged(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in order, and the
    last one's state (finish, counts, beams). A stream that fell behind sends what it owes at once."""
    if len(outputs) == 1:
        return outputs[0]
    return dataclasses.replace(
        outputs[-1],
        token_ids=[t for out in outputs for t in out.token_ids],
        text="".join(out.text for out in outputs),
        logprobs=[lp for out in outputs for lp in out.logprobs],
        prompt_logprobs=[lp for out in outputs for lp in out.prompt_logprobs],
    )


class TextStreams:
    """The text of many requests' outputs. `open`, `apply` and `close` may come from different
    threads: each touches one request's entry, and a request's outputs are applied in order by one."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self._open: dict[str, IncrementalDetokenizer] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def open(
        self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:  # fmt: skip
        """The request's prompt, and the output it already has (made on a prefill worker, or before it
        moved here): the first new token decodes as it would inline, and what the output's text held
        back (a stop string's possible start) is matched and released with the new text."""
        self._open[request_id] = IncrementalDetokenizer.after(self.tokenizer, prompt_token_ids, output_token_ids, stop)

    def close(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def apply(self, out: RequestOutput) -> bool:
        """Gives `out` the text its new tokens add. A stop string ends the request in `out`: the tokens
        past it (and their logprobs) are dropped and `out` is finished. Returns whether a stop string
        ended it, for whoever runs it to stop it there. A finished request's stream closes."""
        if out.beams:
            self.close(out.request_id)
            beams = [dataclasses.replace(b, text=self.tokenizer.decode(b.token_ids)) for b in out.beams]
            out.beams, out.text = beams, beams[0].text
            return False
        detokenizer = self._open[out.request_id]
        text, stopped = "", False
        for n, token in enumerate(out.token_ids, 1):
            text += detokenizer.add(token)
            if detokenizer.stopped:
                stopped, dropped = True, len(out.token_ids) - n
                if dropped or not out.finished:  # a stop on a step's last token that also ended it keeps its reason
                    out.finish_reason = "stop"
                del out.token_ids[n:]
                out.logprobs = out.logprobs[:n]
                out.num_output_tokens -= dropped
                out.finished = True
                break
        if out.finished:
            text += detokenizer.flush()
            self.close(out.request_id)
        out.text = text
        return stopped
