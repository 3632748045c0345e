"""How chat requests on one model (the base model or an adapter) are rendered and read: templates and format."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.tool_calls.formats import ToolCallFormat, get_format
from app.tool_calls.templates import ChatTemplate, ChatTemplateError, check_template


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
    return ChatStyle(None, tool_template, get_format(tool_format))
