"""The OpenAI reply to a completion's `tandem.v1.Generate` calls, one per choice: a whole body
(`collect`) or server-sent events (`stream`).

Usage counts each prompt once (for n > 1, its first choice's prefix-cache hit goes into
`prompt_tokens_details.cached_tokens`) and every choice's completion tokens; a completions batch
of prompts sums them. An echoed prompt leads
its choice's text; streamed, it is the choice's first chunk. `stream` ends every choice's call when
the client goes away, and the cluster frees their KV.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from tandem.v1 import api_pb2

from router.openai.request import Plan
from router.openai.tools import ToolStream, parse

FINISH = {api_pb2.FINISH_REASON_STOP: "stop", api_pb2.FINISH_REASON_LENGTH: "length"}
_OMIT = object()


@dataclass(frozen=True)
class Reply:
    rid: str
    created: int
    model: str
    plan: Plan
    echoes: list[str]  # per choice: the prompt text that leads it ("" without echo)

    def body(self, choices: list[dict[str, Any]], usage: Any = _OMIT) -> dict[str, Any]:
        chat = "chat.completion.chunk" if self.plan.stream else "chat.completion"
        kind = chat if self.plan.chat else "text_completion"
        out = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not _OMIT:
            out["usage"] = usage
        return out


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    out["total_tokens"] = prompt + completion
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


async def messages_from(call, first) -> AsyncIterator[api_pb2.GenerateResponse]:  # type: ignore[no-untyped-def]
    """The call's messages from `first` on (read with `read()`: gRPC forbids mixing it with iteration)."""
    m = first
    while m is not grpc.aio.EOF:
        yield m
        m = await call.read()


def _logprobs(messages: list[api_pb2.GenerateResponse], chat: bool, offset: int = 0) -> dict[str, Any] | None:
    """The messages' log-probabilities as OpenAI writes them: each token's text and UTF-8 bytes, its
    alternatives'; a completion's also each token's character offset in the choice's text, from
    `offset` (the echoed prompt's length, or what earlier chunks carried)."""
    entries = [lp for m in messages for lp in m.logprobs]
    if not entries:
        return None
    if chat:
        return {
            "content": [
                {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
                 "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}
                                  for t in lp.top]}
                for lp in entries
            ]
        }  # fmt: skip
    offsets = []
    for lp in entries:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in entries],
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in entries],
        "text_offset": offsets,
    }


def _echoed_logprobs(first: api_pb2.GenerateResponse, echo: str, top_n: int) -> dict[str, Any]:
    """An echoed prompt's log-probabilities, as a completion's: its first token has none (its
    text is what of the echoed prompt the other tokens' texts leave), then each prompt token's."""
    entries = first.prompt_logprobs
    rest = "".join(lp.token for lp in entries)
    head = echo[: len(echo) - len(rest)] if echo.endswith(rest) else ""
    tokens, offsets = [head, *(lp.token for lp in entries)], [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(lp.logprob for lp in entries)],
        "top_logprobs": [None, *({t.token: t.logprob for t in lp.top[:top_n]} for lp in entries)],
        "text_offset": offsets,
    }


def _with_echoed(echoed: dict[str, Any], logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return echoed if logprobs is None else {key: echoed[key] + logprobs[key] for key in echoed}


def _vllm_prompt_logprobs(first: api_pb2.GenerateResponse, top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first token, then for each prompt token a map of token
    id to its logprob, rank and text: the token itself (rank null when it is not among the top n,
    whose ranks are 1..n), then the top n."""
    out: list[dict[str, Any] | None] = [None]
    for lp in first.prompt_logprobs:
        top = {str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": t.token}
               for r, t in enumerate(lp.top[:top_n], 1)}  # fmt: skip
        own = top.pop(str(lp.token_id), {"logprob": lp.logprob, "rank": None, "decoded_token": lp.token})
        out.append({str(lp.token_id): own, **top})
    return out


async def collect(calls, firsts, reply: Reply) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The whole response; a call's gRPC error propagates."""
    plan, chat, choices, usages = reply.plan, reply.plan.chat, [], []
    for index, (call, first) in enumerate(zip(calls, firsts, strict=True)):
        messages = [m async for m in messages_from(call, first)]
        text = reply.echoes[index] + "".join(m.text for m in messages)
        last = messages[-1] if messages else api_pb2.GenerateResponse()
        usages.append(last.usage)
        logprobs = _logprobs(messages, chat, len(reply.echoes[index]))
        if plan.echo_logprobs is not None:
            logprobs = _with_echoed(_echoed_logprobs(first, reply.echoes[index], plan.echo_logprobs), logprobs)
        choice: dict[str, Any] = {"index": index, "finish_reason": FINISH.get(last.finish_reason, "stop"),
                                  "logprobs": logprobs}  # fmt: skip
        if plan.prompt_logprobs is not None and not chat:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(first, plan.prompt_logprobs)
        if chat and reply.plan.tools is not None:
            content, tool_calls = parse(text, reply.plan.tools.parallel)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"], choice["finish_reason"] = tool_calls, "tool_calls"
            choice["message"] = message
        else:
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        choices.append(choice)
    completion = sum(u.completion_tokens for u in usages)
    firsts_of_prompts = usages[:: reply.plan.n]  # each prompt counts once, however many choices it has
    prompt = sum(u.prompt_tokens for u in firsts_of_prompts)
    body = reply.body(choices, usage(prompt, completion, sum(u.cached_prompt_tokens for u in firsts_of_prompts)))
    if plan.prompt_logprobs is not None and chat:  # vLLM writes a chat's at the top
        body["prompt_logprobs"] = _vllm_prompt_logprobs(firsts[0], plan.prompt_logprobs)
    return body


def _tool_choices(
    reply: Reply, index: int, reader: ToolStream, m: api_pb2.GenerateResponse, first: bool
) -> list[dict[str, Any]]:
    """A message of a chat with tools as chunks: content and whole calls, as `reader` finds them."""
    finish = FINISH.get(m.finish_reason) if m.finish_reason else None
    deltas = reader.feed(m.text) + (reader.finish() if finish else [])
    if finish and reader.calls:
        finish = "tool_calls"
    if finish and not deltas:
        deltas = [{"content": ""}]
    choices = []
    for j, d in enumerate(deltas):
        delta = {"role": "assistant", **d} if first and j == 0 else d
        last = finish if j == len(deltas) - 1 else None
        choices.append({"index": index, "delta": delta, "finish_reason": last, "logprobs": None})
    return choices


def _choice(reply: Reply, index: int, text: str, finish: str | None, first: bool) -> dict[str, Any]:
    if not reply.plan.chat:
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}


async def stream(calls, firsts, reply: Reply) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
    """Server-sent events: each choice's deltas as they arrive, the usage chunk, `[DONE]`."""
    plan = reply.plan
    queue: asyncio.Queue[tuple[int, api_pb2.GenerateResponse | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for m in messages_from(calls[index], firsts[index]):
                await queue.put((index, m))
        finally:
            await queue.put((index, None))

    def event(choices: list[dict[str, Any]]) -> bytes:
        so_far = usage(prompt, sum(done)) if plan.continuous_usage else None if plan.include_usage else _OMIT
        return f"data: {json.dumps(reply.body(choices, so_far))}\n\n".encode()

    prompt = sum(getattr(first, "prompt_tokens", 0) for first in firsts[:: plan.n])  # each prompt once
    done, final = [0] * len(calls), [api_pb2.Usage() for _ in calls]  # completion tokens so far; last usages
    started = [False] * len(calls)
    offsets = [len(echo) for echo in reply.echoes]  # each completion choice's text so far, for text_offset
    tools = plan.tools if plan.chat else None
    readers = [ToolStream(tools.parallel) for _ in calls] if tools is not None else []
    tasks = [asyncio.create_task(pump(i)) for i in range(len(calls))]
    try:
        for index, echo in enumerate(reply.echoes):
            if echo:
                started[index] = True
                choice = _choice(reply, index, echo, None, first=True)
                if plan.echo_logprobs is not None:
                    choice["logprobs"] = _echoed_logprobs(firsts[index], echo, plan.echo_logprobs)
                yield event([choice])
        open_choices = len(calls)
        while open_choices:
            index, m = await queue.get()
            if m is None:
                open_choices -= 1
                continue
            done[index] = m.usage.completion_tokens if m.finish_reason else done[index] + len(m.token_ids)
            if m.finish_reason:
                final[index] = m.usage
            if readers:
                for j, choice in enumerate(_tool_choices(reply, index, readers[index], m, not started[index])):
                    choice["logprobs"], started[index] = _logprobs([m], plan.chat) if j == 0 else None, True
                    yield event([choice])
                continue
            finish = FINISH.get(m.finish_reason) if m.finish_reason else None
            choice = _choice(reply, index, m.text, finish, first=not started[index])
            choice["logprobs"], started[index] = _logprobs([m], plan.chat, offsets[index]), True
            offsets[index] += sum(len(lp.token) for lp in m.logprobs)
            yield event([choice])
        if plan.include_usage:
            whole = usage(prompt, sum(done), sum(u.cached_prompt_tokens for u in final[:: plan.n]))
            yield f"data: {json.dumps(reply.body([], whole))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:  # a client that disconnects cancels every choice: the cluster frees their KV
        for call in calls:
            call.cancel()
        for task in tasks:
            task.cancel()
