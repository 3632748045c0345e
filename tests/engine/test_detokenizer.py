"""Streaming text never splits a UTF-8 character and adds up to the full decode."""

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.detokenizer import (
    MAX_PENDING_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    _decode_bytes,
    decoder_of,
)

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


def test_the_byte_table_decodes_as_the_tokenizer(tiny_llama: Path, base_folder: Path) -> None:
    """A byte-level BPE tokenizer (the tiny and the default model's) decodes through its table of token bytes, which
    gives what transformers' decode gives: every single token, random ids with special tokens among them, and runs of
    one-byte tokens that split characters or are no UTF-8 at all."""
    rng = random.Random(3)
    for folder in (tiny_llama, base_folder):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        decode = decoder_of(tokenizer)
        assert decode.func is _decode_bytes  # the path under test

        def expected(ids: list[int], tokenizer=tokenizer) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        assert all(decode([i]) == expected([i]) for i in range(len(tokenizer)))
        one_byte = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i) or "") == 1]
        for _ in range(300):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
            assert decode(ids) == expected(ids), ids
            ids = [rng.choice(one_byte) for _ in range(rng.randint(1, 12))]
            assert decode(ids) == expected(ids), ids


def test_another_fast_tokenizer_decodes_through_the_rust_tokenizer() -> None:
    """A fast tokenizer that is not byte-level BPE (here SentencePiece's word boundary marks) calls the Rust
    tokenizer's own decode, which gives what transformers' decode gives."""
    vocab = {"<unk>": 0, "<s>": 1, "\u2581hello": 2, "\u2581world": 3, "lo": 4, "\u2581": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")
    decode = decoder_of(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode
    for ids in ([2, 3], [1, 2, 4, 5, 3], [4], [0, 2]):
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
