"""Settings read from the environment once, at the edge of the program."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from app.model_store import DEFAULT_MODEL_SPEC
from app.openai.schemas import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS

APP_NAME = "loraplex"
_FALSE_WORDS = ("0", "false", "no", "off")
# A full context of a long-context model (128k tokens, about 512 KiB of text) with room for JSON escapes;
# the default model's context fits in a few hundred KiB. Bodies are parsed before the key is checked.
DEFAULT_MAX_REQUEST_KB = 4096
DEFAULT_SPECULATIVE_TOKENS = 5  # measured best on the input-grounded benchmark (docs/speculative-decoding.md)
# Where the engine runs: on this machine ("local": a worker process of its own fed over a socket, also
# spelled "process"; "thread": a thread of the gateway's process), or as replicas on Ray Serve ("ray").
ENGINE_KINDS = ("local", "process", "thread", "ray")
# What a limit does while Redis cannot be reached; the first is the default. Rate and concurrency let
# requests through (an outage of Redis does not stop the service), the budget refuses them (tokens past a
# budget are spending the tenant did not agree to).
FAIL_OPEN_FIRST = ("open", "closed")
FAIL_CLOSED_FIRST = ("closed", "open")


class SettingsError(ValueError):
    """An environment variable holds a value the program cannot use."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the process reads from its environment, typed and read once."""

    home: Path
    """Data folder for the converted model, the adapter store and the embedded database (LORAPLEX_HOME)."""

    model: str
    """Base model: "default" (SmolLM2-135M-Instruct) or a local Hugging Face model folder (LORAPLEX_MODEL)."""

    database_url: str | None = None
    """PostgreSQL to use (DATABASE_URL); None starts an embedded one in the data folder."""

    migrate_on_start: bool = True
    """Apply the Alembic migrations when the server starts (LORAPLEX_MIGRATE=0 turns it off)."""

    key_secret: str | None = None
    """Secret of the keyed hash of API keys (LORAPLEX_KEY_SECRET); None: one kept in the data folder."""

    served_model_name: str | None = None
    """Name of the base model in the API (LORAPLEX_SERVED_MODEL_NAME); None: the model folder's name."""

    engine: str = "local"
    """Where the engine runs (LORAPLEX_ENGINE): "local" or "process" (a worker process of its own), "thread"
    (this process), or "ray" (engine replicas on Ray Serve)."""

    ray_address: str | None = None
    """The Ray cluster of ``engine="ray"`` (LORAPLEX_RAY_ADDRESS); None starts a single-node Ray here."""

    ray_replicas: int = 1
    """Engine replicas on Ray (LORAPLEX_RAY_REPLICAS): one per GPU, or per group of CPU cores."""

    ray_replica_cpus: float | None = None
    """CPUs Ray reserves for each engine replica (LORAPLEX_RAY_REPLICA_CPUS; 0 reserves none); None: this
    machine's cores shared equally among the replicas."""

    ray_replica_gpus: float = 0.0
    """GPUs Ray gives each engine replica (LORAPLEX_RAY_REPLICA_GPUS)."""

    pool_bytes: int | None = None
    """Bytes of the engine's page pool (LORAPLEX_POOL_MB, in MiB); None: the engine's default."""

    max_num_seqs: int = 64
    """Most sequences the engine runs at once (LORAPLEX_MAX_NUM_SEQS)."""

    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    """Most tokens n-gram speculative decoding proposes per sequence and step; 0 turns it off
    (LORAPLEX_NUM_SPECULATIVE_TOKENS). Outputs are the same either way; see docs/speculative-decoding.md."""

    demo: bool = True
    """On first start with an empty database, create a demo tenant, key and adapters (LORAPLEX_DEMO=0: no)."""

    admin_key: str | None = None
    """An admin key to create on first start if no admin key exists yet (LORAPLEX_ADMIN_KEY)."""

    max_adapter_rank: int = 256
    """Highest LoRA rank an uploaded adapter may have (LORAPLEX_MAX_ADAPTER_RANK)."""

    max_adapter_bytes: int = 512 * 1024**2
    """Largest adapter upload accepted, all files together (LORAPLEX_MAX_ADAPTER_MB, in MiB)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_KB * 1024
    """Largest body of any request but an adapter upload, 413 past it (LORAPLEX_MAX_REQUEST_KB, in KiB)."""

    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long running requests may take to finish before they are ended (LORAPLEX_SHUTDOWN_GRACE_S)."""

    max_n: int = DEFAULT_MAX_N
    """Most choices (`n`) one request may ask for per prompt (LORAPLEX_MAX_N)."""

    max_prompts: int = DEFAULT_MAX_PROMPTS
    """Most prompts one /v1/completions request may send (LORAPLEX_MAX_PROMPTS)."""

    redis_url: str | None = None
    """Redis that holds the limits' state, shared by every replica (LORAPLEX_REDIS_URL); None: in this process."""

    redis_fail_rate: str = "open"
    """While Redis is away, requests and tokens a minute let requests through ("open") or refuse them with a
    503 ("closed") (LORAPLEX_REDIS_FAIL_RATE)."""

    redis_fail_concurrency: str = "open"
    """The same for the concurrency limit (LORAPLEX_REDIS_FAIL_CONCURRENCY)."""

    redis_fail_budget: str = "closed"
    """The same for the monthly budget (LORAPLEX_REDIS_FAIL_BUDGET)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from `environ` (default: the process environment); empty values count as unset."""
        env = os.environ if environ is None else environ
        home = env.get("LORAPLEX_HOME") or platformdirs.user_data_dir(APP_NAME)
        pool_mb = _int(env, "LORAPLEX_POOL_MB")
        return cls(
            home=Path(home).expanduser(),
            model=env.get("LORAPLEX_MODEL") or DEFAULT_MODEL_SPEC,
            database_url=env.get("DATABASE_URL") or None,
            migrate_on_start=_flag(env, "LORAPLEX_MIGRATE", default=True),
            key_secret=env.get("LORAPLEX_KEY_SECRET") or None,
            served_model_name=env.get("LORAPLEX_SERVED_MODEL_NAME") or None,
            engine=_choice(env, "LORAPLEX_ENGINE", ENGINE_KINDS),
            ray_address=env.get("LORAPLEX_RAY_ADDRESS") or None,
            ray_replicas=_int(env, "LORAPLEX_RAY_REPLICAS") or 1,
            ray_replica_cpus=_amount(env, "LORAPLEX_RAY_REPLICA_CPUS", None),
            ray_replica_gpus=_amount(env, "LORAPLEX_RAY_REPLICA_GPUS", 0.0),
            pool_bytes=None if pool_mb is None else pool_mb * 1024**2,
            max_num_seqs=_int(env, "LORAPLEX_MAX_NUM_SEQS") or 64,
            num_speculative_tokens=_count(env, "LORAPLEX_NUM_SPECULATIVE_TOKENS", DEFAULT_SPECULATIVE_TOKENS),
            demo=_flag(env, "LORAPLEX_DEMO", default=True),
            admin_key=env.get("LORAPLEX_ADMIN_KEY") or None,
            max_adapter_rank=_int(env, "LORAPLEX_MAX_ADAPTER_RANK") or 256,
            max_adapter_bytes=(_int(env, "LORAPLEX_MAX_ADAPTER_MB") or 512) * 1024**2,
            max_request_bytes=(_int(env, "LORAPLEX_MAX_REQUEST_KB") or DEFAULT_MAX_REQUEST_KB) * 1024,
            shutdown_grace_s=_int(env, "LORAPLEX_SHUTDOWN_GRACE_S") or 30,
            max_n=_int(env, "LORAPLEX_MAX_N") or DEFAULT_MAX_N,
            max_prompts=_int(env, "LORAPLEX_MAX_PROMPTS") or DEFAULT_MAX_PROMPTS,
            redis_url=env.get("LORAPLEX_REDIS_URL") or None,
            redis_fail_rate=_choice(env, "LORAPLEX_REDIS_FAIL_RATE", FAIL_OPEN_FIRST),
            redis_fail_concurrency=_choice(env, "LORAPLEX_REDIS_FAIL_CONCURRENCY", FAIL_OPEN_FIRST),
            redis_fail_budget=_choice(env, "LORAPLEX_REDIS_FAIL_BUDGET", FAIL_CLOSED_FIRST),
        )


def _flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    value = env.get(name)
    if not value:
        return default
    return value.strip().lower() not in _FALSE_WORDS


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first when unset)."""
    value = (env.get(name) or choices[0]).strip().lower()
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(choices)}, got {env.get(name)!r}")
    return value


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number, got {value!r}") from None
    if number < 1:
        raise SettingsError(f"{name} must be at least 1, got {number}")
    return number


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    """A whole number of at least 0 (0 turns the feature off); ``default`` when unset."""
    value = env.get(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number, got {value!r}") from None
    if number < 0:
        raise SettingsError(f"{name} must be 0 (off) or more, got {number}")
    return number


def _amount(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    """A resource amount: a number of at least 0, fractions allowed (Ray shares a device between replicas)."""
    value = env.get(name)
    if not value:
        return default
    try:
        amount = float(value)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {value!r}") from None
    if not amount >= 0 or amount == float("inf"):
        raise SettingsError(f"{name} must be a number of at least 0, got {value!r}")
    return amount
