"""``/v1/responses``: a response's object, built from the chat completion the request runs as.

The request runs as a chat completion (app/openai/responses/input.py), so tenancy, limits, metering
(endpoint ``responses``, one usage row), structured output and tool calls are the chat route's own. Its
answer becomes output items: the text as a ``message`` item (when there is text, or nothing else), then one
``function_call`` item per call. A text cut by ``max_output_tokens`` is ``incomplete``, never a half call.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from app.openai.chat.replies import Reply, assistant_message
from app.openai.responses.items import OutputItem, function_call, output_message
from app.openai.responses.schemas import FunctionToolChoice, ResponseObject, ResponsesRequest, ResponseUsage
from engine import RequestOutput


class ResponseShape:
    """One response's object, as the stream builds it and as the final body carries it."""

    def __init__(self, reply: Reply, body: ResponsesRequest, store: bool) -> None:
        self.reply = reply
        self.body = body
        self.store = store
        self.id = reply.id
        self.message_id = f"msg_{reply.id.removeprefix('resp_')}"

    def response(self, output: list[OutputItem], usage: ResponseUsage | None, status: str) -> ResponseObject:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text = msgspec.to_builtins(body.text) if body.text is not None else {"format": {"type": "text"}}
        return ResponseObject(
            id=self.id,
            created_at=self.reply.created,
            model=self.reply.model,
            status=status,  # type: ignore[arg-type]  # one of the literal's values
            output=output,
            usage=usage,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            text=text,
            metadata=body.metadata or {},
            incomplete_details=incomplete,
            tool_choice=_shown_tool_choice(body),
            tools=body.tools or [],
            parallel_tool_calls=body.parallel_tool_calls is not False,
            store=self.store,
            previous_response_id=body.previous_response_id,
        )

    def output_items(self, output: RequestOutput) -> list[OutputItem]:
        """The finished answer's items: its text as a message (if any, or if there is nothing else), then its calls."""
        status = item_status(response_status(output))
        message, _ = assistant_message(self.reply.tool_plan, output)
        calls = message.tool_calls or []
        items: list[OutputItem] = []
        if message.content or not calls:
            items.append(output_message(self.message_id, message.content or "", status))
        for call in calls:
            item_id = f"fc_{secrets.token_hex(12)}"
            items.append(function_call(item_id, call.id, call.function.name, call.function.arguments, "completed"))
        return items

    def usage(self, last: dict[int, RequestOutput]) -> ResponseUsage:
        usage = self.reply.usage(last)
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details={"cached_tokens": usage.prompt_tokens_details["cached_tokens"]},
            output_tokens=usage.completion_tokens,
            output_tokens_details={"reasoning_tokens": 0},
            total_tokens=usage.total_tokens,
        )


def whole_response(shape: ResponseShape, last: dict[int, RequestOutput]) -> ResponseObject:
    output = last[0]
    return shape.response(shape.output_items(output), shape.usage(last), response_status(output))


def response_status(output: RequestOutput) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


def item_status(status: str) -> str:
    return "incomplete" if status == "incomplete" else "completed"


def _shown_tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "name": choice.name}
    return choice or ("auto" if body.tools else "none")
