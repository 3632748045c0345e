"""The items of OpenAI's Responses API: what ``input`` takes, and how items are kept and shown.

``input`` takes three kinds of item, told apart by ``type`` (a message may leave it out, as OpenAI allows):
messages, the ``function_call`` items of an earlier answer, and ``function_call_output`` items with a
call's result. Each is checked here against its Struct (a 400 naming ``input[i]`` and the field) and kept
in OpenAI's listing shape (:func:`listed`): with an ``id`` (made up when the client sent none), a
``status``, and a message's content as parts. That shape is what ``input_items`` lists, what is stored,
and what a continued conversation is read back from.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from app.web.errors import BadRequestError
from app.web.json_body import body_error

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[TextPart], Meta(description="A text, or text parts.")]
    type: Literal["message"] = "message"
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A call the model made in an earlier answer (sent back so that its output can follow)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Meta(min_length=1, description="The id a `function_call_output` answers it by.")]
    name: str
    arguments: Annotated[str, Meta(description="The arguments object as JSON text.")]
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The result of a call, for the model to answer with."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Meta(min_length=1, description="The `call_id` of the call this is the result of.")]
    output: Annotated[str | list[TextPart], Meta(description="A text, or text parts.")]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class OutputText(msgspec.Struct):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # the arguments object as JSON text
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def decoded_items(raw_items: list[dict[str, Any]]) -> list[InputItem]:
    """Each raw item as its Struct, by ``type`` (absent: a message); a 400 naming the item and field otherwise."""
    items: list[InputItem] = []
    for number, raw in enumerate(raw_items):
        kind = raw.get("type", "message")
        item_type = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if item_type is None:
            raise BadRequestError(
                f"`input[{number}]` has type {kind!r}, which this server does not take: input items are messages, "
                "`function_call` and `function_call_output` items.",
                param=f"input[{number}].type",
            )
        try:
            items.append(msgspec.convert(raw, item_type, strict=True))
        except msgspec.ValidationError as error:
            text = str(error).replace("- at `$", f"- at `$.input[{number}]")
            if " - at `" not in text:
                text += f" - at `$.input[{number}]`"
            raise body_error(text) from None
    return items


def listed(item: InputItem) -> dict[str, Any]:
    """The item in OpenAI's listing shape, with an id and a status."""
    kind = item.type
    item_id = item.id or new_item_id(kind)
    if isinstance(item, MessageItem):
        if item.role == "assistant":
            return msgspec.to_builtins(output_message(item_id, item.text(), "completed"))
        content = [{"type": "input_text", "text": item.text()}]
        return {"id": item_id, "type": kind, "role": item.role, "status": "completed", "content": content}
    if isinstance(item, FunctionCallItem):
        return msgspec.to_builtins(function_call(item_id, item.call_id, item.name, item.arguments, "completed"))
    return {"id": item_id, "type": kind, "call_id": item.call_id, "output": item.text(), "status": "completed"}


def output_message(item_id: str, text: str, status: str) -> OutputMessage:
    return OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])  # type: ignore[arg-type]


def function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> OutputFunctionCall:
    return OutputFunctionCall(id=item_id, call_id=call_id, name=name, arguments=arguments, status=status)  # type: ignore[arg-type]


def new_item_id(kind: str) -> str:
    return f"{ITEM_ID_PREFIXES.get(kind, 'item')}_{secrets.token_hex(12)}"


def item_text(item: dict[str, Any]) -> str:
    """A listed message's text: its parts' texts joined."""
    return "".join(part.get("text", "") for part in item.get("content") or [])
