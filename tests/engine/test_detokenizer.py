"""Streaming text never splits a UTF-8 character and adds up to the full decode."""

from pathlib import Path

from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer

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
