"""Each model's chat style: the base model's, or an adapter's own template and tool-call format over it.

An adapter brings a template, a format, both or neither (app/admin/adapters/chat.py checked them at upload).
What it does not bring is the base model's: a format alone keeps the base model's templates, a template alone
keeps the server's format. Its template renders every chat request on it, with tools or without.

Compiled templates are cached by the sha256 of their source (adapters sharing one template share it), so
a request compiles nothing and reads no template text once its template was seen; the source is read from
the database on a miss, so a replica serves templates uploaded through another one.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from app.adapters.resolver import ResolvedModel
from app.tool_calls.formats import ToolCallFormat, ToolCallFormatError, get_format
from app.tool_calls.style import ChatStyle
from app.tool_calls.templates import ChatTemplate, ChatTemplateError
from app.web.errors import ModelNotFoundError, ServiceUnavailableError

logger = logging.getLogger(__name__)

MAX_CACHED_TEMPLATES = 1024  # compiled templates kept; one is a few hundred KiB at most


class ChatStyles:
    """Maps a resolved model to its ChatStyle, compiling each adapter's template once."""

    def __init__(self, base: ChatStyle, read_template: Callable[[uuid.UUID], Awaitable[str | None]]) -> None:
        self.base = base
        self._read_template = read_template  # an adapter's template source by its id
        self._templates: OrderedDict[str, ChatTemplate] = OrderedDict()  # by sha256 of the source, oldest first

    async def style(self, model: ResolvedModel) -> ChatStyle:
        if model.adapter_id is None or (model.tool_call_format is None and model.chat_template_sha256 is None):
            return self.base
        tool_format = self.base.tool_format if model.tool_call_format is None else _format(model.tool_call_format)
        if model.chat_template_sha256 is None:
            return ChatStyle(self.base.template, self.base.tool_template, tool_format)
        template = await self._template(model, model.adapter_id, model.chat_template_sha256)
        return ChatStyle(template, template, tool_format, tenant_supplied=True)

    async def _template(self, model: ResolvedModel, adapter_id: uuid.UUID, sha256: str) -> ChatTemplate:
        template = self._templates.get(sha256)
        if template is not None:
            self._templates.move_to_end(sha256)
            return template
        source = await self._read_template(adapter_id)
        if source is None:  # the row lost its template between the lookup and this read: it no longer exists
            raise ModelNotFoundError(model.name)
        try:
            template = await asyncio.to_thread(ChatTemplate, source)  # compiling a large template takes ms
        except ChatTemplateError as error:  # checked at upload: only a template this server's Jinja reads otherwise
            logger.error("adapter %s: its chat template no longer compiles: %s", adapter_id, error)
            raise ServiceUnavailableError(
                f"This model's chat template cannot be used on this server ({error}); an administrator must upload "
                "the adapter again."
            ) from None
        self._templates[sha256] = template
        if len(self._templates) > MAX_CACHED_TEMPLATES:
            self._templates.popitem(last=False)
        return template


def _format(name: str) -> ToolCallFormat:
    try:
        return get_format(name)
    except ToolCallFormatError as error:  # checked at upload: only a format this server's registry lacks otherwise
        raise ServiceUnavailableError(
            f"This model's tool-call format cannot be used on this server ({error}); an administrator must upload "
            "the adapter again."
        ) from None
