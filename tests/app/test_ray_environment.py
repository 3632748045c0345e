"""The Ray settings a gateway hands the processes it creates: its defaults, the operator's values winning."""

from __future__ import annotations

import pytest

from app.cluster.environment import CONTROLLER_ENVIRONMENT, REPLICA_ENVIRONMENT, component_environment


def test_a_component_gets_the_defaults_unless_the_operator_set_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    controller = component_environment(CONTROLLER_ENVIRONMENT)
    assert controller["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"
    assert controller["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    assert controller.keys() == CONTROLLER_ENVIRONMENT.keys()
    assert component_environment(REPLICA_ENVIRONMENT) == REPLICA_ENVIRONMENT  # the loop is the controller's alone
