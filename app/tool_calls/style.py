"""How chat requests on one model (the base model or an adapter) are rendered and read: templates and format."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from app.tool_calls.formats import ToolCallFormat, get_format
from app.tool_calls.templates import SAMPLE_MESSAGES, SAMPLE_TOOLS, ChatTemplate, ChatTemplateError, check_template

SAMPLE_CALL = "get_weather"  # the function the sample conversation's assistant calls


@dataclass(frozen=True, slots=True)
class ChatStyle:
    """A model's chat template (None: the tokenizer's own), the template for requests with tools, and its format.

    ``tenant_supplied`` marks an adapter's own template: rendered off the event loop, as its cost is unknown.
    """

    template: ChatTemplate | None
    tool_template: ChatTemplate
    tool_format: ToolCallFormat
    tenant_supplied: bool = False


def base_chat_style(template_file: Path | None, tool_format: str) -> ChatStyle:
    """The base model's style: its own template, and ``template_file`` (or the shipped one) for tools.

    ChatTemplateError or ToolCallFormatError (each saying what is wrong) when the settings are unusable.
    """
    if template_file is None:
        tool_template = ChatTemplate.shipped()
    else:
        try:
            source = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ChatTemplateError(f"cannot read the chat template {template_file}: {error}") from None
        tool_template = check_template(source, max_render_seconds=None)  # the operator's own: trusted
    tool_call_format = get_format(tool_format)
    check_teaches(tool_template, tool_call_format, "LORAPLEX_CHAT_TEMPLATE (or the shipped one)")
    return ChatStyle(None, tool_template, tool_call_format)


def check_teaches(template: ChatTemplate, tool_format: ToolCallFormat, which: str) -> None:
    """ChatTemplateError unless ``template`` writes the sample conversation's call in ``tool_format``.

    A model learns how to call from the calls its prompt shows; a template that writes them in another
    format (the shipped one writes hermes' ``<tool_call>``) leaves it calling in that one while decoding
    waits for this format's opening, and ``auto`` calls almost never open.
    """
    rendered = template.render(SAMPLE_MESSAGES, SAMPLE_TOOLS)
    opening = re.compile(tool_format.group_opening + r"\s*" + tool_format.call_opening)
    if not any(match.group("name") == SAMPLE_CALL for match in opening.finditer(rendered)):
        written = f"{tool_format.group_begin}{tool_format.call_begin}{SAMPLE_CALL}{tool_format.arguments_begin}"
        raise ChatTemplateError(
            f"{which} does not write calls in the {tool_format.name} tool-call format (its sample call to "
            f"{SAMPLE_CALL} is not written as {written}...); send a template that teaches the model this format"
        )
