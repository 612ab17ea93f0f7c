"""Chat templates applied as transformers applies them: Tandem's prompt token ids for a chat equal
transformers' `apply_chat_template(tokenize=True)` for four real template shapes, each on a
tokenizer built here whose post-processor adds a BOS to plain text (as Llama's, Mistral's and
SmolLM2's do), so a template that writes its own BOS must not get a second one. Also: templates
read from `chat_template.jinja` and from a list of named templates, and the EOS list of
`generation_config.json`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from cluster.model.arch import ModelFormatError
from cluster.model.tokenizer import Tokenizer

CHATML = (  # SmolLM2-Instruct's: the BOS is <|im_start|>, which the post-processor also adds
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
QWEN2 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}"
)
TEMPLATES = {  # name: (template, bos, eos, special tokens)
    "chatml": (CHATML, "<|im_start|>", "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    "llama3": (
        LLAMA3,
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    ),
    "qwen2": (QWEN2, None, "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    "mistral": (MISTRAL, "<s>", "</s>", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]),
}
CORPUS = [
    "You are a helpful assistant. What is the capital of France? The capital of France is Paris.",
    "Write a haiku about the sea, and then explain it line by line in plain words.",
    "def add(a, b):\n    return a + b\n",
] * 20
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You write short answers."},
        {"role": "user", "content": "Name a sea."},
        {"role": "assistant", "content": "The North Sea."},
        {"role": "user", "content": "Another one, please  ."},
    ],
]


def write_folder(folder: Path, name: str) -> Path:
    template, bos, eos, specials = TEMPLATES[name]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos is not None:  # plain text gets a BOS from the post-processor, as Llama's tokenizers do
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": eos}
    if bos is not None:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_prompt_ids_equal_transformers(tmp_path, name):
    from transformers import AutoTokenizer

    folder = write_folder(tmp_path / name, name)
    ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    bos = TEMPLATES[name][1]
    if bos is not None:
        assert ours.encode("hi")[0] == ours.token_to_id(bos), "plain text gets the post-processor's BOS"
    for chat in CHATS if name != "mistral" else [CHATS[0], CHATS[1][1:]]:
        if name == "mistral" and chat[0]["role"] == "system":
            continue
        expected = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
        got = ours.encode_chat(chat)
        assert got == list(expected), f"{name}: {got[:8]} vs {list(expected)[:8]}"
        if bos is not None:
            assert got[0] == ours.token_to_id(bos) and got[1] != got[0], "exactly one BOS"


def test_the_router_tokenises_chats_through_the_same_path(tmp_path):
    """router/service/validate.py turns a chat request into exactly `encode_chat`'s ids."""
    from tandem.v1 import api_pb2

    from router.service.validate import Limits, validate

    folder = write_folder(tmp_path / "chatml", "chatml")
    tok = Tokenizer(folder)
    chat = api_pb2.ChatPrompt(messages=[api_pb2.ChatMessage(role="user", content="What is the capital of France?")])
    request = api_pb2.GenerateRequest(chat=chat, sampling=api_pb2.SamplingParams(max_tokens=4))
    prompt, _ = validate(request, Limits(2048, tok.vocab_size, 4), tok)
    assert prompt == tok.encode_chat(CHATS[0])
    assert prompt.count(tok.token_to_id("<|im_start|>")) == 3, "system, user, assistant: no extra BOS"


def test_chat_template_jinja_wins_and_named_templates_pick_default(tmp_path):
    folder = write_folder(tmp_path / "jinja", "chatml")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer(folder).apply_chat_template(CHATS[0]) == "[What is the capital of France?]"

    config_path = folder / "tokenizer_config.json"
    (folder / "chat_template.jinja").unlink()
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0]['content'] | upper }}"},
    ]
    config_path.write_text(json.dumps(config))
    assert Tokenizer(folder).apply_chat_template(CHATS[0]) == "WHAT IS THE CAPITAL OF FRANCE?"

    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="name no 'default'"):
        Tokenizer(folder)


def test_tojson_and_globals_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    folder = write_folder(tmp_path / "json", "chatml")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m | tojson }}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
        "{{ eos_token }}{{ strftime_now('%Y') | length }}"
    )
    chat = [{"role": "user", "content": 'é <b> & "q"'}]
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False)
    assert Tokenizer(folder).apply_chat_template(chat) == theirs


def test_generation_config_eos_list_is_honoured(tmp_path):
    folder = write_folder(tmp_path / "eos", "llama3")
    tok = Tokenizer(folder)
    eot, end = tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]}))
    assert set(Tokenizer(folder).eos_token_ids) == {end, eot}
