"""The long run of the API fuzzer: tests/app/test_fuzz_api.py with many more random requests per operation.

The same run as the test (tests/app/fuzz_plan.py: schemathesis's engine over the served OpenAPI schema, every
phase but the stateful one, every check but the framework-limited ones, the same edits to generated requests),
on the same kind of server: the app under uvicorn on 127.0.0.1, on the real default model and an embedded
PostgreSQL in a temporary folder, with an `inference` key for the OpenAI routes and an `admin` key for the
admin routes. ``--wrong-scope`` adds the test's second pass, the `inference` key sent to the admin routes.

Each failure is written to stderr with a curl command that replays it; stdout ends with one JSON line:
operations tested, requests sent, failures and errors. The exit status is 1 when anything failed.

    python -m scripts.drills.fuzz_api --max-examples 200
    python -m scripts.drills.fuzz_api --max-examples 1000 --seed 12345    # other requests than the test's
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from app.db.migrate import upgrade
from app.model_store import resolve_model
from app.settings import Settings
from tests.app.fuzz_plan import FUZZ_SEED, FuzzReport, fuzz_config, load_fuzz_schema, make_fuzz_setup, run_fuzzer
from tests.app.gateway_fixtures import start_default_engine, test_settings
from tests.app.live_server import live_server
from tests.app.postgres import real_postgres
from tests.engine.lora_helpers import make_peft_adapter

logger = logging.getLogger("fuzz_api")

DEFAULT_MAX_EXAMPLES = 200
ADAPTER_RANK = 4  # the adapter the tenant `fuzz-target` owns: small, the test's own (tenant_adapters["alpha"])


def fuzz(max_examples: int, seed: int, wrong_scope: bool) -> dict[str, object]:
    """Start the server, run the fuzzer (and its wrong-scope pass), stop everything; the summary."""
    home = Settings.from_env().home
    model = resolve_model("default", home)
    scratch = Path(tempfile.mkdtemp(prefix="loraplex-fuzz-"))
    os.chmod(scratch, 0o755)  # as root, the embedded PostgreSQL runs as its own user and must reach its folder
    started = time.monotonic()
    try:
        adapter = make_peft_adapter(
            model, scratch / "adapter", seed=1, r=ADAPTER_RANK, target_modules=["q_proj", "v_proj"]
        )
        with real_postgres(None) as database_url:
            upgrade(database_url)
            engine = start_default_engine(home)
            try:
                with live_server(test_settings(scratch / "home", database_url), engine) as server:
                    logger.info("server on %s", server.url)
                    setup = server.run(make_fuzz_setup(server.gateway, model, adapter))
                    passes = {
                        "admin key": setup.admin_key,
                        **({"inference key": setup.inference_key} if wrong_scope else {}),
                    }
                    reports = {}
                    for name, admin_key in passes.items():
                        logger.info("fuzzing with the %s on the admin routes", name)
                        config = fuzz_config(
                            openai_key=setup.inference_key,
                            admin_key=admin_key,
                            max_examples=max_examples,
                            seed=seed,
                            path_regex="^/admin/" if admin_key == setup.inference_key else None,
                        )
                        reports[name] = run_fuzzer(load_fuzz_schema(server.url, config, setup))
            finally:
                asyncio.run(engine.stop())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summary(reports, max_examples, seed, time.monotonic() - started)


def summary(reports: dict[str, FuzzReport], max_examples: int, seed: int, seconds: float) -> dict[str, object]:
    for name, report in reports.items():
        for failure in report.failures:
            sys.stderr.write(f"[{name}] {failure}\n\n")
        for error in report.errors:
            sys.stderr.write(f"[{name}] error: {error}\n\n")
    refused_scope = reports.get("inference key")
    let_through = sorted(
        operation
        for operation, statuses in (refused_scope.statuses if refused_scope else {}).items()
        if min(statuses) < 400
    )
    return {
        "seed": seed,
        "max_examples": max_examples,
        "operations": len(reports["admin key"].statuses),
        "examples": sum(report.num_examples for report in reports.values()),
        "failures": sum(len(report.failures) for report in reports.values()),
        "errors": sum(len(report.errors) for report in reports.values()),
        "failed_operations": sorted({failure.operation for report in reports.values() for failure in report.failures}),
        "inference_key_let_through": let_through,
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--max-examples", type=int, default=DEFAULT_MAX_EXAMPLES, help="random requests per operation and pass"
    )
    parser.add_argument("--seed", type=int, default=FUZZ_SEED, help="schemathesis's seed (the test's by default)")
    parser.add_argument("--wrong-scope", action="store_true", help="also send the inference key to the admin routes")
    args = parser.parse_args(argv)
    if args.max_examples < 1:
        parser.error("--max-examples must be at least 1")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "app", "engine"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("uvicorn").setLevel(logging.ERROR)  # "Invalid HTTP request received": the fuzzer's own doing
    result = fuzz(args.max_examples, args.seed, args.wrong_scope)
    sys.stdout.write(json.dumps(result) + "\n")
    clean = not (result["failures"] or result["errors"] or result["inference_key_let_through"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
