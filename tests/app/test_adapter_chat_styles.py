"""Which template and format a model's chat requests get: what an adapter brings, over the base model's."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from app.adapters.resolver import ResolvedModel
from app.openai.chat.styles import ChatStyles
from app.tool_calls import FORMATS
from app.tool_calls.style import base_chat_style
from app.web.errors import ServiceUnavailableError
from tests.app.test_tool_calls_auto import PYTHONIC_TEMPLATE

pytestmark = pytest.mark.anyio

SHA = hashlib.sha256(PYTHONIC_TEMPLATE.encode()).hexdigest()


class TemplateTable:
    """Adapters' template sources by id, counting reads (the database's part in the real server)."""

    def __init__(self, sources: dict[uuid.UUID, str]) -> None:
        self.sources = sources
        self.num_reads = 0

    async def read(self, adapter_id: uuid.UUID) -> str | None:
        self.num_reads += 1
        return self.sources.get(adapter_id)


async def test_an_adapter_gets_what_it_brings_and_the_base_models_style_for_the_rest() -> None:
    base = base_chat_style(None, "hermes")
    with_template, format_only, template_only = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    table = TemplateTable({with_template: PYTHONIC_TEMPLATE, template_only: PYTHONIC_TEMPLATE})
    styles = ChatStyles(base, table.read)

    assert await styles.style(ResolvedModel("base")) is base
    assert await styles.style(ResolvedModel("plain", uuid.uuid4())) is base

    both = await styles.style(ResolvedModel("agent", with_template, "pythonic", SHA))
    assert both.tool_format is FORMATS["pythonic"]
    assert both.template is both.tool_template and both.template.source == PYTHONIC_TEMPLATE
    assert both.tenant_supplied and not base.tenant_supplied  # rendered off the event loop

    only_format = await styles.style(ResolvedModel("fmt", format_only, "mistral"))
    assert only_format.tool_format is FORMATS["mistral"]
    assert (only_format.template, only_format.tool_template) == (base.template, base.tool_template)

    only_template = await styles.style(ResolvedModel("tpl", template_only, None, SHA))
    assert only_template.tool_format is base.tool_format  # the server's format when the adapter names none
    # One template source is compiled once, whichever adapter brought it, and read once.
    assert only_template.template is both.template and table.num_reads == 1
    for _ in range(3):
        await styles.style(ResolvedModel("agent", with_template, "pythonic", SHA))
    assert table.num_reads == 1


async def test_a_stored_format_this_server_lacks_is_503_not_500() -> None:
    styles = ChatStyles(base_chat_style(None, "hermes"), TemplateTable({}).read)
    with pytest.raises(ServiceUnavailableError, match="upload the adapter again"):
        await styles.style(ResolvedModel("old", uuid.uuid4(), "xml"))
