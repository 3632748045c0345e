"""The raw bytes each vocabulary entry stands for, so logprobs can name tokens that split a UTF-8 character."""

import functools

from tokenizers import Tokenizer, decoders
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


class SkippedSpecialBytes(dict[int, bytes]):
    """A byte-level BPE tokenizer's ``decode(ids, skip_special_tokens=True)`` as bytes: ``self[token_id]`` is what
    the token adds (b"" for a special token), filled as tokens are met.

    The Rust tokenizer's byte-level decoder turns each token into the bytes its characters stand for (a token with
    a character outside that alphabet, an added token's text, stays its own UTF-8) and the whole into text with
    each invalid sequence replaced, so ``b"".join(self[i] for i in ids).decode("utf-8", "replace")`` is its decode
    of ``ids``, in one Python-level join instead of a call into the tokenizer.
    """

    def __init__(self, backend: Tokenizer) -> None:
        super().__init__()
        self._backend = backend
        self._special_ids = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)

    def __missing__(self, token_id: int) -> bytes:
        piece = None if token_id in self._special_ids else self._backend.id_to_token(token_id)
        if piece is None:  # a special token, or an id outside the vocabulary: the decode skips it
            value = b""
        else:
            decoder = _byte_level_decoder()
            value = bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode()
        self[token_id] = value
        return value


def skipped_special_bytes(tokenizer: PreTrainedTokenizerBase) -> SkippedSpecialBytes | None:
    """The table of a fast tokenizer whose decode is byte-level BPE alone (no clean-up of spaces); None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return SkippedSpecialBytes(backend) if isinstance(backend.decoder, decoders.ByteLevel) else None
