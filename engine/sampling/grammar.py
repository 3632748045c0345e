"""Structured output: what a request's text must match, compiled once per distinct constraint by xgrammar.

A :class:`GrammarConstraint` travels in :class:`~engine.sampling.sampling_params.SamplingParams`; the engine's
:class:`GrammarCompiler` turns it into an xgrammar ``CompiledGrammar`` (cached by the constraint: a
repeated schema costs a dictionary lookup), and each constrained sequence gets a :class:`GrammarState`
(an xgrammar matcher) that is advanced with every token the sequence takes. The per-step token mask
built from those states is in ``engine/sampling/grammar_mask.py``.

JSON may hold whitespace where JSON allows it, as models write it (``{\n  "name": ...``), in runs of at
most ``MAX_JSON_WHITESPACE`` characters: a grammar with no whitespace at all leaves a model that wants
to write ``{\n`` only ``{}`` (docs/tools.md measures it), and one with unbounded runs lets a small
model write whitespace until ``max_tokens`` runs out.
"""

from __future__ import annotations

import enum
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import RequestError

if TYPE_CHECKING:
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerBase

MAX_JSON_WHITESPACE = 8  # longest whitespace run in JSON: a newline and an indent of up to seven spaces
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
ANY_OBJECT_SCHEMA = '{"type":"object"}'
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")  # a C++ file:line prefix


class GrammarError(RequestError):
    """A constraint xgrammar cannot compile (an unsupported or malformed schema, a bad regex); says why."""


class GrammarKind(enum.StrEnum):
    """What a constraint constrains to; ``GrammarConstraint.text`` holds its source."""

    JSON_SCHEMA = "json_schema"  # text: the schema's compact JSON, keys in their order (it orders the output's)
    JSON_OBJECT = "json_object"  # any JSON object; text is empty
    REGEX = "regex"  # text: the pattern
    CHOICE = "choice"  # one of ``choices``, exactly
    STRUCTURAL_TAG = "structural_tag"  # text: xgrammar's structural tag as JSON (tool calls in a format)


@dataclass(frozen=True, slots=True)
class GrammarConstraint:
    """What a request's generated text must match; hashable, so it keys the compiled-grammar cache."""

    kind: GrammarKind
    """Which kind of grammar."""

    text: str = ""
    """The source: a schema's compact JSON, or a regex; empty for the other kinds."""

    choices: tuple[str, ...] = ()
    """With ``GrammarKind.CHOICE``: the strings the output may be."""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarConstraint:
        """Output that is JSON valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        # Not sorted: the order of ``properties`` is the order the output writes them in.
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GrammarConstraint:
        """Output that is one JSON object, whatever its keys."""
        return cls(GrammarKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> GrammarConstraint:
        """Output that matches the regular expression ``pattern`` in full."""
        if not pattern:
            raise GrammarError("the regex is empty")
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> GrammarConstraint:
        """Output that is exactly one of ``choices`` (non-empty strings)."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("a choice constraint needs at least one choice, each a non-empty string")
        return cls(GrammarKind.CHOICE, choices=tuple(choices))

    @classmethod
    def structural_tag(cls, tag: dict[str, Any] | str) -> GrammarConstraint:
        """Output that follows an xgrammar structural tag (a dict, or its JSON text)."""
        text = tag if isinstance(tag, str) else json.dumps(tag, separators=(",", ":"))
        return cls(GrammarKind.STRUCTURAL_TAG, text)

    def describe(self) -> str:
        """A short name for logs and errors."""
        return f"{self.kind} constraint"


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe, meant to run off the event loop and the step thread.

    xgrammar's tokenizer tables are made at the first compile, not at engine start, which they would
    slow for engines that never see a constraint (docs/benchmarks.md#engine-constants-and-choices).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[GrammarConstraint, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses so far (each one a real compile)

    def compile(self, constraint: GrammarConstraint) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``constraint``, from the cache if compiled before; GrammarError if invalid."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return compiled
        compiled = self._compile(constraint)
        with self._lock:
            self._cache[constraint] = compiled
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, constraint: GrammarConstraint) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        try:
            match constraint.kind:
                case GrammarKind.JSON_SCHEMA:
                    return compiler.compile_json_schema(
                        constraint.text, strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                    )
                case GrammarKind.JSON_OBJECT:
                    return compiler.compile_json_schema(
                        ANY_OBJECT_SCHEMA, strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                    )
                case GrammarKind.REGEX:
                    return compiler.compile_regex(constraint.text)
                case GrammarKind.CHOICE:
                    # EBNF string literals take JSON's escapes, so json.dumps quotes each choice safely.
                    return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in constraint.choices))
                case GrammarKind.STRUCTURAL_TAG:
                    return compiler.compile_structural_tag(constraint.text)
        except (RuntimeError, ValueError) as error:  # xgrammar raises RuntimeError (its own errors subclass it)
            raise GrammarError(f"the {constraint.describe()} cannot be compiled: {_reason(error)}") from None
        raise AssertionError(f"unknown grammar kind {constraint.kind!r}")

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                # Our own cache keys by constraint; xgrammar's would hold a second copy of each grammar.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


class GrammarState:
    """One sequence's place in its grammar: which tokens may come next, advanced by each token taken."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar

        self.compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def fresh(self) -> GrammarState:
        """A state at the grammar's start, for another choice of the same request."""
        return GrammarState(self.compiled)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Set the bits of the tokens allowed next in ``bitmask[row]`` ([num_rows, ceil(vocab / 32)] int32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; True when the grammar is complete (it took its end-of-sequence token).

        A token the mask did not allow raises GrammarError: the mask and the sampler disagree (a bug).
        """
        if not self._matcher.accept_token(token_id):
            raise GrammarError(f"token {token_id} does not fit the grammar; the mask should have prevented it")
        return self._matcher.is_terminated()

    def try_accept(self, token_id: int) -> bool:
        """Advance by ``token_id`` if the grammar allows it there; False (and no change) otherwise."""
        return not self._matcher.is_terminated() and self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens accepted (proposals that were only looked ahead through)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_complete(self) -> bool:
        return self._matcher.is_terminated()


def _reason(error: RuntimeError) -> str:
    """xgrammar's message without its C++ time, file and line."""
    return _XGRAMMAR_LOCATION.sub("", str(error).strip()).strip()
