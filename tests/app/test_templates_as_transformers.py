"""A chat template renders as transformers' ``apply_chat_template`` renders it: the model's special tokens, loop
controls, and the ``generation`` block.

Three families' own templates (tests/app/data/chat_templates: Meta-Llama-3-8B-Instruct's, Mistral-7B-Instruct-v0.1's
and Llama-2-7b-chat's, as their tokenizer_config.json carries them) write ``bos_token`` before the conversation or
each turn and ``eos_token`` after each answer. Each is rendered by the gateway's sandbox and by transformers, with a
tokenizer that has the family's special tokens and, as theirs do, adds a BOS when asked to add special tokens: the
texts and the token ids must be the same, with one BOS where the template writes it and an EOS after each answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from app.engine_clients.tokenizer import GatewayTokenizer
from app.tool_calls.templates import ChatTemplate

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CORPUS = ["What is the capital of France?", "Paris is the capital of France.", "Be brief. And Italy? Rome."] * 4

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Italy?"},
]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *CONVERSATION]

# (family, its template's file, its bos and eos, its other special tokens, the conversation its template takes)
FAMILIES = [
    ("llama3", "llama3.jinja", "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    ("mistral", "mistral.jinja", "<s>", "</s>", ["<unk>"]),
    ("llama2", "llama2.jinja", "<s>", "</s>", ["<unk>"]),
]
CONVERSATIONS = {"llama3": WITH_SYSTEM, "mistral": CONVERSATION, "llama2": WITH_SYSTEM}


def _family_tokenizer(bos: str, eos: str, others: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the family's special tokens that, like the family's, adds a BOS by default."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = [bos, eos, *others]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


@pytest.mark.parametrize(("family", "file", "bos", "eos", "others"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_familys_template_renders_and_encodes_as_transformers_does(
    family: str, file: str, bos: str, eos: str, others: list[str]
) -> None:
    source = (TEMPLATES / file).read_text(encoding="utf-8")
    tokenizer = _family_tokenizer(bos, eos, others)
    gateway = GatewayTokenizer(tokenizer)
    messages = CONVERSATIONS[family]

    ours = ChatTemplate(source).render(messages, None, special_tokens=gateway.special_tokens)
    theirs = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, add_generation_prompt=True)
    assert ours == theirs

    ids = gateway.encode_rendered(ours)
    assert ids == _ids(
        tokenizer.apply_chat_template(messages, chat_template=source, tokenize=True, add_generation_prompt=True)
    )
    bos_id, eos_id = tokenizer.convert_tokens_to_ids([bos, eos])
    assert ids[0] == bos_id
    num_answers = sum(message["role"] == "assistant" for message in messages)
    if family == "llama3":  # one BOS; each turn, the system's and the user's too, ends with <|eot_id|>
        assert (ids.count(bos_id), ids.count(eos_id)) == (1, len(messages))
    elif family == "mistral":  # one BOS; each answer ends with EOS
        assert (ids.count(bos_id), ids.count(eos_id)) == (1, num_answers)
    else:  # each [INST] opens with a BOS; each answer ends with EOS
        assert (ids.count(bos_id), ids.count(eos_id)) == (num_answers + 1, num_answers)


def test_loop_controls_and_generation_blocks_render_as_transformers_does() -> None:
    source = (
        "{{ bos_token }}{% for message in messages %}{% if message.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}{% if message.role == 'assistant' %}{% generation %}"
        "{{ message.content + eos_token }}{% endgeneration %}{% else %}{{ message.role }}: {{ message.content }}\n"
        "{% endif %}{% endfor %}"
    )
    tokenizer = _family_tokenizer("<s>", "</s>", [])
    ours = ChatTemplate(source).render(WITH_SYSTEM, None, special_tokens=GatewayTokenizer(tokenizer).special_tokens)
    theirs = tokenizer.apply_chat_template(
        WITH_SYSTEM, chat_template=source, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs == "<s>user: What is the capital of France?\nParis.</s>"
