"""The model folder's tokenizer: `tokenizer.json` (the `tokenizers` library), the chat template and
special tokens of `tokenizer_config.json`, and the stop tokens of `generation_config.json`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from cluster.arch import ModelFormatError


class ChatTemplateError(ValueError):
    """The chat messages cannot be rendered (no template, or the template refused them)."""


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelFormatError(f"{path} is missing")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise ModelFormatError(f"cannot read {path}: {e}") from None
        config = _read_json(folder / "tokenizer_config.json")
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids = self._eos_ids(_read_json(folder / "generation_config.json"))
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("the model has no chat template; send a text prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def _eos_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        eos = generation_config.get("eos_token_id")
        ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        if self.eos_token is not None and (tid := self.token_to_id(self.eos_token)) is not None:
            ids.append(tid)
        return tuple(dict.fromkeys(int(i) for i in ids))


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
