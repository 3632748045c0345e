"""The Responses API's logic: run a response as a chat completion, store it, read, list and delete stored ones.

A response is stored (``store`` true, OpenAI's default) once it has completed or come back incomplete, before
its answer or its last event is sent, with the conversation it was generated from: a continued response's
stored items and output, then its own input. A failed or cancelled response is not stored. Every lookup is by
the caller's tenant: another tenant's response id is the same 404 as an unknown one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy.exc import SQLAlchemyError

from app.keys.authenticator import Principal
from app.openai.chat.service import OpenAIService, last_outputs
from app.openai.responses.input import as_chat, input_items, refuse_unsupported
from app.openai.responses.schemas import DeletedResponse, InputItemList, ResponseObject, ResponsesRequest
from app.openai.responses.shape import ResponseShape, whole_response
from app.openai.responses.storage import Conversation, ResponseStore
from app.openai.responses.stream import response_events
from app.web.errors import BadRequestError, NotFoundError, ServiceUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_LISTED_ITEMS = 20  # OpenAI's default page of input items
CHAT_PARAMS = {"response_format": "text", "messages": "input", "max_tokens": "max_output_tokens"}
"""Chat's names of the parameters a Responses request names otherwise."""


@dataclass(slots=True)
class ResponsesService:
    runner: OpenAIService
    store: ResponseStore

    async def create(
        self, principal: Principal, body: ResponsesRequest, request_id: str
    ) -> ResponseObject | AsyncIterator[bytes]:
        refuse_unsupported(body)
        new_items = input_items(body)
        conversation = new_items
        if body.previous_response_id is not None:
            previous = await self._stored(principal, body.previous_response_id, "previous_response_id")
            conversation = [*previous.input_items, *previous.output_items, *new_items]
        chat = as_chat(body, conversation)
        try:
            reply, first, outputs = await self.runner.start_chat(principal, chat, request_id, "responses", "resp_")
        except BadRequestError as error:
            error.param = CHAT_PARAMS.get(error.param or "", error.param)  # named as this request names it
            raise
        store = body.store is not False

        async def finished(response: ResponseObject) -> None:
            if not store:
                return
            record = msgspec.to_builtins(response)
            try:
                await self.store.save(principal.tenant_id, record, conversation, body.previous_response_id)
            except (SQLAlchemyError, OSError) as error:
                logger.error("response %s could not be stored: %s", response.id, error)
                raise ServiceUnavailableError(
                    f"The response was generated but could not be stored (request id {request_id}); retry, or send "
                    "`store: false` to get it without storing it."
                ) from None

        shape = ResponseShape(reply, body, store)
        if body.stream:
            return response_events(shape, first, outputs, finished)
        response = whole_response(shape, await last_outputs(first, outputs, body.model))
        await finished(response)
        return response

    async def get(self, principal: Principal, response_id: str) -> dict[str, Any]:
        return (await self._stored(principal, response_id)).response

    async def delete(self, principal: Principal, response_id: str) -> DeletedResponse:
        if not await self.store.delete(principal.tenant_id, response_id):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    async def input_items(
        self,
        principal: Principal,
        response_id: str,
        *,
        after: str | None = None,
        limit: int = DEFAULT_LISTED_ITEMS,
        order: str = "desc",
    ) -> InputItemList:
        """A page of the items the response was generated from, newest first unless ``order`` is ``asc``."""
        items = (await self._stored(principal, response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise BadRequestError(f"`after` names no input item of response {response_id!r}.", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        first_id, last_id = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        return InputItemList(data=page, first_id=first_id, last_id=last_id, has_more=len(items) > limit)

    async def _stored(self, principal: Principal, response_id: str, param: str | None = None) -> Conversation:
        stored = await self.store.get(principal.tenant_id, response_id)
        if stored is None:
            raise _not_found(response_id, param)
        return stored


def _not_found(response_id: str, param: str | None = None) -> NotFoundError:
    return NotFoundError(
        f"No stored response has the id {response_id!r}: it was never stored (`store: false`), was deleted, is past "
        "its retention, or belongs to another account.",
        param=param,
    )
