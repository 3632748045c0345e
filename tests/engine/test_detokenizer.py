"""Streaming text never splits a UTF-8 character and adds up to the full decode."""

import random
from pathlib import Path

from transformers import AutoTokenizer

from engine.detokenizer import MAX_PENDING_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer, decoder_of

TEXT = "Bonjour, ça va? 世界 🌍 héllo naïve café, and plain words too."


def test_deltas_add_up_and_never_hold_a_partial_character(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT) // 4
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text should have multi-token characters"
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5, 6])
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text


def test_stop_string_spanning_tokens_is_held_back(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5], stop=("🌍 hé",))
    out = ""
    for token_id in tokenizer.encode(TEXT):
        out += detok.push(token_id)
        assert "🌍" not in out
        if detok.stopped:
            break
    assert detok.stopped
    assert out == "Bonjour, ça va? 世界 "


def test_the_fast_decoder_equals_the_tokenizers_decode(base_folder: Path) -> None:
    """The Rust tokenizer's own decode, taken where transformers would add nothing to it, gives what
    transformers' decode gives: on random ids (special tokens among them) of the tiny and the default model."""
    rng = random.Random(3)
    for folder in (base_folder,):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        decode = decoder_of(tokenizer)
        assert decode.func == tokenizer.backend_tokenizer.decode  # the fast path is the one under test
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_invalid_bytes_show_as_replacement_characters_instead_of_waiting_forever(tiny_llama: Path) -> None:
    """A UTF-8 continuation byte alone is no character and never becomes one: after at most four such tokens
    the text shows U+FFFD and the detokenizer stops decoding them again on every push."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    continuation = next(i for i in range(len(tokenizer)) if tokenizer.decode([i] * 8) == REPLACEMENT_CHAR * 8)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5])
    deltas = [detok.push(continuation) for _ in range(100)]
    assert "".join(deltas) + detok.flush() == detok.text
    assert len(detok.text) >= 96 and set(detok.text) == {REPLACEMENT_CHAR}
    assert len(detok._ids) - detok._prefix_offset <= 2 * MAX_PENDING_TOKENS  # the decoded window stays short
