"""Every request field of the OpenAI face, per endpoint: honoured, refused, or ignored on purpose.

This is the one list. `check(body, table)` refuses, with a `FieldError` naming the field (a 400 in
OpenAI's error shape), any key that is not in the endpoint's table and any refused field sent with
a value other than null or one of its neutral values (those that ask for nothing missing: `logit_bias:
{}`, `skip_special_tokens: true`). docs/openai.md's tables are
tested against `rows()`. Pure: no FastAPI, no gRPC.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored"


class FieldError(ValueError):
    """A request field the face refuses; `param` names it as OpenAI's error shape does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class Field:
    decision: str
    note: str  # what an honoured field does; why a field is refused (the 400's message) or ignored
    neutral: tuple[Any, ...] = ()  # values of a refused field that are accepted: they ask for nothing missing
    fields: Mapping[str, Field] | None = None  # the fields of an object value (of each object in a list: listed)
    listed: bool = False


def honoured(note: str, fields: Mapping[str, Field] | None = None, listed: bool = False) -> Field:
    return Field(HONOURED, note, fields=fields, listed=listed)


def refused(note: str, *neutral: Any) -> Field:
    return Field(REFUSED, note, neutral)


def ignored(note: str) -> Field:
    return Field(IGNORED, note)


RESPONSE_FORMAT = (
    '"text", "json_object" or "json_schema" (name, description, schema, strict): the output is constrained to '
    "the schema, strict or not, so it always validates (docs/structured.md)"
)
TOOLS = (
    "function tools, through the chat template (or described in the system message); the reply's "
    "<tool_call> blocks are its tool_calls, streamed as deltas too"
)
TOOL_CHOICE = (
    '"none" (tools left out), "auto", "required" or a named function; required and named are constrained '
    "to well-formed calls matching the parameters"
)
FUNCTIONS = "the deprecated functions API is not read; send tools and tool_choice"
NOT_STORED = "nothing is stored or logged per caller"
PROMPT_CACHE = "the prefix cache reuses any shared prompt prefix of whole blocks, with no key, breakpoint or lifetime"

STREAM_OPTIONS = {
    "include_usage": honoured("a last chunk, before [DONE], with the whole request's usage"),
    "continuous_usage_stats": honoured("(vLLM) every chunk carries the usage so far"),
    "include_obfuscation": ignored("chunks carry no obfuscation padding"),
}

PART = {  # a part of a message's content list
    "type": honoured('"text", or "refusal" in an assistant turn; other types are refused'),
    "text": honoured("a text part's text; a message's parts are joined"),
    "refusal": honoured("a refusal part's text, read as text"),
    "image_url": refused("the served model reads text only"),
    "input_audio": refused("the served model reads text only"),
    "file": refused("the served model reads text only"),
    "prompt_cache_breakpoint": ignored(PROMPT_CACHE),
}

MESSAGE = {
    "role": honoured('passed to the chat template; "developer" reads as "system"'),
    "content": honoured("a string, or a list of text parts", PART, listed=True),
    "name": ignored("the chat template renders role and content only"),
    "refusal": honoured("an assistant turn without content reads its refusal as content"),
    "tool_calls": honoured("an assistant turn's calls, through the chat template (or written as <tool_call> blocks)"),
    "tool_call_id": honoured('a "tool" turn\'s call id, passed to the chat template'),
    "function_call": refused(FUNCTIONS),
    "audio": refused("audio is not supported"),
}

OPENAI = {  # OpenAI's fields that both endpoints have
    "model": honoured("the served model's name, or a LoRA adapter's (`/v1/models` lists them; another is 404)"),
    "n": honoured("1 to 16 choices, sharing the prompt's cached KV blocks"),
    "stream": honoured("server-sent events ending in data: [DONE]"),
    "stream_options": honoured("only with stream: true", STREAM_OPTIONS),
    "temperature": honoured("0 is greedy"),
    "top_p": honoured("nucleus sampling"),
    "seed": honoured("this request's sampler seed"),
    "stop": honoured("a string or a list; the text ends before it"),
    "presence_penalty": honoured("in [-2, 2]"),
    "frequency_penalty": honoured("in [-2, 2]"),
    "logit_bias": refused("the sampler has no per-token bias", {}),
    "user": ignored(NOT_STORED),
}

VLLM = {  # vLLM's extensions that clients send, on both endpoints
    "top_k": honoured("(vLLM) keep the k most likely tokens; -1 keeps all"),
    "min_p": honoured("(vLLM) drop tokens below min_p times the top token's probability"),
    "repetition_penalty": honoured("(vLLM) 1 is none"),
    "ignore_eos": honoured("(vLLM) keep generating past EOS"),
    "min_tokens": honoured("(vLLM) no stop before this many tokens"),
    "stop_token_ids": honoured("(vLLM) stop after one of these tokens"),
    "skip_special_tokens": refused("(vLLM) special tokens are always left out of the text", True),
    "spaces_between_special_tokens": refused("(vLLM) special tokens are always left out of the text", True),
    "include_stop_str_in_output": refused("(vLLM) the text always ends before the stop string", False),
    "truncate_prompt_tokens": refused("(vLLM) prompts are never truncated; a prompt too long is refused"),
    "prompt_logprobs": honoured(
        "(vLLM) each prompt token's log-probability and the top n at its position, by token id (rank null for a "
        "token outside the top n); the prompt is computed whole, past the prefix cache; not with stream"
    ),
    "use_beam_search": refused("(vLLM) beam search is num_beams here", False),
    "bad_words": refused("(vLLM) the sampler has no banned words", []),
    "allowed_token_ids": refused("(vLLM) the sampler has no allowed-token list"),
    "priority": refused("(vLLM) requests are not prioritised"),
    "guided_json": honoured("(vLLM) the output is a JSON value valid against this schema"),
    "guided_regex": honoured("(vLLM) the output matches this regex (Rust regex syntax)"),
    "guided_choice": honoured("(vLLM) the output is one of these strings"),
    "guided_grammar": refused("(vLLM) EBNF grammars are not read; Tandem's gRPC API takes Lark grammars"),
    "cache_salt": honoured(
        "(vLLM) a non-empty string of at most 256 characters: requests share cached KV (and KV-aware placement) "
        "only with requests of the same salt"
    ),
    "structured_outputs": refused("(vLLM) send response_format, guided_json, guided_regex or guided_choice"),
}

TANDEM = {  # Tandem's own (tandem.v1.SamplingParams and LatencyBudget)
    "speculative_tokens": honoured("(Tandem) at most this many draft tokens per step; 0 for none"),
    "num_beams": honoured("(Tandem) beam search; the choice is the best beam"),
    "length_penalty": honoured("(Tandem, vLLM) beam search: a beam scores log-probability / length ** length_penalty"),
    "early_stopping": honoured('(Tandem) beam search: true, false or "never"'),
    "ttft_seconds": honoured("(Tandem) this request's time-to-first-token budget"),
    "tpot_seconds": honoured("(Tandem) this request's time-per-output-token budget"),
}

COMPLETIONS = {
    "prompt": honoured(
        "a string, a list of token ids, or a list of up to 64 of either (a batch: each prompt its own request, "
        "choice p * n + j prompt p's j-th, usage summed)"
    ),
    **OPENAI,
    "max_tokens": honoured("at least 1; 16 when unset"),
    "logprobs": honoured(
        "the sampled token's and this many top log-probabilities: each token's text (the tokens' texts join to "
        "the choice's), its alternatives' by text, and each token's character offset"
    ),
    "echo": honoured(
        "the prompt's text leads the choice's; with logprobs, its tokens lead the logprobs (the first with null), "
        "computed whole, past the prefix cache"
    ),
    "best_of": refused("server-side best-of is not supported; ask for n choices, or num_beams", 1),
    "suffix": refused("insertion (suffix) is not supported", ""),
    "response_format": honoured(f"(vLLM) {RESPONSE_FORMAT}"),
    **VLLM,
    "add_special_tokens": refused("(vLLM) a text prompt is always encoded with the tokenizer's special tokens", True),
    **TANDEM,
}

CHAT = {
    "messages": honoured("through the model's chat template", MESSAGE, listed=True),
    **OPENAI,
    "max_completion_tokens": honoured("at least 1; up to the context window when unset"),
    "max_tokens": honoured("max_completion_tokens' older name"),
    "logprobs": honoured(
        "true: the sampled tokens' log-probabilities, each with its text (they join to the content) and UTF-8 bytes"
    ),
    "top_logprobs": honoured("with logprobs: true, this many alternatives per token"),
    "response_format": honoured(RESPONSE_FORMAT),
    "tools": honoured(TOOLS),
    "tool_choice": honoured(TOOL_CHOICE),
    "functions": refused(FUNCTIONS, []),
    "function_call": refused(FUNCTIONS, "none"),
    "parallel_tool_calls": honoured("false: at most one call (required and named ones constrained to one)"),
    "audio": refused("audio output is not supported"),
    "modalities": refused("the served model writes text only", ["text"]),
    "prediction": refused("predicted outputs are not supported"),
    "reasoning_effort": refused("the served model has no reasoning mode"),
    "verbosity": refused("the served model has no verbosity control"),
    "web_search_options": refused("web search is not supported"),
    "moderation": refused("no moderation model runs here"),
    "metadata": ignored(NOT_STORED),
    "store": ignored(NOT_STORED),
    "safety_identifier": ignored(NOT_STORED),
    "service_tier": ignored("there is one tier"),
    "prompt_cache_key": ignored(PROMPT_CACHE),
    "prompt_cache_options": ignored(PROMPT_CACHE),
    "prompt_cache_retention": ignored(PROMPT_CACHE),
    **VLLM,
    "add_special_tokens": refused("(vLLM) the chat template writes the special tokens; none are added", False),
    "add_generation_prompt": refused("(vLLM) the chat template always opens the assistant's turn", True),
    "continue_final_message": refused("(vLLM) the chat template always opens a new assistant turn", False),
    "chat_template": refused("(vLLM) the model folder's chat template is used"),
    "chat_template_kwargs": refused("(vLLM) the chat template takes no arguments", {}),
    "echo": refused("(vLLM) echo is a /v1/completions field here", False),
    **TANDEM,
}

TABLES = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


def check(body: Mapping[str, Any], table: Mapping[str, Field], prefix: str = "") -> None:
    """Raises `FieldError` for the first key of `body` (nested objects included) that is unknown,
    or refused with a value that asks for something missing. Null is absent, as in OpenAI's API."""
    for key, value in body.items():
        name = prefix + key
        field = table.get(key)
        if field is None:
            raise FieldError(name, f"Unrecognized request argument supplied: {name} (docs/openai.md lists the fields)")
        if value is None:
            continue
        if field.decision == REFUSED and not _neutral(value, field.neutral):
            reason = field.note.split(") ", 1)[1] if field.note.startswith("(") else field.note  # no "(vLLM)"
            raise FieldError(name, f"{name} is not supported: {reason}")
        if field.fields is not None and not field.listed and isinstance(value, dict):
            check(value, field.fields, name + ".")
        elif field.fields is not None and field.listed and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    check(item, field.fields, f"{name}[{i}].")


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(v) and value == v for v in neutral)  # True is not 1 here


def rows(table: Mapping[str, Field], prefix: str = "") -> Iterator[tuple[str, Field]]:
    """(name, field) for every field, nested ones as `stream_options.include_usage` and
    `messages[].content[].text`."""
    for key, field in table.items():
        yield prefix + key, field
        if field.fields is not None:
            yield from rows(field.fields, f"{prefix}{key}{'[]' if field.listed else ''}.")
