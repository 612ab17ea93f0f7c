"""A GGUF file's tokenizer as `tokenizer.json` (built with `tokenizers`) and `tokenizer_config.json`.

GGUF stores a byte-level BPE tokenizer (`tokenizer.ggml.model = "gpt2"`) as metadata: the
vocabulary (`tokens`, in the byte alphabet), `merges`, each token's type (control tokens are the
special ones) and the name of llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`), whose split rules
are rebuilt here as the `tokenizers` pre-tokenizer Hugging Face uses for the same models. A
pre-tokenizer or tokenizer model not in the tables below is refused by name.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from cluster.model.arch import ModelFormatError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types; 1 is a normal token

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split rule


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp: "\p{N}" isolated, then GPT-2's rule (StarCoder, SmolLM).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> (pre-tokenizer, ignore_merges, add BOS when the file does not say)
PRE_TOKENIZERS = {
    "gpt-2": (_gpt2, False, False),
    "smollm": (_digits_then_gpt2, False, False),
    "starcoder": (_digits_then_gpt2, False, False),
    "llama-bpe": (lambda: _split(_LLAMA3_SPLIT), True, True),
    "llama3": (lambda: _split(_LLAMA3_SPLIT), True, True),
    "llama-v3": (lambda: _split(_LLAMA3_SPLIT), True, True),
    "qwen2": (lambda: _split(_QWEN2_SPLIT), False, False),
    "deepseek-r1-qwen": (lambda: _split(_QWEN2_SPLIT), False, False),
}


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """(the `tokenizers` tokenizer, the `tokenizer_config.json` mapping) the metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFormatError(f"tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ModelFormatError(
            f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    make_pre, ignore_merges, add_bos_default = PRE_TOKENIZERS[pre]
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        twice = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise ModelFormatError(f"token {twice!r} appears twice in tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    # Control tokens are special (matched whole, skipped when decoding); user-defined ones are matched whole.
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = (_token(meta, tokens, k) for k in ("bos", "eos"))
    tok.post_processor = _post_processor(bos if add_bos else None, eos if add_eos else None, vocab)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": _token(meta, tokens, "unknown"),
        "pad_token": _token(meta, tokens, "padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tok, config


def _token(meta: dict[str, Any], tokens: list[str], kind: str) -> str | None:
    key = f"tokenizer.ggml.{kind}_token_id"
    if (i := meta.get(key)) is None:
        return None
    if not 0 <= i < len(tokens):
        raise ModelFormatError(f"{key} = {i} is outside the vocabulary ({len(tokens)} tokens)")
    return tokens[i]


def _post_processor(bos: str | None, eos: str | None, vocab: dict[str, int]) -> Any:
    """BOS before and EOS after each sequence where the file asks for them (as Hugging Face's
    Llama-3 `tokenizer.json` does); otherwise only the byte-level offsets step."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None and eos is None:
        return byte_level

    def sequence(name: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, name, eos) if t is not None]

    specials = [(t, vocab[t]) for t in dict.fromkeys(t for t in (bos, eos) if t is not None)]
    template = processors.TemplateProcessing(
        single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1), special_tokens=specials
    )
    return processors.Sequence([byte_level, template])
