"""Structured output from a request body: ``response_format``, vLLM's ``structured_outputs``, or a tool choice.

Each becomes one engine :class:`~engine.GrammarConstraint`; a request may ask for at most one of them.
Shapes are checked here (a 400 naming the parameter); whether xgrammar can compile the constraint is
checked by the service, off the event loop, before the request is admitted.
"""

from __future__ import annotations

from app.openai.chat.request_schemas import ChatCompletionRequest, CompletionRequest
from app.openai.chat.tools import ToolPlan, tool_plan
from app.tool_calls import ToolCallFormat
from app.web.errors import BadRequestError
from engine import GrammarConstraint, GrammarError


def output_constraint(
    body: ChatCompletionRequest | CompletionRequest, tool_format: ToolCallFormat
) -> tuple[GrammarConstraint | None, ToolPlan | None, str]:
    """The request's constraint (None: free text), its tool plan (chat with tools), and the parameter it came from.

    ``auto`` tool calls are constrained to ``tool_format``.
    """
    plan = tool_plan(body, tool_format) if isinstance(body, ChatCompletionRequest) else None
    asked = [
        (name, constraint)
        for name, constraint in (
            ("structured_outputs", _structured_outputs(body)),
            ("response_format", _response_format(body) if isinstance(body, ChatCompletionRequest) else None),
            ("tool_choice", plan.constraint if plan is not None else None),
        )
        if constraint is not None
    ]
    if len(asked) > 1:
        names = " and ".join(f"`{name}`" for name, _ in asked)
        raise BadRequestError(f"{names} each constrain the output; send only one of them.", param=asked[1][0])
    if not asked:
        return None, plan, ""
    return asked[0][1], plan, asked[0][0]


def _response_format(body: ChatCompletionRequest) -> GrammarConstraint | None:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        if response_format is not None and response_format.json_schema is not None:
            raise BadRequestError("`json_schema` goes with type `json_schema` only.", param="response_format")
        return None
    if response_format.type == "json_object":
        return GrammarConstraint.json_object()
    if response_format.json_schema is None:
        raise BadRequestError(
            'Type `json_schema` needs `json_schema`: {"name": ..., "schema": {...}}.', param="response_format"
        )
    schema = response_format.json_schema.schema
    return GrammarConstraint.json_object() if schema is None else _json_schema(schema, "response_format")


def _structured_outputs(body: ChatCompletionRequest | CompletionRequest) -> GrammarConstraint | None:
    options = body.structured_outputs
    if options is None:
        return None
    given = [name for name in ("json", "regex", "choice") if getattr(options, name) is not None]
    if len(given) != 1:
        raise BadRequestError(
            f"`structured_outputs` takes exactly one of `json`, `regex` and `choice`; got {len(given)}.",
            param="structured_outputs",
        )
    try:
        if options.json is not None:
            return GrammarConstraint.json_schema(options.json)
        if options.regex is not None:
            return GrammarConstraint.regex(options.regex)
        return GrammarConstraint.choice(options.choice or [])
    except GrammarError as error:
        raise BadRequestError(f"`structured_outputs`: {error}.", param="structured_outputs") from None


def _json_schema(schema: dict, param: str) -> GrammarConstraint:
    try:
        return GrammarConstraint.json_schema(schema)
    except GrammarError as error:
        raise BadRequestError(f"`{param}`: {error}.", param=param) from None
