"""The process environment Ray reads when it is imported and started, set before either happens.

Ray reads these variables once (Serve at import time), so the gateway sets them before it imports Ray;
a value the operator set wins. The engine replicas get theirs through their runtime environment and Serve's
controller through its controller options, so they hold on any cluster whatever its nodes' environment.
"""

from __future__ import annotations

import os

# Serve's throughput-optimized mode (user code and the handle's router on the caller's event loop,
# request-path logs buffered, handle calls over gRPC) cuts most of Ray's extra latency over the local
# worker process (docs/benchmarks.md#gateway-constants-and-choices). The mode also turns on Serve's direct
# ingress: an HTTP and a gRPC server in every replica and Serve's proxy actor on the head node, none of
# which the gateway uses (it calls the replicas through a handle), so direct ingress stays off.
THROUGHPUT_OPTIMIZED = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
# Ray's own bookkeeping, slowed or turned off: while a replica steps, the GCS's and the dashboard agent's
# CPU is taken from the engine's threads (docs/ray-serve.md#what-a-request-pays-for-ray measures it). So
# Ray's task-event and metrics reporting are off, and Serve's cached metrics exported every second instead
# of every 0.1 s. The gateway's own
# /metrics are unaffected; Ray's Prometheus metrics and its task list (the dashboard's state API) go
# quiet, so an operator who wants them sets these back.
QUIET_RAY = {
    "RAY_enable_task_events": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_event_stats": "0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
RAY_ENVIRONMENT = {
    **THROUGHPUT_OPTIMIZED,
    **QUIET_RAY,
    # Ray's failure signal handler turned the gateway's SIGTERM into an abort (exit code 134) after the
    # graceful shutdown had begun, with usage still buffered.
    "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1",
    # A gateway sends no usage statistics to Ray's authors unless its operator asks for it.
    "RAY_USAGE_STATS_ENABLED": "0",
    # The gateway connects to Ray once, explicitly. Without this, a deployment given up for a stop (still
    # running on its thread) started a new Ray of its own when it next called Ray after the shutdown.
    "RAY_ENABLE_AUTO_CONNECT": "0",
}
REPLICA_ENVIRONMENT = {**THROUGHPUT_OPTIMIZED, **QUIET_RAY}
# Serve's controller loops every 0.5 s instead of 0.1 s: it then takes far less of the CPU a stepping replica
# needs (docs/benchmarks.md#gateway-constants-and-choices). The loop is how other gateways' routers learn which replica
# loaded an adapter (0.5-1 s after the load); a gateway's own router does not wait for that news, it
# remembers where it sent each adapter (app/cluster/affinity_router.py).
CONTROLLER_ENVIRONMENT = {**THROUGHPUT_OPTIMIZED, **QUIET_RAY, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def configure_ray_environment() -> None:
    """Set this process's Ray variables (the operator's own values win); call it before importing Ray."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def component_environment(defaults: dict[str, str]) -> dict[str, str]:
    """``defaults`` for a Ray process this gateway creates (a replica, Serve's controller), the values the
    operator set in this process's environment winning."""
    return {name: os.environ.get(name, value) for name, value in defaults.items()}
