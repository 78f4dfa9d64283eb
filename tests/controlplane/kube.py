"""Helpers for the control-plane tests: kubectl JSON in and out, and a polling wait."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60, interval: float = 0.5):
    """Poll `check` until it returns something truthy; fail naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def apply(cluster, obj: dict, *, check: bool = True):
    return cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=check)


def get_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
