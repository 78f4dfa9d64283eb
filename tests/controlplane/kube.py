"""Helpers for the control-plane tests: kubectl JSON in and out."""

from __future__ import annotations

import json


def apply(cluster, obj: dict, *, check: bool = True):
    return cluster.kubectl("apply", "-f", "-", input=json.dumps(obj), check=check)


def get_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
