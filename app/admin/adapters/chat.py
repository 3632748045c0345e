"""An uploaded adapter's own chat template and tool-call format, checked before anything is stored.

The template comes as ``chat_template.jinja``, or as the ``chat_template`` string of a
``tokenizer_config.json`` (the two places Hugging Face keeps it; the ``.jinja`` file wins when both are sent,
as in transformers). A list of named templates is refused: send the one to use as ``chat_template.jinja``.
The template is compiled in the sandbox and must render a sample conversation with tools, a call and its
result, and one without tools (it renders every chat request on the adapter, with tools or not); the format
must be one of the registry's. Each failure is a 400 naming the part and saying why.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from app.admin.adapters.upload import FORMAT_FIELD, TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, AdapterUpload
from app.tool_calls.formats import FORMATS, ToolCallFormat, ToolCallFormatError, get_format
from app.tool_calls.style import SAMPLE_CALL, check_teaches
from app.tool_calls.templates import SAMPLE_MESSAGES, ChatTemplate, ChatTemplateError, check_template
from app.web.bounded_json import parse_json
from app.web.errors import BadRequestError

PLAIN_SAMPLE = SAMPLE_MESSAGES[:2]  # a system message and a user's question: a chat request without tools


@dataclass(frozen=True, slots=True)
class AdapterChat:
    """What an adapter brings for chat: its tool-call format and its chat template (None: the server's)."""

    tool_call_format: str | None = None
    chat_template: str | None = None

    @property
    def chat_template_sha256(self) -> str | None:
        return None if self.chat_template is None else hashlib.sha256(self.chat_template.encode()).hexdigest()


def adapter_chat(upload: AdapterUpload, server_tool_template: ChatTemplate, server_format: str) -> AdapterChat:
    """The upload's format and template, checked; BadRequestError (naming the part) when one is unusable.

    The format the adapter will decode calls in (the one it names, else ``server_format``) must be the one its
    template (or, without one, ``server_tool_template``) writes its sample call in: the model calls as its prompt
    shows.
    """
    tool_call_format = upload.tool_call_format
    if tool_call_format is not None:
        try:
            get_format(tool_call_format)
        except ToolCallFormatError as error:
            raise BadRequestError(f"`{FORMAT_FIELD}`: {error}.", param=FORMAT_FIELD) from None
    found = _template_source(upload.chat_files)
    if found is None:
        if tool_call_format is not None:
            _check_teaches(server_tool_template, tool_call_format, "the server's chat template", FORMAT_FIELD)
        return AdapterChat(tool_call_format)
    part, source = found
    try:
        template = check_template(source)
        template.render(PLAIN_SAMPLE, None)
    except ChatTemplateError as error:
        raise BadRequestError(f"`{part}`: {error}; fix the template and upload again.", param=part) from None
    if tool_call_format is not None:
        _check_teaches(template, tool_call_format, f"`{part}`", part)
    else:
        _check_teaches_the_servers(template, server_format, part)
    return AdapterChat(tool_call_format, source)


def _check_teaches(template: ChatTemplate, tool_call_format: str, which: str, param: str) -> None:
    try:
        check_teaches(template, get_format(tool_call_format), which)
    except ChatTemplateError as error:
        raise BadRequestError(
            f"`{FORMAT_FIELD}` {tool_call_format}: {error}; upload the adapter with such a `{TEMPLATE_FILE}`, or "
            "without a format.",
            param=param,
        ) from None


def _check_teaches_the_servers(template: ChatTemplate, server_format: str, part: str) -> None:
    """A template without a format keeps the server's format: it must write calls in that one."""
    if _teaches(template, get_format(server_format)):
        return
    written = [name for name, tool_format in FORMATS.items() if _teaches(template, tool_format)]
    fix = (
        f"name the format it writes in `{FORMAT_FIELD}` ({', '.join(written)})"
        if written
        else f"make it write its sample call to {SAMPLE_CALL} in {server_format}, or in a format named in "
        f"`{FORMAT_FIELD}`"
    )
    raise BadRequestError(
        f"`{part}` does not write calls in the server's {server_format} tool-call format, which an adapter without "
        f"`{FORMAT_FIELD}` keeps: {fix}.",
        param=part,
    )


def _teaches(template: ChatTemplate, tool_format: ToolCallFormat) -> bool:
    try:
        check_teaches(template, tool_format, "")
    except ChatTemplateError:
        return False
    return True


def _template_source(chat_files: dict[str, bytes]) -> tuple[str, str] | None:
    """(the part it came from, the template's source), or None when the upload brings no template."""
    if TEMPLATE_FILE in chat_files:
        return TEMPLATE_FILE, _text(chat_files, TEMPLATE_FILE)
    if TOKENIZER_CONFIG_FILE not in chat_files:
        return None
    part = TOKENIZER_CONFIG_FILE
    try:
        config = parse_json(_text(chat_files, part), f"`{part}`", param=part)
    except ValueError as error:
        raise BadRequestError(f"`{part}` is not valid JSON ({error}).", param=part) from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        raise BadRequestError(
            f"`{part}` holds a list of named chat templates; send the one this adapter should use as "
            f"`{TEMPLATE_FILE}`.",
            param=part,
        )
    if not isinstance(template, str):
        raise BadRequestError(
            f'`{part}` has no "chat_template" string; send the template as `{TEMPLATE_FILE}`, or leave both out to '
            "use the base model's.",
            param=part,
        )
    return part, template


def _text(chat_files: dict[str, bytes], part: str) -> str:
    try:
        return chat_files[part].decode("utf-8-sig")  # a byte order mark, as some editors write, is not the template's
    except UnicodeDecodeError:
        raise BadRequestError(f"`{part}` is not UTF-8 text.", param=part) from None
