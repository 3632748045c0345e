"""Fuzzing every route against the served OpenAPI schema with schemathesis: no 5xx, and every answer documented.

The app runs under uvicorn on loopback (a live server), on the real default model and a real PostgreSQL, and
schemathesis's engine sends what it generates from /schema/openapi.json (the schema's examples, boundary values,
then random requests, valid and invalid) and checks each answer: not a server error, a documented status code,
content type and body, valid requests accepted and invalid ones refused. The OpenAI routes get a tenant's
`inference` key and the admin routes an `admin` key; a second pass sends the `inference` key to the admin routes,
which must refuse it, as documented too. tests/app/fuzz_plan.py says what the fuzzer adjusts and why.

(schemathesis's pytest plugin cannot load a schema from a fixture under pytest 9.2, where nodes lost ``_nodeid``,
so its engine runs inside one test per pass and the test lists every failure with a curl command that replays it.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.fuzz_plan import (
    FuzzReport,
    FuzzSetup,
    fuzz_config,
    load_fuzz_schema,
    make_fuzz_setup,
    run_fuzzer,
)
from tests.app.live_server import LiveServer, live_server

MAX_EXAMPLES = 20  # random requests per operation, after its examples and boundary values: keeps the file short
NUM_OPERATIONS = 29  # every route of docs/api.md and docs/admin.md, operations routes included
NUM_ADMIN_OPERATIONS = 19
REACHED = (  # operations that must succeed at least once: the fuzzer reaches past validation into real work
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "GET /admin/tenants/{tenant_id}",
    "GET /admin/adapters/{adapter_id}",
)


@pytest.fixture
def server(gateway_settings, default_engine) -> Iterator[LiveServer]:
    with live_server(gateway_settings, default_engine) as running:
        yield running


@pytest.fixture
def fuzz_setup(server: LiveServer, default_engine, tenant_adapters: dict[str, Path]) -> FuzzSetup:
    return server.run(make_fuzz_setup(server.gateway, Path(default_engine.config.model), tenant_adapters["alpha"]))


def _fuzz(server: LiveServer, setup: FuzzSetup, *, admin_key: str, path_regex: str | None = None) -> FuzzReport:
    config = fuzz_config(
        openai_key=setup.inference_key, admin_key=admin_key, max_examples=MAX_EXAMPLES, path_regex=path_regex
    )
    return run_fuzzer(load_fuzz_schema(server.url, config, setup))


def _assert_clean(report: FuzzReport) -> None:
    failures = "\n\n".join(str(failure) for failure in report.failures)
    assert not report.failures, f"{len(report.failures)} failures:\n\n{failures}"
    assert not report.errors, "\n".join(report.errors)


def test_every_route_answers_as_documented(server: LiveServer, fuzz_setup: FuzzSetup) -> None:
    report = _fuzz(server, fuzz_setup, admin_key=fuzz_setup.admin_key)
    _assert_clean(report)
    assert len(report.statuses) == NUM_OPERATIONS, sorted(report.statuses)
    succeeded = {operation for operation, statuses in report.statuses.items() if min(statuses) < 300}
    assert set(REACHED) <= succeeded, f"never answered 2xx: {set(REACHED) - succeeded}"


def test_admin_routes_refuse_an_inference_key(server: LiveServer, fuzz_setup: FuzzSetup) -> None:
    report = _fuzz(server, fuzz_setup, admin_key=fuzz_setup.inference_key, path_regex="^/admin/")
    _assert_clean(report)
    assert len(report.statuses) == NUM_ADMIN_OPERATIONS, sorted(report.statuses)
    let_through = {operation: statuses for operation, statuses in report.statuses.items() if min(statuses) < 400}
    assert not let_through, f"an inference key got answers from admin routes: {let_through}"
    assert all(403 in statuses for statuses in report.statuses.values()), report.statuses
