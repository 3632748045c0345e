"""The Responses API's routes (docs/responses.md): create a response, and read one stored, list the items it was
generated from, or delete it (tenant-scoped)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from litestar import Request, Response, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.params import Body, PathParameter, QueryParameter

from app.keys.service import Scope
from app.openai.answers import OPENAI_ERROR_RESPONSES, answer
from app.openai.responses.schemas import (
    INCLUDABLE,
    MAX_LISTED_ITEMS,
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from app.openai.responses.service import DEFAULT_LISTED_ITEMS
from app.services import gateway_of
from app.web.json_body import strict_json
from app.web.responses import ERROR_RESPONSES, request_id_of

# Ids are `resp_` and hex digits; the pattern keeps what a path segment cannot carry out of the documented schema.
ResponseId = Annotated[
    str,
    PathParameter(
        description="The response's id, as its creation returned it (`resp_...`).",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_-]+$",
    ),
]
AfterParam = Annotated[str | None, QueryParameter(description="List the items after this item id (a page's last_id).")]
LimitParam = Annotated[
    int, QueryParameter(ge=1, le=MAX_LISTED_ITEMS, description=f"Items per page, 1 to {MAX_LISTED_ITEMS}.")
]
OrderParam = Annotated[
    Literal["asc", "desc"], QueryParameter(description="`desc` (newest first, the default) or `asc`.")
]
IncludeParam = Annotated[
    list[str] | None,
    QueryParameter(description=f"Accepted ({', '.join(INCLUDABLE)}): parts of items this server never makes."),
]
NOT_FOUND = "No stored response of yours has this id (never stored, deleted, expired, or another tenant's)"


RESPONSES_EXAMPLE = Example(
    summary="Ask with the Responses API",
    value={"model": "SmolLM2-135M-Instruct", "input": "Name three colours.", "max_output_tokens": 32},
)


@post(
    "/v1/responses",
    status_code=200,
    summary="Create a response",
    description="OpenAI's Responses API: `input` a text or items (messages, `function_call`, "
    "`function_call_output`), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` "
    "(json_schema, json_object), function `tools` with `tool_choice`. Stored for the tenant unless `store` is "
    "false, and continued with `previous_response_id`. With `stream: true`: `text/event-stream` of OpenAI's "
    "events, `response.created` first and `response.completed` (or `response.incomplete`) last.",
    tags=["openai"],
    before_request=strict_json(ResponsesRequest),
    responses={
        200: ResponseSpec(ResponseObject, description="The response (or an SSE stream of events)"),
        **OPENAI_ERROR_RESPONSES,
    },
)
async def responses(
    request: Request, data: Annotated[ResponsesRequest, Body(examples=[RESPONSES_EXAMPLE])]
) -> Response:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return await answer(request, principal, gateway.responses.create(principal, data, request_id_of(request)))


@get(
    "/v1/responses/{response_id:str}",
    summary="Get a stored response",
    description="A response created with `store` true (the default), as it was answered. " + NOT_FOUND + " is a 404.",
    tags=["openai"],
    responses={200: ResponseSpec(ResponseObject, description="The stored response"), **ERROR_RESPONSES},
)
async def get_response(request: Request, response_id: ResponseId, include: IncludeParam = None) -> Response[Any]:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    return Response(await gateway.responses.get(principal, response_id), headers=gateway.limiter.headers(principal))


@delete(
    "/v1/responses/{response_id:str}",
    status_code=200,
    summary="Delete a stored response",
    description="Deletes the response and its input items; responses that continued it keep their own copy of "
    "the conversation. " + NOT_FOUND + " is a 404.",
    tags=["openai"],
    responses={200: ResponseSpec(DeletedResponse, description="The response was deleted"), **ERROR_RESPONSES},
)
async def delete_response(request: Request, response_id: ResponseId) -> Response[DeletedResponse]:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    deleted = await gateway.responses.delete(principal, response_id)
    return Response(deleted, headers=gateway.limiter.headers(principal))


@get(
    "/v1/responses/{response_id:str}/input_items",
    summary="List a stored response's input items",
    description="The items the response was generated from, in OpenAI's list shape: for a response that continued "
    "another (`previous_response_id`), the earlier input and output items come first. " + NOT_FOUND + " is a 404.",
    tags=["openai"],
    responses={200: ResponseSpec(InputItemList, description="A page of input items"), **ERROR_RESPONSES},
)
async def list_input_items(
    request: Request,
    response_id: ResponseId,
    after: AfterParam = None,
    limit: LimitParam = DEFAULT_LISTED_ITEMS,
    order: OrderParam = "desc",
    include: IncludeParam = None,
) -> Response[InputItemList]:
    gateway = gateway_of(request)
    principal = await gateway.authenticator.authenticate(request.headers.get("authorization"), Scope.INFERENCE)
    page = await gateway.responses.input_items(principal, response_id, after=after, limit=limit, order=order)
    return Response(page, headers=gateway.limiter.headers(principal))


RESPONSES_ROUTES = [responses, get_response, delete_response, list_input_items]
