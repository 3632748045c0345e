"""The raw bytes each vocabulary entry stands for, so logprobs can name tokens that split a UTF-8 character."""

import functools

from transformers import PreTrainedTokenizerBase


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet backwards: the printable character it writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class TokenBytes:
    """``bytes_of(token_id)``: the UTF-8 bytes a token adds to a text, computed once per token and kept."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self._special_ids = frozenset(tokenizer.all_special_ids)

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        decoder = _byte_level_decoder()
        if token_id not in self._special_ids and all(char in decoder for char in piece):
            return bytes(decoder[char] for char in piece)  # byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen2)
        return self._tokenizer.decode([token_id]).encode()  # SentencePiece and special tokens: their text
