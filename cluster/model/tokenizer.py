"""The model folder's tokenizer: `tokenizer.json` (the `tokenizers` library), the chat template
(`chat_template.jinja`, else `tokenizer_config.json`'s, a string or a list of named templates), the
special tokens of `tokenizer_config.json`, and the stop tokens of `generation_config.json`.

Each token's bytes in the text (`token_bytes`) come from the vocabulary: a byte-level BPE token's
characters stand for bytes (GPT-2's table), a SentencePiece one's `▁` for a space and `<0xNN>` for a
byte, and a special token stands for nothing (decoding skips it).

Chats are applied as transformers applies them: the template is rendered in a sandbox with the same
globals and filters, then the text is encoded without adding special tokens again (the template
writes its own BOS; the tokenizer's post-processor must not add a second one).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from cluster.model import chat_tools
from cluster.model.arch import ModelFormatError
from cluster.model.gguf import model_folder


class ChatTemplateError(ValueError):
    """The chat messages cannot be rendered (no template, or the template refused them)."""


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = model_folder(folder)  # a .gguf file is imported once into a folder
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelFormatError(f"{path} is missing")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise ModelFormatError(f"cannot read {path}: {e}") from None
        config = _read_json(folder / "tokenizer_config.json")
        self.chat_template = _chat_template(folder, config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # What a template may name, as transformers passes its special tokens map.
        self._special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        generation = _read_json(folder / "generation_config.json")
        self.eos_token_ids = self._eos_ids(generation)
        self.sampling_defaults = sampling_defaults(generation, folder / "generation_config.json")
        self._template: jinja2.Template | None = None
        self._bytes: list[bytes] | None = None  # each token's bytes, built on first use

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for in the text (b"" for a special token or an id
        outside the vocabulary): a stream's tokens' bytes join to its text's UTF-8."""
        if self._bytes is None:
            self._bytes = self._byte_table()
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def _byte_table(self) -> list[bytes]:
        table = [b""] * self.vocab_size
        added = self._tok.get_added_tokens_decoder()
        byte_level = "ByteLevel" in json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        for text, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in added:
                table[i] = b"" if added[i].special else text.encode()
            elif byte_level and all(c in to_byte for c in text):
                table[i] = bytes(to_byte[c] for c in text)
            elif match := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text):
                table[i] = bytes([int(match[1], 16)])
            else:
                table[i] = text.replace("\u2581", " ").encode()
        return table

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (for the structured-output matcher)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The chat rendered to text, special tokens written out as the template writes them. `tools`
        (OpenAI's tool definitions) go to a template that takes them; for one that does not, they
        are described in the system message and earlier tool calls written into their turns, in the
        `<tool_call>` form the model is then asked to answer in (`chat_tools`)."""
        if self.chat_template is None:
            raise ChatTemplateError("the model has no chat template; send a text prompt instead")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        extra: dict[str, Any] = {}
        if "tool_calls" not in self.chat_template:
            messages = [chat_tools.fold_tool_calls(m) for m in messages]
        if tools and "tools" in self.chat_template:
            extra["tools"] = list(tools)
        elif tools:
            messages = chat_tools.with_tools_prompt(messages, tools)
        try:
            return self._template.render(
                **self._special, messages=list(messages), add_generation_prompt=add_generation_prompt, **extra
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat's prompt token ids: rendered, then encoded without special tokens added again."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)

    def _eos_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        eos = generation_config.get("eos_token_id")
        ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        if self.eos_token is not None and (tid := self.token_to_id(self.eos_token)) is not None:
            ids.append(tid)
        return tuple(dict.fromkeys(int(i) for i in ids))


# generation_config.json's sampling fields, as `tandem.v1.SamplingParams` names them
SAMPLING_DEFAULTS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def sampling_defaults(generation_config: dict[str, Any], where: Path) -> dict[str, float | int]:
    """The model's own sampling defaults: the fields of `SAMPLING_DEFAULTS` its generation_config.json
    sets (a request that leaves one unset gets it; `model.generation_config: none` turns them off)."""
    found: dict[str, float | int] = {}
    for key, kind in SAMPLING_DEFAULTS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
            raise ModelFormatError(f"{where}: {key} must be a {kind.__name__}, not {value!r}")
        found[key] = kind(value)
    return found


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` when the folder has one (transformers saves templates there now), else
    the config's: a string, or a list of {"name", "template"} of which "default" is the chat one."""
    path = folder / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ModelFormatError(f"{folder}: chat templates {sorted(map(str, named))} name no 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ModelFormatError(f"{folder}: chat_template must be a string or a list of named templates")
    return template


def _environment() -> ImmutableSandboxedEnvironment:
    """A sandbox with transformers' settings, globals and `tojson` (no HTML escaping)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} is not a JSON object")
    return data


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as {"content": ...}.
    return token.get("content") if isinstance(token, dict) else token


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character a byte-level BPE vocabulary
    writes it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
