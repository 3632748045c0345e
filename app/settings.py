"""Settings read from the environment once, at the edge of the program."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from app.model_store import DEFAULT_MODEL_SPEC
from app.settings_defaults import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS, DEFAULT_TOOL_CALL_FORMAT, TOOL_CALL_FORMATS
from engine.adapters.lora_adapter import MAX_RANK, MIN_RANK

APP_NAME = "loraplex"
_FALSE_WORDS = ("0", "false", "no", "off")
# A full context of a long-context model (128k tokens, about 512 KiB of text) with room for JSON escapes;
# the default model's context fits in a few hundred KiB. Bodies are parsed before the key is checked.
DEFAULT_MAX_REQUEST_KB = 4096
# Proposed tokens a sequence verifies in one step at most: longer proposals are rarely all accepted, and each
# costs a row of the step.
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_SPECULATIVE_TOKENS = 5  # measured best on the input-grounded benchmark (docs/speculative-decoding.md)
# Where the engine runs: on this machine ("local": a worker process of its own fed over a socket, also
# spelled "process"; "thread": a thread of the gateway's process), or as replicas on Ray Serve ("ray").
ENGINE_KINDS = ("local", "process", "thread", "ray")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # the first is the default
QUANTIZATION_CHOICES = ("int8",)
BF16_GEMMS = ("auto", "widen", "dot")  # the first is the default (engine/modeling/bf16_gemm.py)
# What a limit does while Redis cannot be reached; the first is the default. Rate and concurrency let
# requests through (an outage of Redis does not stop the service), the budget refuses them (tokens past a
# budget are spending the tenant did not agree to).
FAIL_OPEN_FIRST = ("open", "closed")
FAIL_CLOSED_FIRST = ("closed", "open")
# Stored responses (`store: true` on /v1/responses) are kept 30 days, as OpenAI keeps them; at most ten years.
DEFAULT_RESPONSE_RETENTION_DAYS = 30
MAX_RESPONSE_RETENTION_DAYS = 3650
# How much the log says; the first is the default. "info" keeps other libraries' INFO lines out of it.
LOG_LEVELS = ("info", "debug", "warning", "error")
# Most sequences the engine may run at once: its token budget per step on a CPU (DEFAULT_STEP_TOKENS), since
# every running sequence decodes one token a step.
MAX_NUM_SEQS_LIMIT = 512
# An adapter file is one PostgreSQL bytea value, and PostgreSQL caps a value at 1 GB: uploads stay below.
MAX_ADAPTER_MB_LIMIT = 1023
# Usage records not yet in PostgreSQL, on local disk: about 400 bytes each, so some 600,000 requests.
DEFAULT_USAGE_SPOOL_MAX_MB = 256


@dataclass(frozen=True, slots=True)
class Range:
    """The values a whole-number setting accepts, ``least`` to ``most`` (None: no upper bound), and why."""

    least: int = 1
    most: int | None = None
    why: str = ""


# Every whole-number setting and its range, checked when the settings are read (so at start).
INT_RANGES: dict[str, Range] = {
    "LORAPLEX_RAY_REPLICAS": Range(),
    "LORAPLEX_RAY_OUTPUT_PORT": Range(0, 65535, "a TCP port; 0 takes any free one"),
    "LORAPLEX_POOL_MB": Range(),
    "LORAPLEX_MAX_NUM_SEQS": Range(
        1, MAX_NUM_SEQS_LIMIT, f"the engine decodes at most {MAX_NUM_SEQS_LIMIT} tokens a step, one per sequence"
    ),
    "LORAPLEX_MAX_ADAPTER_RANK": Range(MIN_RANK, MAX_RANK, f"the engine serves LoRA ranks {MIN_RANK} to {MAX_RANK}"),
    "LORAPLEX_MAX_ADAPTER_MB": Range(
        1, MAX_ADAPTER_MB_LIMIT, "adapter files are stored as PostgreSQL bytea values, which hold 1 GB at most"
    ),
    "LORAPLEX_MAX_REQUEST_KB": Range(),
    "LORAPLEX_SHUTDOWN_GRACE_S": Range(),
    "LORAPLEX_MAX_N": Range(),
    "LORAPLEX_MAX_PROMPTS": Range(),
    "LORAPLEX_NUM_SPECULATIVE_TOKENS": Range(
        0, MAX_SPECULATIVE_TOKENS, f"0 turns speculation off; a sequence verifies at most {MAX_SPECULATIVE_TOKENS}"
    ),
    "LORAPLEX_RESPONSE_RETENTION_DAYS": Range(1, MAX_RESPONSE_RETENTION_DAYS, "ten years at most"),
    "LORAPLEX_USAGE_SPOOL_MAX_MB": Range(),
}


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
    """Engine replicas on Ray (LORAPLEX_RAY_REPLICAS, at least 1): one per GPU, or per group of CPU cores."""

    ray_replica_cpus: float | None = None
    """CPUs Ray reserves for each engine replica (LORAPLEX_RAY_REPLICA_CPUS; 0 reserves none); None: this
    machine's cores shared equally among the replicas."""

    ray_replica_gpus: float = 0.0
    """GPUs Ray gives each engine replica (LORAPLEX_RAY_REPLICA_GPUS)."""

    ray_output_port: int = 0
    """The port on this node where the engine replicas send this server the outputs of its requests
    (LORAPLEX_RAY_OUTPUT_PORT); 0: any free port. Fix it where a firewall must let the replicas' nodes in."""

    pool_bytes: int | None = None
    """Bytes of the engine's page pool (LORAPLEX_POOL_MB, in MiB); None: the engine's default."""

    max_num_seqs: int = 64
    """Most sequences the engine runs at once (LORAPLEX_MAX_NUM_SEQS, 1 to 512)."""

    dtype: str = "auto"
    """The model's precision (LORAPLEX_DTYPE): "auto", "float32", "bfloat16" or "float16" (docs/precision.md)."""

    quantization: str | None = None
    """Projection weights in 8 bits (LORAPLEX_QUANTIZATION=int8, CPU only); None: the model's dtype."""

    bf16_gemm: str = "auto"
    """The native CPU kernels' GEMM of bf16 and int8 weights (LORAPLEX_BF16_GEMM): "auto" (the faster of the
    two, timed at start), "widen" (fp32 FMAs on widened weights) or "dot" (the weight format's dot products,
    AVX512-BF16's or AVX512-VNNI's; refused on a CPU without them) (docs/precision.md)."""

    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    """Most tokens n-gram speculative decoding proposes per sequence and step; 0 turns it off
    (LORAPLEX_NUM_SPECULATIVE_TOKENS). Outputs are the same either way; see docs/speculative-decoding.md."""

    cuda_graphs: bool = True
    """On a CUDA GPU, decode steps replay CUDA graphs instead of launching each kernel from Python
    (LORAPLEX_CUDA_GRAPHS=0: every step launched one kernel at a time); no effect on a CPU."""
    launch_ahead: bool = True
    """On a CUDA GPU, each decode step's forward pass is queued before the host has read the step before's tokens,
    so the host's work overlaps the GPU's (LORAPLEX_LAUNCH_AHEAD=0: the host and the GPU take turns); no effect
    on a CPU."""

    demo: bool = True
    """On first start with an empty database, create a demo tenant, key and adapters (LORAPLEX_DEMO=0: no)."""

    admin_key: str | None = None
    """An admin key to create on first start if no admin key exists yet (LORAPLEX_ADMIN_KEY)."""

    max_adapter_rank: int = MAX_RANK
    """Highest LoRA rank an uploaded adapter may have (LORAPLEX_MAX_ADAPTER_RANK)."""

    max_adapter_bytes: int = 512 * 1024**2
    """Largest adapter upload accepted, all files together (LORAPLEX_MAX_ADAPTER_MB, in MiB, 1 to 1023)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_KB * 1024
    """Largest body of any request but an adapter upload, 413 past it (LORAPLEX_MAX_REQUEST_KB, in KiB)."""

    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long running requests may take to finish before they are ended (LORAPLEX_SHUTDOWN_GRACE_S)."""

    max_n: int = DEFAULT_MAX_N
    """Most choices (`n`) one request may ask for per prompt (LORAPLEX_MAX_N)."""

    max_prompts: int = DEFAULT_MAX_PROMPTS
    """Most prompts one /v1/completions request may send (LORAPLEX_MAX_PROMPTS)."""

    console: bool = True
    """Serve the admin console at /console (LORAPLEX_CONSOLE=0 turns it off; the admin REST API stays)."""

    redis_url: str | None = None
    """Redis that holds the limits' state, shared by every replica (LORAPLEX_REDIS_URL); None: in this process."""

    redis_fail_rate: str = "open"
    """While Redis is away, requests and tokens a minute let requests through ("open") or refuse them with a
    503 ("closed") (LORAPLEX_REDIS_FAIL_RATE)."""

    redis_fail_concurrency: str = "open"
    """The same for the concurrency limit (LORAPLEX_REDIS_FAIL_CONCURRENCY)."""

    redis_fail_budget: str = "closed"
    """The same for the monthly budget (LORAPLEX_REDIS_FAIL_BUDGET)."""

    response_retention_days: int = DEFAULT_RESPONSE_RETENTION_DAYS
    """Days a stored response (``store: true`` on /v1/responses) is kept before it is swept, 1 to 3650
    (LORAPLEX_RESPONSE_RETENTION_DAYS)."""

    log_level: str = "info"
    """How much is logged (LORAPLEX_LOG_LEVEL): "info" (loraplex's own lines, and other libraries' warnings and
    errors only), "debug" (everything, every library's included), "warning" or "error"."""

    chat_template: Path | None = None
    """A Jinja chat template file for the base model's chat requests with tools (LORAPLEX_CHAT_TEMPLATE); None:
    the shipped ChatML template that renders tools and calls in the hermes format (docs/tools.md)."""

    tool_call_format: str = DEFAULT_TOOL_CALL_FORMAT
    """The base model's tool-call format (LORAPLEX_TOOL_CALL_FORMAT): hermes, llama3_json, mistral or pythonic."""

    usage_spool_max_bytes: int = DEFAULT_USAGE_SPOOL_MAX_MB * 1024**2
    """Most usage the local spool holds while PostgreSQL does not take it (LORAPLEX_USAGE_SPOOL_MAX_MB, in MiB);
    when it is full, new requests get a 503 until the database is back (no request is served unbilled)."""

    share_base_prefix_cache: bool = False
    """Let base-model requests of different tenants share cached prompt prefixes (LORAPLEX_SHARE_BASE_PREFIX_CACHE=1);
    off: each tenant's requests reuse only its own, so no tenant can time or count another's prompts through
    the cache (docs/operating.md#security)."""

    forwarded_allow_ips: str = "127.0.0.1"
    """The proxies whose X-Forwarded-Proto and X-Forwarded-For are believed (LORAPLEX_FORWARDED_ALLOW_IPS): IPs
    and networks, comma-separated, or "*" for any. Behind a TLS proxy on another address, name it here, so
    the console's cookies are marked Secure as the client's https requires (docs/deploying.md)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from `environ` (default: the process environment); empty values count as unset."""
        env = os.environ if environ is None else environ
        home = env.get("LORAPLEX_HOME") or platformdirs.user_data_dir(APP_NAME)
        pool_mb = _int(env, "LORAPLEX_POOL_MB", None)
        return cls(
            home=Path(home).expanduser(),
            model=env.get("LORAPLEX_MODEL") or DEFAULT_MODEL_SPEC,
            database_url=env.get("DATABASE_URL") or None,
            migrate_on_start=_flag(env, "LORAPLEX_MIGRATE", default=True),
            key_secret=env.get("LORAPLEX_KEY_SECRET") or None,
            served_model_name=env.get("LORAPLEX_SERVED_MODEL_NAME") or None,
            engine=_choice(env, "LORAPLEX_ENGINE", ENGINE_KINDS),
            ray_address=env.get("LORAPLEX_RAY_ADDRESS") or None,
            ray_replicas=_int(env, "LORAPLEX_RAY_REPLICAS", 1),
            ray_replica_cpus=_amount(env, "LORAPLEX_RAY_REPLICA_CPUS", None),
            ray_replica_gpus=_amount(env, "LORAPLEX_RAY_REPLICA_GPUS", 0.0),
            ray_output_port=_int(env, "LORAPLEX_RAY_OUTPUT_PORT", 0),
            pool_bytes=None if pool_mb is None else pool_mb * 1024**2,
            max_num_seqs=_int(env, "LORAPLEX_MAX_NUM_SEQS", 64),
            dtype=_choice(env, "LORAPLEX_DTYPE", DTYPES),
            quantization=_choice(env, "LORAPLEX_QUANTIZATION", QUANTIZATION_CHOICES)
            if env.get("LORAPLEX_QUANTIZATION")
            else None,
            bf16_gemm=_choice(env, "LORAPLEX_BF16_GEMM", BF16_GEMMS),
            num_speculative_tokens=_int(env, "LORAPLEX_NUM_SPECULATIVE_TOKENS", DEFAULT_SPECULATIVE_TOKENS),
            cuda_graphs=_flag(env, "LORAPLEX_CUDA_GRAPHS", default=True),
            launch_ahead=_flag(env, "LORAPLEX_LAUNCH_AHEAD", default=True),
            demo=_flag(env, "LORAPLEX_DEMO", default=True),
            admin_key=env.get("LORAPLEX_ADMIN_KEY") or None,
            max_adapter_rank=_int(env, "LORAPLEX_MAX_ADAPTER_RANK", MAX_RANK),
            max_adapter_bytes=_int(env, "LORAPLEX_MAX_ADAPTER_MB", 512) * 1024**2,
            max_request_bytes=_int(env, "LORAPLEX_MAX_REQUEST_KB", DEFAULT_MAX_REQUEST_KB) * 1024,
            shutdown_grace_s=_int(env, "LORAPLEX_SHUTDOWN_GRACE_S", 30),
            max_n=_int(env, "LORAPLEX_MAX_N", DEFAULT_MAX_N),
            max_prompts=_int(env, "LORAPLEX_MAX_PROMPTS", DEFAULT_MAX_PROMPTS),
            console=_flag(env, "LORAPLEX_CONSOLE", default=True),
            redis_url=env.get("LORAPLEX_REDIS_URL") or None,
            redis_fail_rate=_choice(env, "LORAPLEX_REDIS_FAIL_RATE", FAIL_OPEN_FIRST),
            redis_fail_concurrency=_choice(env, "LORAPLEX_REDIS_FAIL_CONCURRENCY", FAIL_OPEN_FIRST),
            redis_fail_budget=_choice(env, "LORAPLEX_REDIS_FAIL_BUDGET", FAIL_CLOSED_FIRST),
            response_retention_days=_int(env, "LORAPLEX_RESPONSE_RETENTION_DAYS", DEFAULT_RESPONSE_RETENTION_DAYS),
            log_level=_choice(env, "LORAPLEX_LOG_LEVEL", LOG_LEVELS),
            chat_template=Path(env["LORAPLEX_CHAT_TEMPLATE"]).expanduser()
            if env.get("LORAPLEX_CHAT_TEMPLATE")
            else None,
            tool_call_format=_choice(env, "LORAPLEX_TOOL_CALL_FORMAT", TOOL_CALL_FORMATS),
            usage_spool_max_bytes=_int(env, "LORAPLEX_USAGE_SPOOL_MAX_MB", DEFAULT_USAGE_SPOOL_MAX_MB) * 1024**2,
            share_base_prefix_cache=_flag(env, "LORAPLEX_SHARE_BASE_PREFIX_CACHE", default=False),
            forwarded_allow_ips=(env.get("LORAPLEX_FORWARDED_ALLOW_IPS") or "127.0.0.1").strip(),
        )


def log_level_from_env(environ: Mapping[str, str] | None = None) -> str:
    """LORAPLEX_LOG_LEVEL alone, for logging set up before the other settings are read."""
    return _choice(os.environ if environ is None else environ, "LORAPLEX_LOG_LEVEL", LOG_LEVELS)


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


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    """A whole number within ``INT_RANGES[name]``; ``default`` when unset."""
    value = env.get(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number, got {value!r}") from None
    allowed = INT_RANGES[name]
    if number < allowed.least or (allowed.most is not None and number > allowed.most):
        bounds = f"at least {allowed.least}" if allowed.most is None else f"{allowed.least} to {allowed.most}"
        why = f" ({allowed.why})" if allowed.why else ""
        raise SettingsError(f"{name} must be {bounds}{why}, got {number}")
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
