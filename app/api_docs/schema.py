"""The OpenAPI schema as served: what Litestar derives from the routes, completed with what it cannot derive.

- Request bodies: Litestar's schema of a msgspec Struct leaves out part of what msgspec enforces: that unknown
  fields are refused (``additionalProperties: false``), constraints on a member of a union (``rpm_limit``: an
  integer from 0, or null) and constraints that are zero. The bodies are decoded by msgspec, strictly
  (app/web/json_body.py), so msgspec's own JSON Schema of them is the exact contract: it replaces Litestar's
  components of the same names, keeping their examples.
- Second media types of one answer (a response spec has one): the SSE stream of the completion routes, each
  event's data a chunk as JSON, an error, or ``[DONE]``; the Responses route's stream of typed events; and the
  CSV of the usage report.
- Litestar's own errors: it documents them (a 400 on any route with parameters) in its own shape, which the
  app never sends: app/web/responses.py answers them in OpenAI's, so the schema says ErrorBody.
- Examples of the response bodies (app/api_docs/examples.py).

What is added here is plain JSON Schema (dicts), which the served schema renders as is.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar.openapi.spec import OpenAPI, OpenAPIMediaType, OpenAPIResponse, Reference, Schema

from app.admin.tenants.schemas import KeyCreate, KeyRotate, KeyUpdate, TenantCreate, TenantUpdate
from app.api_docs.examples import add_response_examples
from app.openai.chat.reply_schemas import ChatCompletionChunk, Completion
from app.openai.chat.request_schemas import PROMPT_SCHEMA, ChatCompletionRequest, CompletionRequest
from app.openai.responses.schemas import INPUT_SCHEMA, TOOLS_SCHEMA, ResponsesRequest
from app.web.responses import ERROR_DESCRIPTIONS, JSON

REQUEST_BODIES = (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    TenantCreate,
    TenantUpdate,
    KeyCreate,
    KeyUpdate,
    KeyRotate,
)
"""Every Struct a route decodes as its JSON body."""

PROPERTY_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("CompletionRequest", "prompt"): PROMPT_SCHEMA,
    ("ResponsesRequest", "input"): INPUT_SCHEMA,
    ("ResponsesRequest", "tools"): TOOLS_SCHEMA,
}
"""Fields whose accepted values no msgspec type states (its unions take one list type, and items told apart by a
``type`` that may be absent are checked in code): the stated schema."""

EVENT_STREAMS = {"/v1/chat/completions": ChatCompletionChunk, "/v1/completions": Completion}
"""The routes that answer ``text/event-stream`` with ``stream: true``, and the type of their chunks."""

CSV_ROUTE = "/admin/usage"

COMPONENT_REF = "#/components/schemas/{name}"


def complete_openapi_schema(schema: OpenAPI) -> None:
    """Describe the request bodies as msgspec decodes them, add the event streams and the CSV, give examples."""
    components = schema.components.schemas if schema.components and schema.components.schemas is not None else {}
    describe_request_bodies(components)
    describe_event_streams(schema, components)
    describe_framework_errors(schema)
    _ok(schema, CSV_ROUTE, "get")["text/csv"] = {"schema": {"type": "string", "description": "The rows as CSV."}}
    add_response_examples(schema)


def describe_request_bodies(components: dict[str, Any]) -> None:
    _, definitions = msgspec.json.schema_components(REQUEST_BODIES, ref_template=COMPONENT_REF)
    for (name, field), field_schema in PROPERTY_SCHEMAS.items():
        definitions[name]["properties"][field] = field_schema
    for name, definition in definitions.items():
        examples = getattr(components.get(name), "examples", None)
        components[name] = definition | ({"examples": examples} if examples else {})


def describe_event_streams(schema: OpenAPI, components: dict[str, Any]) -> None:
    _, definitions = msgspec.json.schema_components(EVENT_STREAMS.values(), ref_template=COMPONENT_REF)
    for name, definition in definitions.items():
        components.setdefault(name, definition)  # Litestar's own stays where a response already has it
    for path, chunk in EVENT_STREAMS.items():
        _ok(schema, path, "post")["text/event-stream"] = {"schema": _event(chunk.__name__)}
    _ok(schema, "/v1/responses", "post")["text/event-stream"] = {"schema": RESPONSE_EVENT}


def describe_framework_errors(schema: OpenAPI) -> None:
    error_body = OpenAPIMediaType(schema=Reference(ref=COMPONENT_REF.format(name="ErrorBody")))
    for path_item in (schema.paths or {}).values():
        for method in ("get", "post", "patch", "delete"):
            operation = getattr(path_item, method)
            for status, response in (operation.responses or {}).items() if operation else ():
                if isinstance(response, OpenAPIResponse) and _is_litestar_error(response):
                    response.content = {JSON: error_body}
                    response.description = ERROR_DESCRIPTIONS.get(int(status), response.description)


def _is_litestar_error(response: OpenAPIResponse) -> bool:
    """Litestar's shape of an error: ``{"status_code", "detail", "extra"}``."""
    media_type = (response.content or {}).get(JSON)
    return (
        isinstance(media_type, OpenAPIMediaType)
        and isinstance(media_type.schema, Schema)
        and (media_type.schema.required == ["detail", "status_code"])
    )


RESPONSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "description": "The event's type: `response.created` ... `response.completed`."},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
    "description": "One event of OpenAI's Responses stream: `event:` its type, `data:` it as JSON.",
}


def _event(chunk_name: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 describes an event stream by one event)."""
    chunk = {"$ref": COMPONENT_REF.format(name=chunk_name)}
    error = {"$ref": COMPONENT_REF.format(name="ErrorBody")}
    as_json = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, error]}}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, as_json]}},
        "description": f"`data:` a {chunk_name} as JSON; an error body if the run fails midway; `[DONE]` last.",
    }


def _ok(schema: OpenAPI, path: str, method: str) -> dict[str, Any]:
    """The content map of the 200 answer of ``method path``."""
    operation = getattr(schema.paths[path], method) if schema.paths else None
    if operation is None or operation.responses is None:
        raise LookupError(f"the OpenAPI schema has no {method.upper()} {path}")
    response = operation.responses["200"]
    return response.content  # type: ignore[union-attr,return-value]  # a 200 with a body always has content
