"""Token ids to text, one token at a time, never splitting a UTF-8 character or leaking a stop string."""

import codecs
from collections.abc import Callable
from functools import partial
from weakref import WeakKeyDictionary

from transformers import PreTrainedTokenizerBase

from engine.output.token_bytes import SkippedSpecialBytes, skipped_special_bytes

# Prompt tokens decoded with the first output tokens, so a word-initial space renders as the model meant.
NUM_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for a byte sequence that is not complete yet
# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens: text that still ends in an incomplete
# character after this many tokens holds invalid bytes, which then show as U+FFFD instead of being waited for
# (each push decodes the tokens it waits for again, so a stream of invalid bytes would cost ever more).
MAX_PENDING_TOKENS = 4


def decoder_of(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` as one callable. For a fast tokenizer that cleans up no
    spaces (transformers then adds nothing to the Rust tokenizer's result) it is the Rust tokenizer's own
    ``decode``, which skips transformers' conversion of its arguments on each of a token's two calls."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)


def byte_table_of(tokenizer: PreTrainedTokenizerBase) -> SkippedSpecialBytes | None:
    """The tokenizer's table of its tokens' bytes, one for the tokenizer's life; None unless it is byte-level BPE."""
    if tokenizer not in _BYTE_TABLES:
        _BYTE_TABLES[tokenizer] = skipped_special_bytes(tokenizer)
    return _BYTE_TABLES[tokenizer]


# Each tokenizer's bytes of its tokens as decoded so far (None for a tokenizer that is not byte-level BPE).
_BYTE_TABLES: "WeakKeyDictionary[PreTrainedTokenizerBase, SkippedSpecialBytes | None]" = WeakKeyDictionary()


# Each tokenizer's text of single tokens, as decoded so far (at most one entry per token of its vocabulary): a
# push decodes the token before the new one alone, which is most often one token, and its text never changes.
_ONE_TOKEN_TEXTS: "WeakKeyDictionary[PreTrainedTokenizerBase, dict[int, str]]" = WeakKeyDictionary()


def _one_token_texts(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    texts = _ONE_TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = _ONE_TOKEN_TEXTS.setdefault(tokenizer, {})
    return texts


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    A byte-level BPE tokenizer's tokens (GPT-2's, Llama 3's, SmolLM2's, Qwen2's) stand for bytes: each push
    hands the token's bytes (``SkippedSpecialBytes``) to an incremental UTF-8 decoder, which gives the
    characters they complete and keeps the bytes of one it has not seen whole (an invalid sequence becomes
    U+FFFD at once), so ``text`` is always the tokenizer's decode of the output. Another tokenizer decodes a
    window: each push decodes only the tokens since the last clean boundary (``prefix_offset``) and hands out
    the part past the previous read; a delta that ends in an incomplete UTF-8 sequence waits for the next
    token. With stop strings, the last ``max(len(stop)) - 1`` characters are held back until it is clear they
    do not start a stop string, so a streamed client never sees part of one.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
    ) -> None:
        table = byte_table_of(tokenizer)
        self._bytes_of = None if table is None else table.__getitem__
        self._utf8 = None if table is None else codecs.getincrementaldecoder("utf-8")("replace")
        self._decode = decoder_of(tokenizer)
        self._one_token_texts = _one_token_texts(tokenizer)
        self._ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._num_emitted = 0
        self._prefix: tuple[int, int, str] | None = None  # (prefix_offset, read_offset, the tokens' text between)
        self.text = ""
        self.stopped = False

    def push(self, token_id: int, is_stop_token: bool = False) -> str:
        """Take one generated token; return the text that is now safe to show."""
        if self.stopped or is_stop_token:
            return ""
        new = self._utf8.decode(self._bytes_of(token_id)) if self._utf8 is not None else self._window_text(token_id)
        return self._add(new) if new else ""

    def _window_text(self, token_id: int) -> str:
        """The text ``token_id`` completes, from the window of tokens since the last clean boundary."""
        self._ids.append(token_id)
        prefix = self._decode_prefix()
        full = self._decode(self._ids[self._prefix_offset :])
        incomplete = full.endswith(REPLACEMENT_CHAR) and len(self._ids) - self._read_offset < MAX_PENDING_TOKENS
        if len(full) <= len(prefix) or incomplete:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _add(self, new: str) -> str:
        """Append ``new`` to the text; what is now safe to show (all of it up to a stop string, once one is found)."""
        if not self._stop:  # nothing held back: everything before ``new`` was shown
            self._append_text(new)
            self._num_emitted = len(self.text)
            return new
        search_from = max(0, len(self.text) - self._hold)
        self._append_text(new)
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self.flush()
        return self._release(len(self.text) - self._hold)

    def _append_text(self, new: str) -> None:
        """``self.text += new``, in place when nothing else holds the text: CPython grows a string in place only
        when its one reference is a local variable, and an attribute's ``+=`` copies the whole text every token."""
        text, self.text = self.text, ""
        text += new
        self.text = text

    def _decode_prefix(self) -> str:
        """The text of the tokens up to the last read: from the tokenizer's texts of single tokens when it is one,
        else decoded once for as long as the offsets stay (the pushes that wait for a character's bytes)."""
        start, end = self._prefix_offset, self._read_offset
        if end - start != 1:
            if self._prefix is None or self._prefix[0] != start or self._prefix[1] != end:
                self._prefix = (start, end, self._decode(self._ids[start:end]))
            return self._prefix[2]
        token_id = self._ids[start]
        text = self._one_token_texts.get(token_id)
        if text is None:
            text = self._one_token_texts[token_id] = self._decode([token_id])
        return text

    def flush(self) -> str:
        """Everything not handed out yet (call once the sequence has finished): the bytes of a character never
        completed show as U+FFFD, as the tokenizer's decode shows them."""
        if self._utf8 is not None and not self.stopped:
            tail = self._utf8.decode(b"", final=True)
            if tail:
                return self._add(tail) + self._release(len(self.text))
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted : upto]
        self._num_emitted = upto
        return delta
