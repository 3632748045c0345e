"""What the API fuzzer sends and checks: schemathesis's settings, the key each route gets, and a few edits to every
generated request that keep the run fast, the fuzzer's own keys alive, and valid requests valid.

The test (tests/app/test_fuzz_api.py) and the longer run (scripts/drills/fuzz_api.py) both build their run here, so a
failure the script finds replays in the test with the same seed.

The edits (``fit_case``):

- a completion's ``max_tokens`` is capped at MAX_FUZZ_TOKENS, and set when missing: without it the engine fills
  the context, minutes of generation for the CPU model;
- a path parameter naming one of the fuzzer's own tenants or keys is pointed at an id that names nothing: one
  DELETE of them would end the run with 401s;
- half of the well-formed adapter ids it makes up are pointed at the adapter of the tenant ``fuzz-target``, so
  that the adapter routes get past 404 (schemathesis does not find adapter ids in the listings by itself);
- rules the schema can only state in words are kept by valid requests: ``stream_options`` only with
  ``stream: true``, ``top_logprobs`` only with ``logprobs: true``, ``best_of`` equal to ``n``, ``min_tokens``
  at most ``max_tokens``, a completion's ``max_tokens`` 0 only with ``echo`` or ``prompt_logprobs``, a usage
  report of at most MAX_DAYS days from start to end, a key's ``expires_at`` in the future and its scopes
  ones its tenant's keys may hold (``tenant-admin`` for ``admin`` outside the admin tenant), and token ids
  (prompts, ``logit_bias`` keys, ``stop_token_ids``) below the model's vocabulary size (the schema is built
  before the model loads; the bound it states is the engine's, 2**31);
- structured output keeps the rules stated in words: exactly one of ``structured_outputs``' ``json``, ``regex``
  and ``choice``, one constraint per request (``structured_outputs``, ``response_format``, a tool choice), a
  ``json_schema`` format with its schema, tools with unique names and a ``tool_choice`` that names one of them
  (or ``auto``, or none: the model's choice between text and calls), a ``tool`` message with its ``tool_call_id``, no
  ``min_tokens`` under a constraint; made-up schemas and regexes (which xgrammar rightly refuses) become a
  plain object schema and a simple pattern;
- a Responses request's ``max_output_tokens`` is capped and set like ``max_tokens``; an empty ``input`` becomes a
  text and a ``json_schema`` text format gets its name and a plain schema; its function tools get unique names and
  plain parameters, and its ``tool_choice`` the same fitting as chat's (``none`` beside a JSON text format);
- ``n`` is capped at MAX_FUZZ_CHOICES and a list of prompts at MAX_FUZZ_PROMPTS: 16 choices of 64 prompts are
  valid, and a thousand sequences, which the CPU model takes minutes over.

Values of the wrong type are left alone, so invalid requests stay invalid.

An adapter upload whose files are random bytes is valid by the schema (a schema cannot say what a LoRA adapter
is) and rightly refused with 422, so that answer counts as accepting a valid request there. The fuzzer does not
upload real adapters (schemathesis takes any edited multipart body with file bytes for an invalid one); the
tenant ``fuzz-target`` owns one from the start, for the adapter routes to load, pin, unload and delete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import schemathesis
from schemathesis import Case
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events
from schemathesis.engine.recorder import ScenarioRecorder
from schemathesis.hooks import HookContext
from schemathesis.specs.openapi.schemas import OpenApiSchema
from sqlalchemy import select

from app.adapters.store import register_adapter
from app.admin.usage.service import MAX_DAYS
from app.db.tables import ApiKey, Tenant
from app.keys.service import ADMIN_TENANT, Scope, create_api_key
from app.openai.chat.request_schemas import MAX_TOKEN_ID
from app.services import Gateway

SCHEMA_PATH = "/schema/openapi.json"
FUZZ_SEED = 7  # a fixed seed: CI sees the same requests on every run, and a failure replays as it was found
MAX_FUZZ_TOKENS = 1  # the default model takes about 50 ms a token on CPU; one token shows a run completes
MAX_FUZZ_CHOICES = 2
MAX_FUZZ_PROMPTS = 2
SPARED_ID = "00000000-0000-4000-8000-000000000000"  # what the fuzzer gets instead of its own tenants' and keys' ids
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
REQUEST_TIMEOUT_S = 60  # a completion waits its turn in the engine, behind others' on a busy CI machine
MAX_SHOWN_CURL = 2000  # characters of a failing request's curl command in a report (an upload holds megabytes)
UPLOAD_PATH = "/admin/tenants/{tenant_id}/adapters"
USAGE_PATH = "/admin/usage"
RESPONSES_PATH = "/v1/responses"
KEYS_PATH = "/admin/tenants/{tenant_id}/keys"
FUTURE = "2999-01-01T00:00:00Z"
# schemathesis's default statuses of a valid request, and 422: random bytes are valid files, but no adapter
UPLOAD_ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]

# Litestar 2.25 answers OPTIONS on a path served by several handler functions (GET and POST /admin/tenants)
# with the methods of the first function only: its OPTIONS handler keeps the route it was made for when the
# router merges the next function's route in. A framework bug, not this API's; its other checks stay on.
FRAMEWORK_LIMITED_CHECKS = ("allow_header_conformance",)


@dataclass(frozen=True, slots=True)
class FuzzSetup:
    """The keys the fuzzer sends, the ids it must never aim at (deleting them would end the run), the model's
    vocabulary size and the adapter of ``fuzz-target``."""

    inference_key: str
    admin_key: str
    spared_ids: frozenset[str]
    vocab_size: int
    target_adapter_id: str


async def make_fuzz_setup(gateway: Gateway, model_folder: Path, adapter_folder: Path) -> FuzzSetup:
    """In the database: a tenant with an `inference` key, one with an `admin` key (both spared), and
    ``fuzz-target`` with the adapter in ``adapter_folder`` (the fuzzer's to change and delete)."""
    keys: dict[str, str] = {}
    async with gateway.database.sessions() as session, session.begin():
        for scope in (Scope.INFERENCE, Scope.ADMIN):
            tenant = Tenant(name=ADMIN_TENANT if scope == Scope.ADMIN else f"fuzz-{scope}")  # admin keys live there
            session.add(tenant)
            await session.flush()
            _, keys[scope] = await create_api_key(
                session, tenant_id=tenant.id, name=f"fuzz-{scope}", scopes=[scope], key_secret=gateway.key_secret
            )
        spared = [
            str(item) for item in [*await session.scalars(select(Tenant.id)), *await session.scalars(select(ApiKey.id))]
        ]
        target = Tenant(name="fuzz-target")
        session.add(target)
        await session.flush()
        adapter = await register_adapter(
            session, gateway.engine, gateway.settings.home, tenant_id=target.id, name="target", source=adapter_folder
        )
    model_config = json.loads((model_folder / "config.json").read_text())
    return FuzzSetup(
        inference_key=keys[Scope.INFERENCE],
        admin_key=keys[Scope.ADMIN],
        spared_ids=frozenset(spared),
        vocab_size=model_config["vocab_size"],
        target_adapter_id=str(adapter.id),
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def fuzz_config(
    *, openai_key: str, admin_key: str, max_examples: int, seed: int = FUZZ_SEED, path_regex: str | None = None
) -> SchemathesisConfig:
    """Every phase but the stateful one, every check but FRAMEWORK_LIMITED_CHECKS, ``max_examples`` random requests
    per operation after its examples and boundary values, no shrinking (a failure shows the request as sent).

    ``path_regex`` limits the run to the paths it matches (in the config: ``schema.include`` would add to the
    operations the config selects, not narrow them).
    """
    operations: list[dict[str, Any]] = [
        {"include-path-regex": "^/v1/", "headers": bearer(openai_key)},
        {"include-path-regex": "^/admin/", "headers": bearer(admin_key)},
        {"include-path": UPLOAD_PATH, "checks": {"positive_data_acceptance": {"expected-statuses": UPLOAD_ACCEPTED}}},
    ]
    if path_regex is not None:
        operations.append({"exclude-path-regex": path_regex, "enabled": False})
    return SchemathesisConfig.from_dict(
        {
            "seed": seed,
            "continue-on-failure": True,
            "request-timeout": REQUEST_TIMEOUT_S,
            "generation": {"max-examples": max_examples, "deterministic": True, "no-shrink": True, "database": "none"},
            "phases": {"stateful": {"enabled": False}},
            "checks": {name: {"enabled": False} for name in FRAMEWORK_LIMITED_CHECKS},
            "operations": operations,
        }
    )


def load_fuzz_schema(base_url: str, config: SchemathesisConfig, setup: FuzzSetup) -> OpenApiSchema:
    """The served schema, with every generated case passed through :func:`fit_case`."""
    schema = schemathesis.openapi.from_url(f"{base_url}{SCHEMA_PATH}", config=config)

    def map_case(context: HookContext, case: Case) -> Case:
        return fit_case(case, setup)

    def before_add_examples(context: HookContext, examples: list[Case]) -> None:
        for case in examples:  # the schema's own examples skip map_case
            fit_case(case, setup)

    schema.hook("map_case")(map_case)
    schema.hook("before_add_examples")(before_add_examples)
    return schema


def fit_case(case: Case, setup: FuzzSetup) -> Case:
    """The edits of the module's docstring."""
    if case.path_parameters:
        case.path_parameters = {name: _fit_id(name, value, setup) for name, value in case.path_parameters.items()}
    if isinstance(case.body, dict) and case.path == RESPONSES_PATH:
        case.body = _fit_response(case.body)
    elif isinstance(case.body, dict) and case.path.startswith("/v1/"):
        case.body = _fit_completion(case.body, setup.vocab_size)
    elif case.path == USAGE_PATH and case.query:
        case.query = _fit_usage_range(case.query)
    elif case.path == KEYS_PATH and isinstance(case.body, dict):
        case.body = _fit_key(case.body)
    return case


def _fit_key(body: dict[str, Any]) -> dict[str, Any]:
    """A future expiry for a past one, and `tenant-admin` for `admin`, which only the admin tenant's keys may hold
    (the fuzzer never aims at that tenant, and a schema cannot say which tenant a scope needs)."""
    if _is_past(body.get("expires_at")):
        body = {**body, "expires_at": FUTURE}
    scopes = body.get("scopes")
    if isinstance(scopes, list) and Scope.ADMIN in scopes:
        body = {**body, "scopes": [Scope.TENANT_ADMIN if scope == Scope.ADMIN else scope for scope in scopes]}
    return body


def _is_named_tool(tool: Any) -> bool:
    return (
        isinstance(tool, dict)
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def _fit_id(name: str, value: Any, setup: FuzzSetup) -> Any:
    if str(value) in setup.spared_ids:
        return SPARED_ID
    if name == "adapter_id" and isinstance(value, str):
        try:
            return setup.target_adapter_id if uuid.UUID(value).int % 2 == 0 else value
        except ValueError:
            return value
    return value


def _fit_completion(body: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    fitted = dict(body)
    if isinstance(fitted.get("prompt"), list):
        fitted["prompt"] = _in_vocabulary(fitted["prompt"], vocab_size)
    if fitted.get("max_tokens") is None:
        fitted["max_tokens"] = MAX_FUZZ_TOKENS
    for name in TOKEN_FIELDS:
        value = fitted.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
            fitted[name] = MAX_FUZZ_TOKENS
    if isinstance(fitted.get("stream_options"), dict) and fitted.get("stream") is not True:
        del fitted["stream_options"]
    _fit_choices(fitted, vocab_size)
    _fit_structured(fitted)
    return fitted


def _fit_response(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request: ``max_output_tokens`` capped (and set), its input not empty, ``stream_options`` only
    with ``stream``, a ``json_schema`` text format with its name and a plain schema."""
    fitted = dict(body)
    limit = fitted.get("max_output_tokens")
    if limit is None or (isinstance(limit, int | float) and not isinstance(limit, bool) and limit > MAX_FUZZ_TOKENS):
        fitted["max_output_tokens"] = MAX_FUZZ_TOKENS
    if fitted.get("input") == []:
        fitted["input"] = "Hi"
    if isinstance(fitted.get("stream_options"), dict) and fitted.get("stream") is not True:
        del fitted["stream_options"]
    text = fitted.get("text")
    text_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        name = text_format.get("name") if isinstance(text_format.get("name"), str) else "answer"
        fitted["text"] = {**text, "format": {"type": "json_schema", "name": name, "schema": {"type": "object"}}}
    constrained = isinstance(text_format, dict) and text_format.get("type") in ("json_object", "json_schema")
    _fit_response_tools(fitted, constrained)
    return fitted


def _fit_response_tools(body: dict[str, Any], constrained: bool) -> None:
    """A Responses request's function tools and tool choice, fitted as chat's are (module docstring)."""
    tools = body.get("tools")
    named = [tool for tool in tools if isinstance(tool, dict) and isinstance(tool.get("name"), str)] if tools else []
    if not isinstance(tools, list) or len(named) != len(tools):
        if not tools and body.get("tool_choice") not in (None, "none"):
            body.pop("tool_choice")
        return
    unique = {tool["name"]: {**tool, "parameters": {"type": "object"}} for tool in named}
    body["tools"] = list(unique.values())
    choice = body.get("tool_choice")
    chosen = choice.get("name") if isinstance(choice, dict) else None
    if not unique:
        body.pop("tool_choice", None)
    elif constrained:
        body["tool_choice"] = "none"
    elif choice in (None, "auto") or (isinstance(choice, dict) and chosen not in unique):
        body["tool_choice"] = "required"


def _fit_structured(body: dict[str, Any]) -> None:
    """The rules on structured output and tools that the schema states in words (module docstring)."""
    constrained = False
    options = body.get("structured_outputs")
    if isinstance(options, dict):
        present = [name for name in ("json", "regex", "choice") if options.get(name) is not None]
        fitted = {"json": {"type": "object"}, "regex": "[a-z]{1,8}", "choice": ["yes", "no"]}
        body["structured_outputs"] = {present[0]: fitted[present[0]]} if present else {"regex": fitted["regex"]}
        body.pop("response_format", None)
        body.pop("tool_choice", None)
        constrained = True
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("text", "json_object", "json_schema"):
        if response_format["type"] == "json_schema":
            given = response_format.get("json_schema")
            name = given.get("name") if isinstance(given, dict) and isinstance(given.get("name"), str) else "answer"
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": {"type": "object"}},
            }
            constrained = True
        else:
            body["response_format"] = {"type": response_format["type"]}
            constrained = constrained or response_format["type"] == "json_object"
    tools = body.get("tools")
    if isinstance(tools, list) and all(_is_named_tool(tool) for tool in tools):
        unique = {tool["function"]["name"]: tool for tool in tools}
        plain = {"type": "object"}
        body["tools"] = [{**tool, "function": {**tool["function"], "parameters": plain}} for tool in unique.values()]
        choice = body.get("tool_choice")
        function = choice.get("function") if isinstance(choice, dict) else None
        named = function.get("name") if isinstance(function, dict) else None
        if not unique:
            body.pop("tool_choice", None)
        elif constrained:
            body["tool_choice"] = "none"
        elif isinstance(choice, dict) and named not in unique:
            body["tool_choice"] = "required"
        constrained = constrained or (bool(unique) and body.get("tool_choice") != "none")  # auto constrains too
    elif not tools and body.get("tool_choice") not in (None, "none"):
        body.pop("tool_choice")
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "tool" and not message.get("tool_call_id"):
            message["tool_call_id"] = "call_0"
    if constrained and body.get("min_tokens"):
        body["min_tokens"] = 0


def _fit_choices(body: dict[str, Any], vocab_size: int) -> None:
    """The rules on n, logprobs, min_tokens and token ids that the schema states in words (module docstring)."""
    for name in ("n", "best_of", "min_tokens", "top_logprobs", "logprobs", "prompt_logprobs"):
        value = body.get(name)
        if isinstance(value, float) and value.is_integer():
            body[name] = int(value)  # JSON Schema's integer: the server reads 8.0 as 8
    if _is_int(body.get("n")) and body["n"] > MAX_FUZZ_CHOICES:
        body["n"] = MAX_FUZZ_CHOICES
    if isinstance(body.get("prompt"), list) and body["prompt"] and not _is_int(body["prompt"][0]):
        body["prompt"] = body["prompt"][:MAX_FUZZ_PROMPTS]
    if _is_int(body.get("best_of")):
        body["best_of"] = body.get("n") if _is_int(body.get("n")) else 1
    if body.get("top_logprobs") is not None and "messages" in body and body.get("logprobs") is not True:
        body["logprobs"] = True
    scores_prompt = body.get("echo") or body.get("prompt_logprobs") is not None
    if body.get("max_tokens") == 0 and "prompt" in body and not scores_prompt:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    limits = [int(body[name]) for name in TOKEN_FIELDS if isinstance(body.get(name), int | float)]
    if _is_int(body.get("min_tokens")) and limits and body["min_tokens"] > min(limits):
        body["min_tokens"] = max(0, min(limits))
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {
            str(int(key) % vocab_size)
            if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
            else key: bias
            for key, bias in body["logit_bias"].items()
        }
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = _in_vocabulary(body["stop_token_ids"], vocab_size)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_vocabulary(prompt: Any, vocab_size: int) -> Any:
    """Token ids the schema allows (0 to 2**31 - 1), wrapped into the vocabulary; anything else as it is."""
    if isinstance(prompt, list):
        return [_in_vocabulary(item, vocab_size) for item in prompt]
    if isinstance(prompt, float) and prompt.is_integer():
        prompt = int(prompt)  # JSON Schema's integer: the server reads 8.0 as 8
    if isinstance(prompt, int) and not isinstance(prompt, bool) and 0 <= prompt < MAX_TOKEN_ID:
        return prompt % vocab_size
    return prompt


def _fit_usage_range(query: dict[str, Any]) -> dict[str, Any]:
    """A start that parses, after its end (end defaults to today) or more than MAX_DAYS before it, ends itself."""
    start, end = _date(query.get("start")), _date(query.get("end"))
    last = end if end is not None else datetime.now(UTC).date()
    if start is None or (start <= last and (last - start).days < MAX_DAYS):
        return query
    return {**query, "end": start.isoformat()}


def _is_past(value: object) -> bool:
    try:
        moment = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return False
    return moment is not None and moment.tzinfo is not None and moment <= datetime.now(UTC)


def _date(value: object) -> date | None:
    try:
        return date.fromisoformat(value) if isinstance(value, str) and len(value) == 10 else None
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class FuzzFailure:
    """One check that failed on one request, with the command that sends that request again."""

    operation: str
    check: str
    title: str
    message: str
    status: int | None
    curl: str

    def __str__(self) -> str:
        curl = self.curl if len(self.curl) <= MAX_SHOWN_CURL else f"{self.curl[:MAX_SHOWN_CURL]}... (cut)"
        return f"{self.operation}: [{self.check}] {self.title} (answered {self.status})\n{self.message}\n    {curl}"


@dataclass(slots=True)
class FuzzReport:
    statuses: dict[str, set[int]] = field(default_factory=dict)
    """Per operation tested, the statuses of its answers to its own method."""
    num_examples: int = 0
    failures: list[FuzzFailure] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Requests the fuzzer could not make or check (a timeout, a broken connection, an error in schemathesis)."""


def run_fuzzer(schema: OpenApiSchema) -> FuzzReport:
    """Run schemathesis's engine over ``schema`` (every enabled phase) and gather what it sent and what failed."""
    report = FuzzReport()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished) and event.label:
            method = event.label.split(" ")[0]  # not the OPTIONS and TRACE probes of undeclared methods
            answers = [item.response for item in event.recorder.interactions.values() if item.request.method == method]
            report.statuses.setdefault(event.label, set()).update(answer.status_code for answer in answers if answer)
            report.num_examples += len(event.recorder.cases)
            report.failures.extend(_failures(event.recorder))
        elif isinstance(event, events.NonFatalError):
            report.errors.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            raise event.exception
    return report


def _failures(recorder: ScenarioRecorder) -> list[FuzzFailure]:
    found = []
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.failure_info is None:
                continue
            failure = check.failure_info.failure
            interaction = recorder.interactions.get(failure.case_id or case_id)
            found.append(
                FuzzFailure(
                    operation=recorder.label,
                    check=check.name,
                    title=failure.title,
                    message=failure.message,
                    status=interaction.response.status_code if interaction and interaction.response else None,
                    curl=check.failure_info.code_sample,
                )
            )
    return found
