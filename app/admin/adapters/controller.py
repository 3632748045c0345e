"""Admin routes for adapters (docs/admin.md): each handler decodes, delegates to AdapterService, answers.

Upload, list, read, pin and delete are Access.TENANT (a tenant admin's own adapters); load and unload, which
manage the engine's memory for every tenant, are the platform's.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Annotated

import msgspec
from litestar import Request, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example, OpenAPIFormat, OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from litestar.params import PathParameter

from app.admin.adapters.schemas import EXAMPLE_ADAPTER, AdapterList, AdapterOut, PinRequest, example_error
from app.admin.adapters.service import AdapterService
from app.admin.adapters.upload import FALSE_WORDS, TRUE_WORDS
from app.admin.adapters.uploads import ADAPTER_NAME
from app.admin.guards import ACCESS, Access, admin_of
from app.services import gateway_of
from app.tool_calls.formats import FORMATS
from app.tool_calls.templates import MAX_TEMPLATE_CHARS
from app.web.bounded_json import nesting_error
from app.web.errors import BadRequestError
from app.web.responses import ErrorBody

TenantId = Annotated[uuid.UUID, PathParameter(description="The tenant's id.")]
AdapterId = Annotated[uuid.UUID, PathParameter(description="The adapter's id, as its upload returned it.")]


def adapter_service(request: Request) -> AdapterService:
    """The app's AdapterService (it remembers pins and pending removals; the gateway closes it)."""
    return gateway_of(request).adapters


def decode_pin(raw: bytes) -> PinRequest:
    if not raw.strip():
        return PinRequest()
    try:
        return msgspec.json.decode(raw, type=PinRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise BadRequestError(f'Invalid body: {error}; send {{"pinned": true}} or {{"pinned": false}}.') from None
    except RecursionError:
        raise nesting_error("The request body") from None


def _responses(
    ok: tuple[int, type[AdapterOut] | type[AdapterList], str], *errors: tuple[int, str, str | None]
) -> dict[int, ResponseSpec]:
    """OpenAPI answers with examples: the success (status, body type, description), then each error
    (status, example message, code)."""
    status, container, description = ok
    example = EXAMPLE_ADAPTER if container is AdapterOut else {"data": [EXAMPLE_ADAPTER]}
    answers = {
        status: ResponseSpec(
            data_container=container,
            description=description,
            generate_examples=False,
            examples=[Example(summary=description, value=example)],
        )
    }
    for error_status, message, code in errors:
        answers[error_status] = ResponseSpec(
            data_container=ErrorBody,
            description=message,
            generate_examples=False,
            examples=[Example(summary=message, value=example_error(message, code))],
        )
    return answers


ADMIN_ERRORS = (
    (401, "You didn't provide an API key.", "invalid_api_key"),
    (403, "The API key lpx_ab12cd34 lacks the `admin` or `tenant-admin` scope ...", "insufficient_permissions"),
)
TENANT = {ACCESS: Access.TENANT}
PLATFORM = {ACCESS: Access.PLATFORM}
NO_ADAPTER = (404, "No adapter has the id 0b3f6c0e-5d0a-4f1e-9a51-6a3b2f4c8d11.", "not_found")
TOO_LARGE = (413, "The request body is larger than the limit of 4096 KiB ...", "request_too_large")


def _any_case(*words: str) -> str:
    """A JSON Schema pattern matching exactly one of ``words``, in any case (JSON Schema regexes have no flags)."""
    spelled = ("".join(f"[{c.upper()}{c}]" if c.isalpha() else re.escape(c) for c in word) for word in words)
    return f"^(?:{'|'.join(spelled)})$"


UPLOAD_FORM = Schema(
    type=OpenAPIType.OBJECT,
    required=["name", "adapter_config.json", "adapter_model.safetensors"],
    properties={
        "name": Schema(
            type=OpenAPIType.STRING,
            pattern=f"^{ADAPTER_NAME.pattern}$",
            description="The `model` name the tenant's keys will use (not the base model's name; no '..').",
            examples=["pirate"],
        ),
        "adapter_config.json": Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY),
        "adapter_model.safetensors": Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY),
        "replace": Schema(
            type=OpenAPIType.STRING,
            pattern=_any_case(*TRUE_WORDS, *FALSE_WORDS),
            default="false",
            description="true (or 1, yes, on; any case) replaces the tenant's live adapter of the same name (the old "
            "one is deleted); false, 0, no, off or empty do not.",
        ),
        "tool_call_format": Schema(
            type=OpenAPIType.STRING,
            enum=sorted(FORMATS),
            description="The format the adapter writes tool calls in; `tool_choice: auto` requests on it are "
            "constrained to it and read in it. Without it, the server's format (LORAPLEX_TOOL_CALL_FORMAT).",
        ),
        "chat_template.jinja": Schema(
            type=OpenAPIType.STRING,
            format=OpenAPIFormat.BINARY,
            description=f"The adapter's own chat template (Jinja, UTF-8, at most {MAX_TEMPLATE_CHARS} characters), "
            "rendering every chat request on it; it must render a sample conversation with tools, a call and its "
            "result. Without it (and without `tokenizer_config.json`), the base model's templates.",
        ),
        "tokenizer_config.json": Schema(
            type=OpenAPIType.STRING,
            format=OpenAPIFormat.BINARY,
            description="A tokenizer_config.json whose `chat_template` string is taken as the template, when "
            "`chat_template.jinja` is not sent.",
        ),
    },
    additional_properties=False,  # another part is a 400 naming it
)
PIN_BODY = Schema(
    type=OpenAPIType.OBJECT,
    properties={"pinned": Schema(type=OpenAPIType.BOOLEAN, default=True)},
    additional_properties=False,
    examples=[{"pinned": True}],
)


def _operation_with_body(
    media_type: str, schema: Schema, required: bool, example: Example | None = None
) -> type[Operation]:
    """An Operation class whose request body is ``schema`` (these handlers read their bodies themselves)."""
    examples = None if example is None else {"example": example}

    @dataclass
    class WithBody(Operation):
        def __post_init__(self) -> None:
            body = OpenAPIMediaType(schema=schema, examples=examples)
            self.request_body = RequestBody(content={media_type: body}, required=required)

    return WithBody


UPLOAD_EXAMPLE = Example(
    summary="A PEFT folder's two files",
    description="curl -F name=pirate -F adapter_config.json=@adapter_config.json "
    "-F adapter_model.safetensors=@adapter_model.safetensors",
    value={
        "name": "pirate",
        "adapter_config.json": "(the file's bytes)",
        "adapter_model.safetensors": "(the file's bytes)",
        "replace": "false",
    },
)


@post(
    "/tenants/{tenant_id:uuid}/adapters",
    opt=TENANT,
    status_code=201,
    summary="Upload an adapter for a tenant",
    description=(
        "multipart/form-data with `name`, `adapter_config.json` and `adapter_model.safetensors` (PEFT's "
        "save_pretrained output), and optionally `replace=true`, a `tool_call_format` and a chat template "
        "(`chat_template.jinja`, or `tokenizer_config.json` holding one). The files are streamed to disk under "
        "a size cap (413 past it), validated against the base model before anything is recorded (422 naming "
        "what is wrong; 400 for a rank above the server's ceiling, a bad name, an unknown format, a template "
        "that does not compile or render a sample conversation with tools, or an unexpected part), then stored, "
        "recorded and registered in the engine: the tenant's keys can use it as `model` at once. 409 when the "
        "name is taken "
        "and `replace` is not true."
    ),
    tags=["admin"],
    request_max_body_size=None,  # the upload enforces its own cap, LORAPLEX_MAX_ADAPTER_MB, as bytes arrive
    operation_class=_operation_with_body("multipart/form-data", UPLOAD_FORM, required=True, example=UPLOAD_EXAMPLE),
    responses=_responses(
        (201, AdapterOut, "The adapter, registered in the engine."),
        (400, "Unexpected form part 'adapter_model.bin'; an adapter upload has only ...", None),
        *ADMIN_ERRORS,
        (404, "No tenant has the id 6f1d2c3b-8a9e-4b7c-9d10-2e3f4a5b6c7d.", "not_found"),
        (409, "The tenant already has an adapter named 'pirate'; send replace=true ...", "adapter_name_taken"),
        (413, "The adapter upload is larger than the limit of 512 MiB ...", "upload_too_large"),
        (422, "The adapter cannot be served: ... lora_A [16, 768] ... made for another base model", "invalid_adapter"),
    ),
)
async def upload_adapter(request: Request, tenant_id: TenantId) -> AdapterOut:
    return await adapter_service(request).upload(
        admin_of(request), tenant_id, request.stream(), request.headers.get("content-type"), request.content_length
    )


@get(
    "/tenants/{tenant_id:uuid}/adapters",
    opt=TENANT,
    summary="List a tenant's adapters",
    description="The tenant's live (not deleted) adapters, oldest first, with whether the engine holds each now.",
    tags=["admin"],
    responses=_responses(
        (200, AdapterList, "The tenant's live adapters."),
        *ADMIN_ERRORS,
        (404, "No tenant has the id 6f1d2c3b-8a9e-4b7c-9d10-2e3f4a5b6c7d.", "not_found"),
    ),
)
async def list_adapters(request: Request, tenant_id: TenantId) -> AdapterList:
    return await adapter_service(request).list_for_tenant(tenant_id)


@get(
    "/adapters/{adapter_id:uuid}",
    opt=TENANT,
    summary="Get an adapter",
    description="Any adapter, deleted ones included (status `deleted`).",
    tags=["admin"],
    responses=_responses((200, AdapterOut, "The adapter."), *ADMIN_ERRORS, NO_ADAPTER),
)
async def get_adapter(request: Request, adapter_id: AdapterId) -> AdapterOut:
    return await adapter_service(request).get(adapter_id)


@delete(
    "/adapters/{adapter_id:uuid}",
    opt=TENANT,
    status_code=200,
    summary="Delete an adapter",
    description=(
        "New requests for it get 404 at once; requests in flight finish. The engine's copy is removed as soon "
        "as no request uses it, and the stored files once no live adapter shares them."
    ),
    tags=["admin"],
    responses=_responses((200, AdapterOut, "The adapter, status `deleted`."), *ADMIN_ERRORS, NO_ADAPTER),
)
async def delete_adapter(request: Request, adapter_id: AdapterId) -> AdapterOut:
    return await adapter_service(request).delete(admin_of(request), adapter_id)


@post(
    "/adapters/{adapter_id:uuid}/load",
    opt=PLATFORM,
    status_code=200,
    summary="Load an adapter into the engine",
    description="Registers it in the engine now, so its first request does not read it from disk. An `admin` key's "
    "work: the engine's memory serves every tenant.",
    tags=["admin"],
    responses=_responses((200, AdapterOut, "The adapter, loaded."), *ADMIN_ERRORS, NO_ADAPTER),
)
async def load_adapter(request: Request, adapter_id: AdapterId) -> AdapterOut:
    return await adapter_service(request).load(admin_of(request), adapter_id)


@post(
    "/adapters/{adapter_id:uuid}/unload",
    opt=PLATFORM,
    status_code=200,
    summary="Unload an adapter from the engine",
    description=(
        "Removes it from the engine's memory (its next request loads it again). While requests use it, waits up "
        "to 5 s for them, then answers 409 saying how many requests use it; nothing is aborted. An `admin` key's "
        "work: the engine's memory serves every tenant."
    ),
    tags=["admin"],
    responses=_responses(
        (200, AdapterOut, "The adapter, unloaded."),
        *ADMIN_ERRORS,
        NO_ADAPTER,
        (409, "The adapter 'pirate' (...) was not unloaded: 2 request(s) are using it ...", "adapter_in_use"),
    ),
)
async def unload_adapter(request: Request, adapter_id: AdapterId) -> AdapterOut:
    return await adapter_service(request).unload(admin_of(request), adapter_id)


@post(
    "/adapters/{adapter_id:uuid}/pin",
    opt=TENANT,
    status_code=200,
    summary="Pin or unpin an adapter",
    description=(
        '`{"pinned": true}` (or an empty body) registers the adapter and keeps it resident in the engine\'s '
        'pool, never evicted; `{"pinned": false}` lets it be evicted again.'
    ),
    tags=["admin"],
    operation_class=_operation_with_body("application/json", PIN_BODY, required=False),
    responses=_responses(
        (200, AdapterOut, "The adapter, pinned or unpinned."),
        (400, "Invalid body: Expected `bool`, got `str` - at `$.pinned`.", None),
        *ADMIN_ERRORS,
        NO_ADAPTER,
        (409, "The pin of adapter 'pirate' (...) is stored, but the adapter kept leaving ...", "adapter_not_pinned"),
        TOO_LARGE,
    ),
)
async def pin_adapter(request: Request, adapter_id: AdapterId) -> AdapterOut:
    body = decode_pin(await request.body())
    return await adapter_service(request).pin(admin_of(request), adapter_id, body.pinned)


ADAPTER_ROUTES = [upload_adapter, list_adapters, get_adapter, delete_adapter, load_adapter, unload_adapter, pin_adapter]
