"""The registry of tool-call formats: how a model spells a call, and the structural tag that constrains it.

Each format names its spelling twice: canonically (the strings the structural tag makes the model write)
and leniently (the regexes the parser reads calls with, whitespace allowed wherever JSON allows it, so
the same parser reads unconstrained output too). The formats:

- ``hermes`` (Hermes, Qwen 2.5, the default model's shipped template):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one tag per call, text around them.
- ``llama3_json`` (Llama 3.1/3.2): ``{"name": "f", "parameters": {...}}``, one object per call.
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, all calls in one list.
- ``pythonic`` (Llama 3.2/4 pythonic): ``[f(a=1, b="x"), g()]``, all calls in one list of Python calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from app.settings_defaults import DEFAULT_TOOL_CALL_FORMAT
from app.tool_calls.pythonic_grammar import arguments_grammar
from engine.sampling.grammar import MAX_JSON_WHITESPACE

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_NAME = r"(?P<name>[a-zA-Z0-9_-]{1,64})"


class ToolCallFormatError(ValueError):
    """A tool-call format name that is not in the registry; says which are."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function a request offers: its name and the JSON schema of its arguments object."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One way of writing tool calls.

    A *grouped* format writes all its calls in one list (``group_begin``, calls joined by ``separator``,
    ``group_end``); an ungrouped one opens each call with ``trigger`` wherever it likes in its text.
    """

    name: str
    trigger: str  # the text that opens calls; free text cannot contain it
    call_begin: str  # canonical text before a function's name
    arguments_begin: str  # canonical text between the name and the arguments
    call_end: str  # canonical text after the arguments
    group_begin: str = ""  # canonical text before a grouped format's calls (starts with ``trigger``)
    separator: str = ""  # canonical text between two calls of a group
    group_end: str = ""
    arguments_style: Literal["json", "python"] = "json"
    # Lenient spellings for the parser: a call's opening up to its arguments (the name in group ``name``),
    # a group's opening, the text closing a call after its arguments, between two calls, and closing a group.
    call_opening: str = ""
    group_opening: str = ""
    call_closing: str = ""
    separator_pattern: str = r"\s*,\s*"
    group_closing: str = r"\s*\]"

    @property
    def is_grouped(self) -> bool:
        return bool(self.group_begin)

    def structural_tag(self, tools: list[ToolSpec], *, parallel: bool) -> dict[str, Any]:
        """xgrammar's structural tag for ``auto``: free text until ``trigger``, then well-formed calls of ``tools``.

        With ``parallel`` false at most one call is made, and nothing follows it.
        """
        calls = [
            {
                "type": "tag",
                "begin": self.call_begin + tool.name + self.arguments_begin,
                "content": self._arguments_content(tool),
                "end": self.call_end,
            }
            for tool in tools
        ]
        if not self.is_grouped:
            tags = calls
        else:
            listed = {
                "type": "tags_with_separator",
                "tags": calls,
                "separator": self.separator,
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
            tags = [{"type": "tag", "begin": self.group_begin, "content": listed, "end": self.group_end}]
        triggered = {
            "type": "triggered_tags",
            "triggers": [self.trigger],
            "tags": tags,
            "stop_after_first": self.is_grouped or not parallel,
        }
        return {"type": "structural_tag", "format": triggered}

    def _arguments_content(self, tool: ToolSpec) -> dict[str, Any]:
        if self.arguments_style == "python":
            return {"type": "grammar", "grammar": arguments_grammar(tool.parameters)}
        return {"type": "json_schema", "json_schema": tool.parameters, "max_whitespace_cnt": MAX_JSON_WHITESPACE}

    def structural_tag_text(self, tools: list[ToolSpec], *, parallel: bool) -> str:
        """The structural tag as compact JSON (the grammar cache's key)."""
        return json.dumps(self.structural_tag(tools, parallel=parallel), separators=(",", ":"))

    def compiled_patterns(self) -> tuple[re.Pattern[str], ...]:
        """The parser's regexes, compiled: group opening, call opening, call closing, separator, group closing.

        A call may open after whitespace: a separator's trailing whitespace can arrive after the separator.
        """
        return tuple(
            re.compile(pattern, re.DOTALL)
            for pattern in (
                self.group_opening,
                r"\s*" + self.call_opening,
                self.call_closing,
                self.separator_pattern,
                self.group_closing,
            )
        )


def _json_call_opening(arguments_key: str) -> str:
    return r'\{\s*"name"\s*:\s*"' + _NAME + r'"\s*,\s*"' + arguments_key + r'"\s*:\s*'


HERMES = ToolCallFormat(
    name="hermes",
    trigger="<tool_call>",
    call_begin='<tool_call>\n{"name": "',
    arguments_begin='", "arguments": ',
    call_end="}\n</tool_call>",
    call_opening=r"<tool_call>\s*" + _json_call_opening("arguments"),
    call_closing=r"\s*\}\s*</tool_call>",
)
LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    trigger='{"name": ',
    call_begin='{"name": "',
    arguments_begin='", "parameters": ',
    call_end="}",
    call_opening=_json_call_opening("parameters"),
    call_closing=r"\s*\}",
)
MISTRAL = ToolCallFormat(
    name="mistral",
    trigger="[TOOL_CALLS]",
    group_begin="[TOOL_CALLS][",
    call_begin='{"name": "',
    arguments_begin='", "arguments": ',
    call_end="}",
    separator=", ",
    group_end="]",
    group_opening=r"\[TOOL_CALLS\]\s*\[\s*",
    call_opening=_json_call_opening("arguments"),
    call_closing=r"\s*\}",
)
PYTHONIC = ToolCallFormat(
    name="pythonic",
    trigger="[",
    group_begin="[",
    call_begin="",
    arguments_begin="(",
    call_end=")",
    separator=", ",
    group_end="]",
    arguments_style="python",
    group_opening=r"\[\s*",
    call_opening=_NAME + r"\(",
    call_closing=r"\)",
)

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC)}
DEFAULT_FORMAT = DEFAULT_TOOL_CALL_FORMAT  # the setting's default names the format it takes


def get_format(name: str) -> ToolCallFormat:
    """The registered format called ``name``; ToolCallFormatError naming the known ones otherwise."""
    found = FORMATS.get(name)
    if found is None:
        known = ", ".join(sorted(FORMATS))
        raise ToolCallFormatError(f"unknown tool-call format {name!r}; the formats are: {known}")
    return found
