"""Reading a model's text into text and tool calls as it is generated, one delta at a time.

:class:`StreamingParser` is fed each delta of text and returns what it now knows: text outside calls
(:class:`TextPart`), a call that opened (:class:`CallStarted`: its index and function name), fragments of
its arguments as they are written (:class:`CallArguments`), and a call that closed (:class:`CallEnded`,
with its whole arguments). Text that might be the start of a call (``<tool`` on the way to
``<tool_call>``) is held back until it is clearly text or clearly a call.

JSON arguments stream as written. Pythonic ones (``f(a=1)``) are converted to JSON when their call
closes, so they arrive as one fragment. Text that opens a call and then breaks the format (possible only
in unconstrained output) ends the parse: the rest is kept in :attr:`StreamingParser.broken_text`.
"""

from __future__ import annotations

import ast
import enum
import json
from dataclasses import dataclass

import regex

from app.tool_calls.formats import ToolCallFormat


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class CallEnded:
    index: int
    name: str
    arguments: str


Event = TextPart | CallStarted | CallArguments | CallEnded


class _State(enum.Enum):
    TEXT = "text"  # free text; looking for the trigger
    GROUP_OPENING = "group_opening"  # a grouped format's trigger seen; reading up to its first call
    CALL_OPENING = "call_opening"  # reading a call's opening up to its arguments
    ARGUMENTS = "arguments"  # inside a call's arguments
    CALL_CLOSING = "call_closing"  # arguments done; reading the call's closing text
    BETWEEN_CALLS = "between_calls"  # a grouped format: a separator or the group's end comes next
    DONE = "done"  # a grouped format's list is closed: nothing more is read
    BROKEN = "broken"  # the text broke the format inside a call


class StreamingParser:
    """One choice's text, read incrementally in one format."""

    def __init__(self, tool_format: ToolCallFormat) -> None:
        self.format = tool_format
        patterns = tool_format.compiled_patterns()
        self._group_opening, self._call_opening, self._call_closing, self._separator, self._group_closing = (
            regex.compile(p.pattern, regex.DOTALL) for p in patterns
        )
        self._state = _State.TEXT
        self._pending = ""  # text received and not yet turned into events
        self._arguments = _ArgumentsScanner(tool_format.arguments_style)
        self._name = ""
        self.num_calls = 0  # calls started so far
        self.broken_text = ""

    @property
    def in_call(self) -> bool:
        """True while a call is open (started, or its opening begun) and not yet closed."""
        return self._state not in (_State.TEXT, _State.DONE, _State.BROKEN, _State.BETWEEN_CALLS)

    @property
    def is_broken(self) -> bool:
        return self._state is _State.BROKEN

    def feed(self, text: str) -> list[Event]:
        """The events ``text`` (the next delta) completes."""
        self._pending += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The events left when the text has ended: held-back text that turned out to be text."""
        if self._state in (_State.TEXT, _State.DONE) and self._pending.strip():
            text, self._pending = self._pending, ""
            return [TextPart(text)]
        if self._state is _State.BETWEEN_CALLS or self.in_call:
            self.broken_text, self._pending = self._pending, ""
        return []

    def _step(self, events: list[Event]) -> bool:
        """Move as far as the pending text allows; True when it moved (call again)."""
        match self._state:
            case _State.TEXT:
                return self._read_text(events)
            case _State.GROUP_OPENING:
                return self._expect(self._group_opening, _State.CALL_OPENING)
            case _State.CALL_OPENING:
                return self._read_call_opening(events)
            case _State.ARGUMENTS:
                return self._read_arguments(events)
            case _State.CALL_CLOSING:
                return self._read_call_closing(events)
            case _State.BETWEEN_CALLS:
                return self._read_between_calls()
            case _:
                return False

    def _read_text(self, events: list[Event]) -> bool:
        trigger = self.format.trigger
        at = self._pending.find(trigger)
        if at < 0:
            keep = _longest_prefix_suffix(self._pending, trigger)
            cut = len(self._pending) - keep
            if cut:
                events.append(TextPart(self._pending[:cut]))
                self._pending = self._pending[cut:]
            return False
        if at:
            events.append(TextPart(self._pending[:at]))
        self._pending = self._pending[at:]
        self._state = _State.GROUP_OPENING if self.format.is_grouped else _State.CALL_OPENING
        return True

    def _expect(self, pattern: regex.Pattern[str], then: _State) -> bool:
        """Consume ``pattern`` at the start of the pending text and go to ``then``; wait while it may still come."""
        found = pattern.match(self._pending, partial=True)
        if found is None:
            self._break()
            return False
        if found.partial:
            return False
        self._pending = self._pending[found.end() :]
        self._state = then
        return True

    def _read_between_calls(self) -> bool:
        """A separator (another call comes) or the group's end; wait while either may still come."""
        found = [p.match(self._pending, partial=True) for p in (self._separator, self._group_closing)]
        if all(match is None for match in found):
            self._break()
            return False
        for match, then in zip(found, (_State.CALL_OPENING, _State.DONE), strict=True):
            if match is not None and not match.partial:
                self._pending = self._pending[match.end() :]
                self._state = then
                return True
        return False

    def _read_call_opening(self, events: list[Event]) -> bool:
        found = self._call_opening.match(self._pending, partial=True)
        if found is None:
            self._break()
            return False
        if found.partial:
            return False
        self._name = found.group("name")
        self._pending = self._pending[found.end() :]
        events.append(CallStarted(self.num_calls, self._name))
        self.num_calls += 1
        self._arguments = _ArgumentsScanner(self.format.arguments_style)
        self._state = _State.ARGUMENTS
        return True

    def _read_arguments(self, events: list[Event]) -> bool:
        if not self._arguments.text and self.format.arguments_style == "json":
            self._pending = self._pending.lstrip()  # the space before the object is the format's, not the arguments'
        consumed, complete = self._arguments.scan(self._pending)
        if self._arguments.failed:
            self._break()
            return False
        index = self.num_calls - 1
        if consumed and self.format.arguments_style == "json":
            events.append(CallArguments(index, self._pending[:consumed]))
        self._pending = self._pending[consumed:]
        if not complete:
            return False
        if self.format.arguments_style == "python":
            converted = _python_arguments_as_json(self._arguments.text)
            if converted is None:
                self._break()
                return False
            self._arguments.text = converted
            events.append(CallArguments(index, converted))
        self._state = _State.CALL_CLOSING
        return True

    def _read_call_closing(self, events: list[Event]) -> bool:
        then = _State.BETWEEN_CALLS if self.format.is_grouped else _State.TEXT
        if not self._expect(self._call_closing, then):
            return False
        events.append(CallEnded(self.num_calls - 1, self._name, self._arguments.text.strip()))
        return True

    def _break(self) -> None:
        self.broken_text, self._pending = self._pending, ""
        self._state = _State.BROKEN


class _ArgumentsScanner:
    """Finds where a call's arguments end: a JSON object's closing brace, or a Python call's closing parenthesis.

    Tracks brackets and strings only; whether the text is valid JSON (or Python) is checked when it is
    parsed. ``text`` accumulates everything scanned.
    """

    def __init__(self, style: str) -> None:
        self.style = style
        self.text = ""
        self._depth = 0
        self._quote = ""  # the open string's quote character, or "" outside strings
        self._escaped = False
        self._started = style == "python"  # a Python argument list is open from its first character
        self.failed = False

    def scan(self, text: str) -> tuple[int, bool]:
        """How many characters of ``text`` belong to the arguments, and whether they are complete."""
        for i, char in enumerate(text):
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = ""
                continue
            if not self._started:
                if char.isspace():
                    continue
                if char != "{":
                    self.failed = True
                    return i, False
                self._started = True
            if char == '"' or (char == "'" and self.style == "python"):
                self._quote = char
            elif char in "{[(":
                self._depth += 1
            elif char in "}])":
                if self._depth == 0:  # a Python argument list's closing parenthesis: not part of the arguments
                    self.text += text[:i]
                    return i, True
                self._depth -= 1
                if self._depth == 0 and self.style == "json":
                    self.text += text[: i + 1]
                    return i + 1, True
        self.text += text
        return len(text), False


def _python_arguments_as_json(arguments: str) -> str | None:
    """``a=1, from="x"`` as ``{"a": 1, "from": "x"}``; None when it is not keyword arguments of Python literals.

    A key is read up to its ``=``, so a property named by a Python keyword or by no identifier (``first-name``)
    reads as the grammar writes it (app/tool_calls/pythonic_grammar.py); a key given twice is no call.
    """
    pairs = _keyword_arguments(arguments.strip())
    if pairs is None:
        return None
    values: dict[str, object] = {}
    for key, value_text in pairs:
        if key is None or key in values:
            return None
        try:
            values[key] = ast.literal_eval(value_text)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None
    try:
        return json.dumps(values)
    except (TypeError, ValueError):  # a set, bytes or complex number: no JSON for it
        return None


def _keyword_arguments(text: str) -> list[tuple[str | None, str]] | None:
    """``text`` split into (key, value's text) at the commas outside strings and brackets; [] for no text."""
    pairs: list[tuple[str | None, str]] = []
    start, depth, quote, escaped = 0, 0, "", False
    for i, char in enumerate(f"{text},"):
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            key, equals, value = text[start:i].partition("=")
            pairs.append((key.strip() or None, value) if equals else (None, value))
            start = i + 1
    if not text:
        return []
    return pairs if not quote and depth == 0 else None


def _longest_prefix_suffix(text: str, trigger: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``trigger``."""
    for size in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-size:]):
            return size
    return 0
