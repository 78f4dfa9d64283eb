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
