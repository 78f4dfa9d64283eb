from __future__ import annotations

import pytest

from atom_operator.settings import Settings


def test_defaults_and_env() -> None:
    assert Settings.from_env({}).namespaces == ()
    s = Settings.from_env(
        {
            "ATOM_OPERATOR_NAMESPACES": "a, b,,",
            "ATOM_OPERATOR_RECONCILE_INTERVAL": "2.5",
            "ATOM_OPERATOR_LOG_LEVEL": "debug",
            "ATOM_OPERATOR_DEFAULT_IMAGE": "img:x",
            "ATOM_OPERATOR_HEALTH_PORT": "9090",
        }
    )
    assert (s.namespaces, s.reconcile_interval, s.log_level, s.default_image, s.health_port) == (
        ("a", "b"),
        2.5,
        "DEBUG",
        "img:x",
        9090,
    )


def test_bad_interval_refused() -> None:
    with pytest.raises(ValueError, match="RECONCILE_INTERVAL"):
        Settings.from_env({"ATOM_OPERATOR_RECONCILE_INTERVAL": "0"})


def test_leader_election_and_policy_settings() -> None:
    s = Settings.from_env({"ATOM_OPERATOR_NAMESPACES": "team-a,team-b", "POD_NAME": "op-0"})
    assert s.leader_election and s.identity == "op-0" and not s.allow_host_volumes
    from atom_operator.settings import _SA_NAMESPACE

    if not _SA_NAMESPACE.exists():  # in a pod the Lease lives in the pod's own namespace
        assert s.lease_namespace == "team-a"
    s = Settings.from_env(
        {
            "ATOM_OPERATOR_LEADER_ELECTION": "false",
            "ATOM_OPERATOR_LEASE_NAMESPACE": "ops",
            "ATOM_OPERATOR_LEASE_NAME": "l",
            "ATOM_OPERATOR_IDENTITY": "me",
            "ATOM_OPERATOR_ALLOW_HOST_VOLUMES": "true",
            "ATOM_OPERATOR_METRICS_PORT": "0",
        }
    )
    assert (s.leader_election, s.lease_namespace, s.lease_name, s.identity) == (
        False,
        "ops",
        "l",
        "me",
    )
    assert s.allow_host_volumes and s.metrics_port == 0
