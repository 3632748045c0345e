"""Streaming text never splits a UTF-8 character and adds up to the full decode.

Two kinds of tokenizer, two paths: byte-level BPE (the tiny and the default model's) through the table of token
bytes and an incremental UTF-8 decoder; SentencePiece with byte fallback (Llama 2's, Mistral's kind, built here)
through the window of tokens decoded by the tokenizer.
"""

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.output.detokenizer import (
    MAX_PENDING_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    byte_table_of,
    decoder_of,
)

TEXT = "Bonjour, ça va? 世界 🌍 héllo naïve café, and plain words too."
WORDS = ("▁Bonjour,", "▁ça", "▁va?", "▁héllo", "▁café,", "▁and", "▁plain", "▁words", "▁too.", "▁")


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: words with the ▁ mark, the 256 byte tokens <0x00>..<0xFF> for what is not a word,
    and the decoder Llama 2's tokenizer.json has (▁ to a space, bytes fused, one leading space stripped)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    vocab |= {word: 259 + index for index, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def sentencepiece_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``text`` as ids of that tokenizer: its words where they are words, byte tokens for the rest."""
    vocab = tokenizer.get_vocab()
    ids = []
    for index, word in enumerate(text.split(" ")):
        piece = "▁" + word if index or word else word
        if piece in vocab:
            ids.append(vocab[piece])
            continue
        if index:
            ids.append(vocab["▁"])
        ids += [vocab[f"<0x{byte:02X}>"] for byte in word.encode()]
    return ids


@pytest.fixture(params=["byte-level", "sentencepiece"])
def tokenizer_and_ids(
    request: pytest.FixtureRequest, tiny_llama: Path
) -> tuple[PreTrainedTokenizerBase, list[int], str]:
    """A tokenizer, TEXT as its ids, and the text those ids stream as after a prompt: SentencePiece's first word
    keeps its space there (the decode of the ids alone strips it)."""
    if request.param == "byte-level":
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        assert byte_table_of(tokenizer) is not None
        return tokenizer, tokenizer.encode(TEXT), TEXT
    tokenizer = sentencepiece_tokenizer()
    assert byte_table_of(tokenizer) is None
    return tokenizer, sentencepiece_ids(tokenizer, TEXT), " " + TEXT


def test_deltas_add_up_and_never_hold_a_partial_character(tokenizer_and_ids) -> None:
    tokenizer, ids, streamed = tokenizer_and_ids
    assert tokenizer.decode(ids) == TEXT
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text should have multi-token characters"
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5, 6])
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == streamed == detok.text


def test_stop_string_spanning_tokens_is_held_back(tokenizer_and_ids) -> None:
    tokenizer, ids, streamed = tokenizer_and_ids
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5], stop=("🌍 hé",))
    out = ""
    for token_id in ids:
        out += detok.push(token_id)
        assert "🌍" not in out
        if detok.stopped:
            break
    assert detok.stopped
    assert out == streamed[: streamed.index("🌍")]


def test_the_byte_table_decodes_as_the_tokenizer(tiny_llama: Path, base_folder: Path) -> None:
    """The table of token bytes (the tiny and the default vocabulary) gives what transformers' decode gives: every
    single token, and random ids with special tokens among them, as a whole and pushed one at a time, also runs of
    one-byte tokens that split characters or are no UTF-8 at all (then U+FFFD, as the decode shows them)."""
    rng = random.Random(3)
    for folder in (tiny_llama, base_folder):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        table = byte_table_of(tokenizer)

        def expected(ids: list[int], tokenizer=tokenizer) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        def text_of(ids: list[int], table=table) -> str:
            return b"".join(table[i] for i in ids).decode("utf-8", "replace")

        assert all(text_of([i]) == expected([i]) for i in range(len(tokenizer)))
        one_byte = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i) or "") == 1]
        for _ in range(300):
            for ids in (
                [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))],
                [rng.choice(one_byte) for _ in range(rng.randint(1, 12))],
            ):
                assert text_of(ids) == expected(ids), ids
                detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5])
                streamed = "".join(detok.push(i) for i in ids) + detok.flush()
                assert streamed == detok.text == expected(ids), ids


def test_another_fast_tokenizer_decodes_through_the_rust_tokenizer() -> None:
    """A fast tokenizer that is not byte-level BPE decodes its window with the Rust tokenizer's own decode, which
    gives what transformers' decode gives."""
    tokenizer = sentencepiece_tokenizer()
    decode = decoder_of(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_invalid_bytes_show_as_replacement_characters_instead_of_waiting_forever(tokenizer_and_ids) -> None:
    """A UTF-8 continuation byte alone is no character and never becomes one: after at most four such tokens
    the text shows U+FFFD and the window path stops decoding them again on every push."""
    tokenizer, _, _ = tokenizer_and_ids
    continuation = next(i for i in range(len(tokenizer)) if tokenizer.decode([i] * 8) == REPLACEMENT_CHAR * 8)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5])
    deltas = [detok.push(continuation) for _ in range(100)]
    assert "".join(deltas) + detok.flush() == detok.text
    assert len(detok.text) >= 96 and set(detok.text) == {REPLACEMENT_CHAR}
    assert len(detok._ids) - detok._prefix_offset <= 2 * MAX_PENDING_TOKENS  # the decoded window stays short
