"""Every setting, its documented range, and the error that says what to fix: one table, read at start.

Each row is one environment variable: the Settings field it fills, a value inside its range and what that
becomes, and values outside it with the words the error must say. The last test checks that the table
covers every field, so a new setting cannot go unchecked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click.testing
import pytest
import torch

from app.cli.main import cli
from app.settings import MAX_NUM_SEQS_LIMIT, Settings, SettingsError
from engine import EngineConfig
from engine.config import DEFAULT_STEP_TOKENS

MIB = 1024**2


@dataclasses.dataclass(frozen=True)
class Row:
    variable: str
    field: str
    good: str
    parsed: object
    bad: tuple[tuple[str, str], ...] = ()  # (value, what the error must say)


WHOLE_NUMBER = (("zero", "must be a whole number"), ("1.5", "must be a whole number"))

TABLE = [
    Row("LORAPLEX_HOME", "home", "/srv/loraplex", Path("/srv/loraplex")),
    Row("LORAPLEX_MODEL", "model", "/models/llama", "/models/llama"),
    Row("DATABASE_URL", "database_url", "postgresql://u@h/db", "postgresql://u@h/db"),
    Row("LORAPLEX_MIGRATE", "migrate_on_start", "0", False),
    Row("LORAPLEX_KEY_SECRET", "key_secret", "s3cret", "s3cret"),
    Row("LORAPLEX_SERVED_MODEL_NAME", "served_model_name", "base", "base"),
    Row("LORAPLEX_ENGINE", "engine", "thread", "thread", (("gpu", "must be one of local, process, thread, ray"),)),
    Row("LORAPLEX_RAY_ADDRESS", "ray_address", "auto", "auto"),
    Row("LORAPLEX_RAY_REPLICAS", "ray_replicas", "4", 4, (("0", "at least 1"), *WHOLE_NUMBER)),
    Row("LORAPLEX_RAY_REPLICA_CPUS", "ray_replica_cpus", "1.5", 1.5, (("-1", "at least 0"), ("inf", "at least 0"))),
    Row("LORAPLEX_RAY_REPLICA_GPUS", "ray_replica_gpus", "0.5", 0.5, (("nan", "at least 0"), ("x", "a number"))),
    Row("LORAPLEX_RAY_OUTPUT_PORT", "ray_output_port", "7010", 7010, (("65536", "0 to 65535"), *WHOLE_NUMBER)),
    Row("LORAPLEX_POOL_MB", "pool_bytes", "256", 256 * MIB, (("0", "at least 1"), *WHOLE_NUMBER)),
    Row(
        "LORAPLEX_MAX_NUM_SEQS",
        "max_num_seqs",
        str(MAX_NUM_SEQS_LIMIT),
        MAX_NUM_SEQS_LIMIT,
        (("0", "1 to 512"), ("513", "1 to 512 \\(the engine decodes at most 512 tokens a step"), *WHOLE_NUMBER),
    ),
    Row("LORAPLEX_DTYPE", "dtype", "bfloat16", "bfloat16", (("fp8", "must be one of auto, float32"),)),
    Row("LORAPLEX_QUANTIZATION", "quantization", "int8", "int8", (("int4", "must be one of int8"),)),
    Row("LORAPLEX_BF16_GEMM", "bf16_gemm", "widen", "widen", (("amx", "must be one of auto, widen, dot"),)),
    Row(
        "LORAPLEX_NUM_SPECULATIVE_TOKENS",
        "num_speculative_tokens",
        "0",
        0,
        (("-1", "0 to 16 \\(0 turns speculation off"), ("17", "0 to 16"), *WHOLE_NUMBER),
    ),
    Row("LORAPLEX_CUDA_GRAPHS", "cuda_graphs", "0", False),
    Row("LORAPLEX_LAUNCH_AHEAD", "launch_ahead", "0", False),
    Row("LORAPLEX_DEMO", "demo", "off", False),
    Row("LORAPLEX_ADMIN_KEY", "admin_key", "lp-admin", "lp-admin"),
    Row(
        "LORAPLEX_MAX_ADAPTER_RANK",
        "max_adapter_rank",
        "64",
        64,
        (("0", "1 to 256 \\(the engine serves LoRA ranks 1 to 256"), ("257", "1 to 256"), *WHOLE_NUMBER),
    ),
    Row(
        "LORAPLEX_MAX_ADAPTER_MB",
        "max_adapter_bytes",
        "1023",
        1023 * MIB,
        (("1024", "1 to 1023 \\(adapter files are stored as PostgreSQL bytea values"), ("0", "1 to 1023")),
    ),
    Row("LORAPLEX_MAX_REQUEST_KB", "max_request_bytes", "64", 64 * 1024, (("-5", "at least 1"), *WHOLE_NUMBER)),
    Row("LORAPLEX_SHUTDOWN_GRACE_S", "shutdown_grace_s", "5", 5, (("0", "at least 1"), *WHOLE_NUMBER)),
    Row("LORAPLEX_MAX_N", "max_n", "4", 4, (("0", "at least 1"), *WHOLE_NUMBER)),
    Row("LORAPLEX_MAX_PROMPTS", "max_prompts", "8", 8, (("0", "at least 1"), *WHOLE_NUMBER)),
    Row("LORAPLEX_CONSOLE", "console", "0", False),
    Row("LORAPLEX_REDIS_URL", "redis_url", "redis://h:6379/0", "redis://h:6379/0"),
    Row("LORAPLEX_REDIS_FAIL_RATE", "redis_fail_rate", "closed", "closed", (("maybe", "one of open, closed"),)),
    Row("LORAPLEX_REDIS_FAIL_CONCURRENCY", "redis_fail_concurrency", "CLOSED", "closed", (("1", "one of open"),)),
    Row("LORAPLEX_REDIS_FAIL_BUDGET", "redis_fail_budget", "open", "open", (("shut", "one of closed, open"),)),
    Row(
        "LORAPLEX_RESPONSE_RETENTION_DAYS",
        "response_retention_days",
        "7",
        7,
        (("0", "1 to 3650"), ("3651", "1 to 3650"), *WHOLE_NUMBER),
    ),
    Row("LORAPLEX_LOG_LEVEL", "log_level", "DEBUG", "debug", (("loud", "must be one of info, debug"),)),
    Row("LORAPLEX_CHAT_TEMPLATE", "chat_template", "/srv/tools.jinja", Path("/srv/tools.jinja")),
    Row("LORAPLEX_TOOL_CALL_FORMAT", "tool_call_format", "pythonic", "pythonic", (("xml", "must be one of hermes"),)),
    Row("LORAPLEX_USAGE_SPOOL_MAX_MB", "usage_spool_max_bytes", "16", 16 * MIB, (("0", "at least 1"), *WHOLE_NUMBER)),
    Row("LORAPLEX_SHARE_BASE_PREFIX_CACHE", "share_base_prefix_cache", "1", True),
    Row("LORAPLEX_FORWARDED_ALLOW_IPS", "forwarded_allow_ips", "10.0.0.0/8,10.1.2.3", "10.0.0.0/8,10.1.2.3"),
]
BAD = [(row.variable, value, message) for row in TABLE for value, message in row.bad]


@pytest.mark.parametrize("row", TABLE, ids=[row.variable for row in TABLE])
def test_a_value_in_range_is_read(row: Row) -> None:
    assert getattr(Settings.from_env({row.variable: row.good}), row.field) == row.parsed


@pytest.mark.parametrize(("variable", "value", "message"), BAD, ids=[f"{v}={x}" for v, x, _ in BAD])
def test_a_value_out_of_range_is_refused_saying_what_to_fix(variable: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message) as raised:
        Settings.from_env({variable: value})
    assert str(raised.value).startswith(f"{variable} must be"), "the error names the variable to fix"
    assert repr(value) in str(raised.value) or value in str(raised.value), "and the value it holds"


def test_the_table_covers_every_setting() -> None:
    assert sorted(row.field for row in TABLE) == sorted(field.name for field in dataclasses.fields(Settings))


def test_the_sequence_limit_is_the_engines_token_budget_on_a_cpu() -> None:
    assert DEFAULT_STEP_TOKENS["cpu"] == MAX_NUM_SEQS_LIMIT
    config = EngineConfig(model="m", max_num_seqs=MAX_NUM_SEQS_LIMIT)
    assert config.step_token_budget(torch.device("cpu")) == MAX_NUM_SEQS_LIMIT


def test_the_command_line_refuses_an_adapter_size_postgres_cannot_store(tmp_path: Path) -> None:
    """Every command (``serve`` too) reads the settings first; ``db url`` does nothing else that could hang."""
    env = {"LORAPLEX_HOME": str(tmp_path), "LORAPLEX_MAX_ADAPTER_MB": "2048"}
    result = click.testing.CliRunner().invoke(cli, ["db", "url"], env=env)
    assert result.exit_code != 0
    assert "LORAPLEX_MAX_ADAPTER_MB must be 1 to 1023 (adapter files are stored as PostgreSQL bytea" in result.output
