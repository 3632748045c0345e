"""The model's tokenizer on the gateway's side: prompts to token ids, ids to text, a token's bytes (logprobs).

Every engine client tokenizes in the gateway's process, wherever its engine runs: an engine in a process of
its own (or on another machine) is sent token ids and never sees a text prompt. A chat's messages never
become special tokens (app/engine_clients/special_text.py); a completion's prompt is the client's whole text,
its special tokens parsed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.engine_clients.special_text import NO_MARKERS, MarkedChat, Markers, SpecialText
from engine.output.token_bytes import TokenBytes


class GatewayTokenizer:
    """Encodes prompts and chats the way the engine's model expects them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, token_bytes: TokenBytes | None = None) -> None:
        self.tokenizer = tokenizer
        self._token_bytes = token_bytes or TokenBytes(tokenizer)
        self.special_tokens: dict[str, str] = dict(tokenizer.special_tokens_map)
        """The named special tokens (``bos_token``, ``eos_token``, ...) as a chat template sees them."""
        self.special_text = SpecialText(tokenizer)

    @classmethod
    def load(cls, model_folder: str | Path) -> GatewayTokenizer:
        """The tokenizer of a Hugging Face model folder (as the engine loads it)."""
        return cls(AutoTokenizer.from_pretrained(model_folder))

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completion's prompt: the client's whole text, its special tokens parsed and the BOS added."""
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """A chat rendered by the tokenizer's own template; no text of the messages becomes a special token."""
        marked = self.special_text.mark(list(messages), None, _template_source(self.tokenizer))
        text = self.tokenizer.apply_chat_template(marked.messages, tokenize=False, add_generation_prompt=True)
        return self.special_text.encode(text, marked.markers)

    def mark_special_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_source: str
    ) -> MarkedChat:
        """A chat to render, each special token's text in its strings a marker that ``encode_rendered`` reads."""
        return self.special_text.mark(messages, tools, template_source)

    def encode_rendered(self, text: str, markers: Markers = NO_MARKERS) -> list[int]:
        """A prompt a chat template rendered: it wrote the special tokens itself, so none is added.

        ``markers``: those of the chat it rendered, each encoded as its special token's text in ordinary tokens.
        """
        return self.special_text.encode(text, markers)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes.bytes_of(token_id)

    def max_prompt_chars(self, max_model_len: int) -> int:
        """Longest text that could fit in ``max_model_len`` tokens; a longer prompt is refused without tokenizing it."""
        return max_model_len * longest_token_chars(self.tokenizer)


def _template_source(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text of the tokenizer's chat template (of all of them, when it names several)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return "".join(template.values())
    return template or ""


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters of text one token can stand for, so a text over ``max_model_len`` times it cannot fit.

    A vocabulary entry is at least as long as the text it stands for: byte-level BPE writes one character
    per byte (and a character is at least one byte), SentencePiece one per character (its byte-fallback
    entries, ``<0x0A>``, are longer than their byte).
    """
    return max(len(token) for token in tokenizer.get_vocab())


class TokenizingClient:
    """The tokenizer half of an engine client: every method the EngineClient protocol tokenizes with.

    A client sets ``_tokenizer`` when it starts; before that these raise.
    """

    _tokenizer: GatewayTokenizer | None

    @property
    def tokenizer(self) -> GatewayTokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the engine client is not started")
        return self._tokenizer

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode_prompt(prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def mark_special_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_source: str
    ) -> MarkedChat:
        return self.tokenizer.mark_special_text(messages, tools, template_source)

    def encode_rendered(self, text: str, markers: Markers = NO_MARKERS) -> list[int]:
        return self.tokenizer.encode_rendered(text, markers)

    def special_tokens(self) -> dict[str, str]:
        return self.tokenizer.special_tokens

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)
